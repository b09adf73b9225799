"""Stop the local cluster recorded in the state dir (workers first, then the store)."""

from __future__ import annotations

from typing import Annotated

import typer

from tensorcast.cli.common import JsonOpt, StateDirOpt, emit, state_dir_of

NAME = "down"


def command(
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout",
            min=0.1,
            max=86400,
            help="Seconds to wait for each group of processes before killing it (default: 60, "
            "plus the time disk-tier workers need to save their pools at 100 MiB/s).",
            show_default=False,
        ),
    ] = None,
    state_dir: StateDirOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Stop the cluster. Exits 1 when a process had to be killed (a disk-tier worker killed
    may not have saved everything it held)."""
    import sys

    from tensorcast.sdk.local_cluster import down

    stopped, killed = down(state_dir_of(state_dir), timeout)
    data = {
        "stopped": [{"role": p.role, "name": p.name, "pid": p.pid} for p in stopped],
        "killed": [{"role": p.role, "name": p.name, "pid": p.pid} for p in killed],
    }
    human = (
        "\n".join(f"stopped {p.name} (pid {p.pid})" for p in stopped)
        if stopped
        else "no local cluster running"
    )
    emit(as_json, data, human)
    if killed:
        names = ", ".join(f"{p.name} (pid {p.pid})" for p in killed)
        sys.stderr.write(f"error: killed {names}: it did not stop in time\n")
        raise typer.Exit(1)
