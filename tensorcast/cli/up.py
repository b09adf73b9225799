"""Start a local cluster (a Global Store and N workers) in the background.

Running it again brings back whatever is missing: the store at its old address (on the same
database) and workers under their old names; processes still running are kept. Without
options it starts what was asked for last time in this state dir.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tensorcast.cli.common import JsonOpt, StateDirOpt, emit, state_dir_of

NAME = "up"


def command(
    workers: Annotated[
        int | None,
        typer.Option(
            "--workers",
            "-n",
            min=1,
            max=64,
            help="Number of workers (default: as last time, or 1).",
        ),
    ] = None,
    mem: Annotated[
        str | None,
        typer.Option(
            "--mem", help="Pool size per worker, e.g. 2GiB (default: as last time, or 1GiB)."
        ),
    ] = None,
    disk: Annotated[
        Path | None,
        typer.Option(
            "--disk",
            help="Give every worker a disk tier in DIR/<worker name>: what a worker holds is "
            "written there when it stops and served again after the next tc up.",
        ),
    ] = None,
    ha: Annotated[
        bool,
        typer.Option(
            "--ha",
            help="High availability: a 3-member etcd cluster (Debian's etcd-server) holds the "
            "records, two Global Store processes serve it, and workers and callers fail over "
            "between them. Kept for later tc up runs of this state dir.",
        ),
    ] = False,
    tls: Annotated[
        bool,
        typer.Option(
            "--tls",
            help="Mutual TLS everywhere: a local CA and a certificate in STATE_DIR/tls, given to "
            "every process; tc commands find them there. Kept for later tc up runs.",
        ),
    ] = False,
    state_dir: StateDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    from tensorcast.config import parse_size
    from tensorcast.sdk.local_cluster import up

    if mem is not None:
        parse_size(mem)  # a bad size fails here, before anything starts
    result = up(state_dir_of(state_dir), workers, mem, disk=disk, ha=ha, tls=tls)
    r = result.record
    data = {
        "already_running": result.already_running,
        "state_dir": str(result.state_dir),
        "store_addr": r.store_addr,
        "started": result.started,
        "adopted": result.adopted,
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
    if result.already_running:
        verb = "already running"
    elif result.adopted:
        verb = f"restarted {', '.join(result.started)}; kept {', '.join(result.adopted)}"
    else:
        verb = "started"
    lines = [f"cluster {verb}: store {r.store_addr}, state dir {result.state_dir}"]
    lines += [
        f"  {p.name:<10} pid {p.pid:<8} {p.addr:<22}"
        + (f" metrics http://{p.metrics_addr}/metrics" if p.metrics_addr else "")
        for p in r.processes
    ]
    emit(as_json, data, "\n".join(lines))
