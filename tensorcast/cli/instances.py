"""Engine instances attached to workers, with the load they report (waiting and running
requests, cached tokens) and their heartbeat age: the input of routing policies."""

from __future__ import annotations

from tensorcast.cli.common import AddrOpt, JsonOpt, StateDirOpt, TokenOpt, connect, emit, table

NAME = "instances"


def command(
    state_dir: StateDirOpt = None,
    addr: AddrOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    with connect(state_dir, addr, token) as rt:
        snapshot = rt.signals().list_instances()
    rows = [
        [
            i.instance_id,
            i.engine,
            i.worker_name or i.worker_id,
            i.endpoint or "-",
            str(i.waiting),
            str(i.running),
            str(i.cached_tokens),
            str(len(i.requests)),
            f"{i.heartbeat_age_s:.1f}s",
            "alive" if i.alive else "dead",
        ]
        for i in snapshot
    ]
    header = ["INSTANCE", "ENGINE", "WORKER", "ENDPOINT", "WAITING", "RUNNING", "CACHED", "REQS"]
    emit(
        as_json,
        {"age_s": round(snapshot.age_s, 3), "instances": [i.to_json() for i in snapshot]},
        table(rows, [*header, "HEARTBEAT", "STATE"]) if rows else "no instances attached",
    )
