"""Run the paper's rebalancing policy (Algorithm 1) against the cluster's instances: read their
load (signals) and per-request detail (each engine's GET /requests), and when the most loaded
instance is far enough above the least loaded one, move its best-scoring idle request with its
KV cache there as one plan (publish, prefetch_many, hydrate, evict) keyed by the decision.
One tick by default; --every SECONDS keeps ticking (EWMA load carried between ticks)."""

from __future__ import annotations

from typing import Annotated

import typer

from tensorcast.cli.common import AddrOpt, JsonOpt, StateDirOpt, TokenOpt, connect, emit, table
from tensorcast.cli.publish import DeadlineOpt

NAME = "rebalance"


def command(
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the decision, move nothing.")
    ] = False,
    every: Annotated[
        float,
        typer.Option(
            "--every",
            min=0.0,
            max=86400,
            help="Tick every SECONDS until interrupted (or --ticks); 0: one tick.",
        ),
    ] = 0.0,
    ticks: Annotated[
        int, typer.Option("--ticks", min=0, help="With --every: stop after N ticks (0: never).")
    ] = 0,
    instance: Annotated[
        list[str] | None,
        typer.Option(
            "--instance",
            help="Only these instances (repeatable; default: all).",
            show_default=False,
        ),
    ] = None,
    alpha: Annotated[
        float, typer.Option("--alpha", help="EWMA weight of the newest load sample, in (0, 1].")
    ] = 0.5,
    theta_abs: Annotated[
        float, typer.Option("--theta-abs", help="Act only when the load gap is at least this.")
    ] = 2.0,
    theta_rel: Annotated[
        float, typer.Option("--theta-rel", help="Act only when the load ratio is at least this.")
    ] = 1.5,
    horizon: Annotated[
        float, typer.Option("--horizon", help="H: seconds of idleness that divide a score by e.")
    ] = 60.0,
    penalty: Annotated[
        float, typer.Option("--penalty", help="lambda: score divisor per past migration.")
    ] = 1.0,
    key_prefix: Annotated[
        str,
        typer.Option(
            "--key-prefix",
            help="Prefix of each decision's idempotency key (a random id of this run follows).",
        ),
    ] = "rebalance",
    deadline: DeadlineOpt = 30.0,
    state_dir: StateDirOpt = None,
    addr: AddrOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    import json
    import sys
    import threading

    from tensorcast.router.policy import RebalanceParams
    from tensorcast.router.rebalance import Rebalancer

    params = RebalanceParams(alpha, theta_abs, theta_rel, horizon, penalty)
    stop = threading.Event()
    with connect(state_dir, addr, token) as rt:
        rebalancer = Rebalancer(
            rt,
            params,
            only=instance or [],
            key_prefix=key_prefix,
            deadline_ms=int(deadline * 1000),
        )
        while True:
            record = rebalancer.tick(dry_run=dry_run)
            if every > 0 and as_json:
                sys.stdout.write(json.dumps(record, sort_keys=True) + "\n")
                sys.stdout.flush()
            else:
                emit(as_json, record, human(record))
            if every <= 0 or (ticks and rebalancer.ticks >= ticks):
                break
            try:
                if stop.wait(every):
                    break
            except KeyboardInterrupt:
                break
    if rebalancer.failed:
        if every > 0:
            print(f"error: {rebalancer.failed} migration(s) failed", file=sys.stderr)
        raise typer.Exit(1)


def human(record: dict) -> str:
    rows = [
        [
            iid,
            str(record["samples"].get(iid, "-")),
            f"{load:.2f}",
            "source" if iid == record["source"] else "target" if iid == record["target"] else "",
        ]
        for iid, load in record["loads"].items()
    ]
    lines = [table(rows, ["INSTANCE", "LOAD", "EWMA", "ROLE"]) if rows else "no live instances"]
    for iid, why in record.get("unreadable", {}).items():
        lines.append(f"warning: no request detail from {iid}: {why}")
    decision = record["decision"]
    if decision is None:
        lines.append(f"tick {record['tick']}: no rebalance ({record['reason']})")
        return "\n".join(lines)
    lines.append(
        f"tick {record['tick']}: move {decision['req_id']} {decision['source']} -> "
        f"{decision['target']} (score {decision['score']:.1f}, gap {record['gap']:.2f}, "
        f"ratio {record['ratio']:.2f}, key {record['idempotency_key']})"
    )
    migration = record.get("migration")
    if record["dry_run"]:
        lines.append("dry run: nothing moved")
    elif migration:
        if migration.get("status") == "failed":
            err = migration["error"]
            lines.append(f"migration failed ({err['kind']}): {err['message']}")
        else:
            replayed = " (recorded result, nothing ran)" if migration.get("replayed") else ""
            lines.append(
                f"migrated {migration['bytes']} bytes in {migration['duration_s']:.3f}s{replayed}"
            )
    return "\n".join(lines)
