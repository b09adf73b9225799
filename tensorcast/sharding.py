"""Where a KV page lives: its key picks a shard, highest-random-weight hashing ranks the
shard-home workers that may hold the shard's lease. Pure functions, shared by SDK and workers."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tensorcast.types import ShardTable

# Top-k candidates compete for a shard's lease (the paper uses k = 3).
LEASE_CANDIDATES = 3


def _h64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def shard_of(key: str, num_shards: int) -> int:
    return _h64(key) % num_shards


def hrw_rank(shard: int, worker_ids: list[str] | tuple[str, ...]) -> list[str]:
    """Candidates for `shard`, best first: the same order on every worker."""
    return sorted(worker_ids, key=lambda w: (_h64(f"{shard}/{w}"), w), reverse=True)


def settled(table: ShardTable) -> bool:
    """Every shard held by the live home hashing ranks first for it: no hand-off is due."""
    return all(
        lease.held and lease.holder_worker_id == hrw_rank(lease.shard, table.live_homes)[0]
        for lease in table.leases
    ) and bool(table.live_homes)
