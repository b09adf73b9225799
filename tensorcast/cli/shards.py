"""KV page shards: each shard's home worker, fencing token and lease expiry."""

from __future__ import annotations

from tensorcast.cli.common import AddrOpt, JsonOpt, StateDirOpt, TokenOpt, connect, emit, table

NAME = "shards"


def command(
    state_dir: StateDirOpt = None,
    addr: AddrOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    with connect(state_dir, addr, token) as rt:
        shards = rt.shards()
        names = {w.worker_id: w.name for w in rt.workers()}
    rows = [
        [
            str(lease.shard),
            names.get(lease.holder_worker_id, lease.holder_worker_id) if lease.held else "-",
            str(lease.token),
            f"{lease.expires_in_s:.1f}s" if lease.held else "free",
        ]
        for lease in shards.leases
    ]
    emit(
        as_json,
        {
            "num_shards": shards.num_shards,
            "lease_ttl_s": shards.lease_ttl_s,
            "live_homes": [names.get(w, w) for w in shards.live_homes],
            "shards": [
                dict(lease.to_json(), holder=names.get(lease.holder_worker_id))
                for lease in shards.leases
            ],
        },
        table(rows, ["SHARD", "HOME", "TOKEN", "LEASE"]),
    )
