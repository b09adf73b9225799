"""Stop the local cluster recorded in the state dir (workers first, then the store)."""

from __future__ import annotations

from tensorcast.cli.common import JsonOpt, StateDirOpt, emit, state_dir_of

NAME = "down"


def command(state_dir: StateDirOpt = None, as_json: JsonOpt = False) -> None:
    from tensorcast.sdk.local_cluster import down

    stopped = down(state_dir_of(state_dir))
    data = {"stopped": [{"role": p.role, "name": p.name, "pid": p.pid} for p in stopped]}
    human = (
        "\n".join(f"stopped {p.name} (pid {p.pid})" for p in stopped)
        if stopped
        else "no local cluster running"
    )
    emit(as_json, data, human)
