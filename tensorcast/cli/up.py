"""Start a local cluster (a Global Store and N workers) in the background.

Running it again while the cluster is up does nothing and reports the running cluster.
"""

from __future__ import annotations

from typing import Annotated

import typer

from tensorcast.cli.common import JsonOpt, StateDirOpt, emit, state_dir_of
from tensorcast.config import DEFAULT_WORKER_MEM

NAME = "up"


def command(
    workers: Annotated[
        int, typer.Option("--workers", "-n", min=1, max=64, help="Number of workers.")
    ] = 1,
    mem: Annotated[
        str, typer.Option("--mem", help="Pool size per worker, e.g. 2GiB.")
    ] = DEFAULT_WORKER_MEM,
    state_dir: StateDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    from tensorcast.config import parse_size
    from tensorcast.sdk.local_cluster import up

    parse_size(mem)  # a bad size fails here, before anything starts
    result = up(state_dir_of(state_dir), workers, mem)
    r = result.record
    data = {
        "already_running": result.already_running,
        "state_dir": str(result.state_dir),
        "store_addr": r.store_addr,
        "processes": [
            {
                "role": p.role,
                "name": p.name,
                "pid": p.pid,
                "addr": p.addr,
                "log": p.log,
                "metrics_addr": p.metrics_addr,
            }
            for p in r.processes
        ],
    }
    verb = "already running" if result.already_running else "started"
    lines = [f"cluster {verb}: store {r.store_addr}, state dir {result.state_dir}"]
    lines += [
        f"  {p.name:<10} pid {p.pid:<8} {p.addr:<22} metrics http://{p.metrics_addr}/metrics"
        for p in r.processes
    ]
    emit(as_json, data, "\n".join(lines))
