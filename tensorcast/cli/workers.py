"""Workers as callers' policies see them (`rt.signals().list_workers()`): roles, memory, replicas,
transfer rate and heartbeat age. The rate needs two samples: --interval waits between them."""

from __future__ import annotations

from typing import Annotated

import typer

from tensorcast.cli.common import AddrOpt, JsonOpt, StateDirOpt, TokenOpt, connect, emit, table

NAME = "workers"


def command(
    interval: Annotated[
        float, typer.Option("--interval", min=0, max=60, help="Seconds between rate samples.")
    ] = 0.5,
    state_dir: StateDirOpt = None,
    addr: AddrOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    import time

    from tensorcast.config import format_size

    with connect(state_dir, addr, token) as rt:
        signals = rt.signals()
        signals.list_workers()
        time.sleep(interval)
        snapshot = signals.list_workers()
    rows = [
        [
            s.worker.name,
            ",".join(s.worker.roles),
            f"{format_size(s.worker.mem_used_bytes)}/{format_size(s.worker.mem_cap_bytes)}",
            str(s.worker.num_replicas),
            f"{s.transfer_rate_bps / 1e6:.1f} MB/s",
            f"{s.worker.heartbeat_age_s:.1f}s",
            "healthy" if s.healthy else "dead",
        ]
        for s in snapshot
    ]
    emit(
        as_json,
        {"age_s": round(snapshot.age_s, 3), "workers": [s.to_json() for s in snapshot]},
        table(rows, ["NAME", "ROLES", "MEMORY", "REPLICAS", "TRANSFER", "HEARTBEAT", "STATE"]),
    )
