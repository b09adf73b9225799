"""The worker's cached KV shard lease table, refreshed by every heartbeat.

Page operations check leases here and never ask the Global Store. A home stops serving a shard
when its own view of the lease runs out, before the store can hand it to someone else: the
local deadline is taken from when the heartbeat was *sent*, so it errs early.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from tensorcast.errors import FencingError
from tensorcast.sharding import LEASE_CANDIDATES, hrw_rank
from tensorcast.types import ShardTable

Held = dict[int, tuple[int, float]]  # shard -> (token, local monotonic deadline)


class LeaseCache:
    def __init__(self, worker_id: str, publish: Callable[[Held], None] | None = None) -> None:
        """`publish` receives every new set of held leases (the native page index checks
        same-host page operations against it without calling back into Python)."""
        self.worker_id = worker_id
        self._publish = publish
        self.table: ShardTable | None = None
        self._held: Held = {}
        self._applied_sent_at = float("-inf")
        self._seen: dict[int, tuple[int, float]] = {}  # shard -> newest (token, sent_at) taken
        # shard -> the last token this worker held it under, kept while its lease lapses with
        # no other holder (the pages stay: they are the shard's, unless someone else held it)
        self._own: dict[int, int] = {}
        # shard -> the lease this worker is handing off: not served from the moment the
        # hand-off starts (never two homes taking writes), its pages kept for the copy
        self._handing: Held = {}
        self._lock = threading.Lock()

    def update(self, table: ShardTable, sent_at: float) -> dict[int, int | None]:
        """Take a fresh table (from a reply to a request sent at monotonic `sent_at`).

        Returns the shards whose pages must go, each with the newest token of the pages to
        drop (None: all of them). Heartbeats, hand-offs and on-demand refreshes run concurrently
        and their replies may land in any order, and a reply sent later may still describe the
        store before another's change: each shard's entry is taken only if it is newer than the
        one taken before, by fencing token first (tokens grow by one on every grant), then by
        when its request was sent (a renewal under the same token). A stale table never brings
        back a lease that moved.

        A lease that lapsed still naming this worker (the store unreachable for longer than
        the lease TTL) stops being served but keeps its pages: nobody else wrote the shard,
        and this worker takes it back under the next token. Taken back under a later one,
        another home held it meanwhile (its table never reached us): the pages are stale.
        """
        with self._lock:
            held = dict(self._held)
            drop: dict[int, int | None] = {}
            for lease in table.leases:
                shard = lease.shard
                seen = self._seen.get(shard)
                if seen is not None and (lease.token, sent_at) < seen:
                    continue
                self._seen[shard] = (lease.token, sent_at)
                mine = lease.holder_worker_id == self.worker_id
                handing = self._handing.get(shard)
                if lease.held and mine and handing is not None and lease.token <= handing[0]:
                    continue  # a table from before the hand-off: it stays unserved
                if lease.held and mine:
                    before = self._own.get(shard)
                    if before is not None and lease.token > before + 1:
                        drop[shard] = before
                    self._own[shard] = lease.token
                    held[shard] = (lease.token, sent_at + lease.expires_in_s)
                    continue
                held.pop(shard, None)
                if not mine and shard in self._own:
                    del self._own[shard]
                    if handing is None:  # a hand-off drops its pages once they are copied
                        drop[shard] = None
            self._held = held
            if sent_at >= self._applied_sent_at:
                self._applied_sent_at = sent_at
                self.table = table
            if self._publish is not None:  # under the lock: tables are published in order
                self._publish(self._held)
            return drop

    def begin_hand_off(self, shard: int, token: int) -> bool:
        """Stop serving `shard` (held under `token`) before asking the store to move it, so
        the new home never takes writes while this one still does. False if not held so."""
        with self._lock:
            entry = self._held.get(shard)
            if entry is None or entry[0] != token or shard in self._handing:
                return False
            self._handing[shard] = entry
            del self._held[shard]
            if self._publish is not None:
                self._publish(self._held)
            return True

    def end_hand_off(self, shard: int, moved: bool) -> None:
        """The hand-off of `shard` is over: its pages were copied (`moved`), or the store
        refused to move the lease, which this worker then serves again (unless a newer token
        was seen meanwhile)."""
        with self._lock:
            entry = self._handing.pop(shard)
            if moved or self._seen[shard][0] != entry[0]:
                return
            self._held[shard] = entry
            if self._publish is not None:
                self._publish(self._held)

    def held(self) -> dict[int, int]:
        """shard -> token, for the leases this worker holds and still trusts."""
        now = time.monotonic()
        with self._lock:
            return {s: tok for s, (tok, deadline) in self._held.items() if deadline > now}

    def check(self, shard: int, token: int) -> None:
        """Raise FencingError unless this worker homes `shard` under exactly `token`."""
        with self._lock:
            entry = self._held.get(shard)
        if entry is None or entry[1] <= time.monotonic():
            raise FencingError(
                f"worker {self.worker_id} is not the home of shard {shard} (any more): "
                "refresh the lease table"
            )
        if entry[0] != token:
            raise FencingError(
                f"stale fencing token {token} for shard {shard}: the current token is {entry[0]}"
            )

    def is_newer(self, shard: int, token: int) -> bool:
        """True if `token` is newer than the one in our table for `shard` (we missed a move)."""
        with self._lock:
            table = self.table
        if table is None or not 0 <= shard < table.num_shards:
            return table is None
        return token > table.lease(shard).token

    def to_hand_off(self) -> list[tuple[int, int, str]]:
        """(shard, token, new home) for held shards that hashing ranks another live home first
        for: a home that joined after we took the shard."""
        with self._lock:
            table = self.table
            held = {s: tok for s, (tok, _) in self._held.items()}
        if table is None or self.worker_id not in table.live_homes:
            return []
        moves = []
        for shard, token in sorted(held.items()):
            first = hrw_rank(shard, table.live_homes)[0]
            if first != self.worker_id:
                moves.append((shard, token, first))
        return moves

    def to_acquire(self, interval_s: float, store_reached_for_s: float) -> list[int]:
        """Free shards this worker should bid for. Its own lapsed leases at once (their pages
        are here). Another home's lapsed lease: never while that home is live (it takes its
        shard back itself), and not before this worker has reached the store for a lease TTL
        (after a store outage every home beats again within it: the first one back must not
        take the others' shards). Then, as for a shard nobody held: if it ranks in the top k
        of live homes and the better-ranked candidates had `rank` heartbeat intervals to take
        the shard first."""
        with self._lock:
            table = self.table
        if table is None or self.worker_id not in table.live_homes:
            return []
        wanted = []
        for lease in table.leases:
            holder = lease.holder_worker_id
            if lease.held:
                continue
            if holder == self.worker_id:
                wanted.append(lease.shard)
                continue
            if holder and (holder in table.live_homes or store_reached_for_s < table.lease_ttl_s):
                continue
            rank = hrw_rank(lease.shard, table.live_homes).index(self.worker_id)
            free_for_s = -lease.expires_in_s
            if rank < LEASE_CANDIDATES and free_for_s >= rank * interval_s:
                wanted.append(lease.shard)
        return wanted
