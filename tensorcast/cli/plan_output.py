"""Printing a plan result: one line per step with where it ran, how long, bytes and retries."""

from __future__ import annotations

from tensorcast.cli.common import table


def human(result: dict) -> str:
    rows = [
        [
            str(s["id"]),
            s["op"],
            s["target"]["id"],
            s.get("worker", "-"),
            s["status"],
            f"{s['duration_s']:.3f}s" if "duration_s" in s else "-",
            str(s.get("bytes", 0)),
            str(s.get("retries", 0)),
        ]
        for s in result["steps"]
    ]
    head = (
        f"plan {result['trace_id']} ({result['idempotency_key']}): {result['status']}"
        f"{' (recorded result, nothing ran)' if result.get('replayed') else ''}"
        f" in {result['duration_s']:.3f}s"
    )
    steps = table(rows, ["STEP", "OP", "TARGET", "WORKER", "STATUS", "TIME", "BYTES", "RETRIES"])
    return head + "\n" + steps
