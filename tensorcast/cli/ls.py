"""List artifacts (optionally those whose id starts with PREFIX)."""

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
    state_dir: StateDirOpt = None,
    addr: AddrOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    import time

    from tensorcast.config import format_size

    with connect(state_dir, addr, token) as rt:
        infos = rt.list_artifacts(prefix)
        workers = rt.workers()
    now = time.time()
    names = {w.worker_id: w.name for w in workers}
    data = {"artifacts": [_with_names(a.to_json(), names) for a in infos]}
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
            table(rows, ["ID", "WORKER", "TIER", "PINNED", "SIZE"]),
        )
        return
    rows = [
        [
            a.art_id,
            format_size(a.size_bytes),
            str(len(a.tensors)),
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
        table(rows, ["ID", "SIZE", "TENSORS", "OWNER", "EXPIRES", "REPLICAS", "CONTENT"]),
    )


def _with_names(artifact: dict, names: dict[str, str]) -> dict:
    for replica in artifact["replicas"]:
        replica["worker"] = names.get(replica["worker_id"], "")
    artifact["lost"] = not artifact["replicas"]  # no live copy: `tc rm --lost` removes these
    return artifact
