"""List artifacts (optionally those whose id starts with PREFIX), by id; --limit and --after page
through many."""

from __future__ import annotations

from typing import Annotated

import typer

from tensorcast.cli.common import AddrOpt, JsonOpt, StateDirOpt, TokenOpt, connect, emit, table

NAME = "ls"


def command(
    prefix: Annotated[str, typer.Argument(help="Only ids starting with this.")] = "",
    replicas: Annotated[
        bool, typer.Option("--replicas", help="One row per replica: worker, tier, pin.")
    ] = False,
    limit: Annotated[
        int,
        typer.Option(
            "--limit",
            min=0,
            help="At most this many artifacts (0: all); the JSON's next_after continues.",
        ),
    ] = 0,
    after: Annotated[
        str,
        typer.Option("--after", help="Only ids sorting after this one (a previous next_after)."),
    ] = "",
    state_dir: StateDirOpt = None,
    addr: AddrOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    import time

    from tensorcast.config import format_size

    with connect(state_dir, addr, token) as rt:
        infos, next_after = rt.list_artifacts_page(prefix, after=after, limit=limit)
        while next_after and (limit == 0 or len(infos) < limit):
            page, next_after = rt.list_artifacts_page(
                prefix, after=next_after, limit=limit - len(infos) if limit else 0
            )
            infos += page
        workers = rt.workers()
    now = time.time()
    names = {w.worker_id: w.name for w in workers}
    data = {
        "artifacts": [_with_names(a.to_json(), names) for a in infos],
        "next_after": next_after or None,
    }
    if replicas:
        rows = [
            [
                a.art_id,
                names.get(r.worker_id, r.worker_id),
                r.tier,
                "yes" if r.pinned else "no",
                format_size(a.size_bytes),
            ]
            for a in infos
            for r in a.replicas
        ]
        emit(
            as_json,
            data,
            table(rows, ["ID", "WORKER", "TIER", "PINNED", "SIZE"])
            + _more(next_after, prefix, limit, "--replicas"),
        )
        return
    rows = [
        [
            a.art_id,
            format_size(a.size_bytes),
            str(a.num_tensors),
            a.owner,
            f"{a.expires_at - now:.0f}s" if a.expires_at else "-",
            str(len(a.replicas)) if a.replicas else "0 (lost)",
            a.content_id[:15],
        ]
        for a in infos
    ]
    emit(
        as_json,
        data,
        table(rows, ["ID", "SIZE", "TENSORS", "OWNER", "EXPIRES", "REPLICAS", "CONTENT"])
        + _more(next_after, prefix, limit),
    )


def _more(next_after: str, prefix: str, limit: int, *flags: str) -> str:
    """The command that lists the next page (the same prefix, limit and view)."""
    if not next_after:
        return ""
    import shlex

    args = ["tc", "ls", *([prefix] if prefix else []), *flags, "--after", next_after]
    args += ["--limit", str(limit)] if limit else []
    return f"\n(more: {shlex.join(args)})"


def _with_names(artifact: dict, names: dict[str, str]) -> dict:
    for replica in artifact["replicas"]:
        replica["worker"] = names.get(replica["worker_id"], "")
    artifact["lost"] = not artifact["replicas"]  # no live copy: `tc rm --lost` removes these
    return artifact
