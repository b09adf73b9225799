"""What a worker's heartbeats say about its replicas: what changed since the inventory the
Global Store last acknowledged, and the whole inventory now and then (architecture.md
decision 85). A worker holding 10,000 contents so sends a few ids a second, not 10,000, and
the store's one writer diffs nothing on its behalf."""

from __future__ import annotations

from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.store.base import REPLICA_TIERS, BeatResult, Inventory, ReplicaKey

# A full inventory this often even when every delta was acknowledged: repairs whatever drift a
# bug or an operator's hand could leave in the store's rows.
FULL_INVENTORY_EVERY_S = 30.0


class InventoryReporter:
    """Builds each heartbeat's inventory and learns from the store's answer. Not thread-safe:
    the worker sends one heartbeat at a time."""

    def __init__(self) -> None:
        self._epoch = 0  # the last inventory's number
        self._acked_epoch = 0  # 0: nothing acknowledged (a new worker, a store that asked)
        self._acked: dict[ReplicaKey, bool] = {}
        self._kept: frozenset[ReplicaKey] = frozenset()  # removals the store has not applied
        self._full_at = float("-inf")

    def report(self, held: dict[ReplicaKey, bool], now: float) -> Inventory:
        """The inventory for a beat sent at `now` (monotonic) while holding `held`."""
        self._epoch += 1
        if not self._acked_epoch or now - self._full_at >= FULL_INVENTORY_EVERY_S:
            return Inventory(self._epoch, held)
        changed = {key: pinned for key, pinned in held.items() if self._acked.get(key) != pinned}
        removed = (self._acked.keys() | self._kept) - held.keys()
        return Inventory(self._epoch, changed, frozenset(removed), self._acked_epoch)

    def answered(
        self, sent: Inventory, held: dict[ReplicaKey, bool], result: BeatResult, now: float
    ) -> None:
        """The store answered the beat that sent `sent` (built from `held`)."""
        if result.resync:
            self._acked_epoch = 0
            return
        # What the store said to drop is not counted as acknowledged: if the worker still
        # holds it next time (a newer commit kept it), it is reported again.
        drop = set(result.drop_content_ids)
        self._acked = {key: p for key, p in held.items() if key[0] not in drop}
        self._acked_epoch, self._kept = sent.epoch, result.kept
        if sent.is_full:
            self._full_at = now

    def forget(self) -> None:
        """The store lost track of this worker (it registered again): send everything next."""
        self._acked_epoch = 0


def inventory_fields(inventory: Inventory) -> dict:
    """`HeartbeatRequest` fields for `inventory`."""
    by_tier: dict[str, list[str]] = {tier: [] for tier in REPLICA_TIERS}
    for content_id, tier in inventory.held:
        by_tier[tier].append(content_id)
    return {
        "content_ids": by_tier["cpu"],
        "disk_content_ids": by_tier["disk"],
        "file_content_ids": by_tier["file"],
        "pinned_content_ids": sorted({c for (c, _), p in inventory.held.items() if p}),
        "inventory_epoch": inventory.epoch,
        "base_epoch": inventory.base_epoch,
        "removed": [pb.ReplicaRef(content_id=c, tier=t) for c, t in sorted(inventory.removed)],
    }


def beat_result(reply: pb.HeartbeatReply) -> BeatResult:
    return BeatResult(
        list(reply.drop_content_ids),
        resync=reply.resync,
        kept=frozenset((r.content_id, r.tier) for r in reply.kept),
    )
