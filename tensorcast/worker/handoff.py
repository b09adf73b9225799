"""Giving a KV shard to another home (architecture decisions 30, 121): to one that joined after
we took it, or to the next home when this worker stops. Stop serving the shard, move the lease
in the store (new fencing token), then copy the shard's pages to the new home and drop ours."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from tensorcast.config import send_token
from tensorcast.errors import TensorcastError
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.rpc.convert import shard_table_from_pb
from tensorcast.transport import native
from tensorcast.types import ShardLease

if TYPE_CHECKING:
    from tensorcast.worker.node import WorkerNode

log = logging.getLogger("tensorcast.worker")
HANDOFF_BATCH_BYTES = 48 * 1024 * 1024  # page bytes per request to the new home
HANDOFF_TTL_SLACK_S = 1.0  # pages of one batch expire at most this far apart
HANDOFF_COPY_S = 10.0  # most seconds one hand-off's copying takes (one batch's at most)


def hand_off(node: WorkerNode, shard: int, token: int, to: str) -> ShardLease | None:
    """Give `shard` to `to` (under the heartbeat lock, so lease tables still apply in order):
    stop serving it, then move its lease in the store. Returns the new lease, whose pages
    `copy_and_drop` must then copy; None if the store refused (this worker serves it again).
    Until a page is copied, reads of it find it absent."""
    if not node.leases.begin_hand_off(shard, token):
        return None
    sent = time.monotonic()
    try:
        reply = node.store.call(
            "HandOffShard",
            pb.HandOffShardRequest(
                worker_id=node.worker_id, shard=shard, token=token, to_worker_id=to
            ),
        )
    except TensorcastError as e:
        # Refused, or no answer: the lease stays ours, or moved and the next table says so
        # (this worker serves it until then, as it would have without the hand-off).
        log.info("no hand-off of shard %d: %s", shard, e)
        node.leases.end_hand_off(shard, moved=False)
        return None
    table = shard_table_from_pb(reply)
    node.drop_lost_pages(node.leases.update(table, sent))
    return table.lease(shard)


def copy_and_drop(node: WorkerNode, lease: ShardLease, old_token: int, deadline: float) -> None:
    """Copy the shard's pages (written under tokens up to `old_token`: this worker stopped
    serving the shard before the lease moved) to the new home by `deadline`, then drop them
    here."""
    shard = lease.shard
    try:
        pages = node.pages.home_pages(shard, max_token=old_token)
        copied = _copy_pages(node, pages, lease, deadline)
        # A put that passed its lease check just before the hand-off may have landed since.
        seen = {p.key for p in pages}
        late = [p for p in node.pages.home_pages(shard, max_token=old_token) if p.key not in seen]
        copied += _copy_pages(node, late, lease, deadline)
        node.pages.drop_shards({shard}, max_token=old_token)
    finally:
        node.leases.end_hand_off(shard, moved=True)
    log.info(
        "handed shard %d to %s (token %d): copied %d of %d pages",
        shard,
        lease.holder_worker_id,
        lease.token,
        copied,
        len(pages) + len(late),
    )


def _copy_pages(node: WorkerNode, pages: list, lease: ShardLease, deadline: float) -> int:
    """Put the pages (if absent) at the new home over the native data plane, sent straight from
    this pool with the hashes they were stored under (the new home checks the bytes: a page
    evicted and overwritten meanwhile fails its batch), in batches bounded in bytes and pages
    of pages put with the same TTL that expire within HANDOFF_TTL_SLACK_S of each other, each
    batch leased for the time its first page has left (no page outlives its original expiry,
    nor loses more than that) and renewed by reads for that TTL.
    A failed batch, or one past `deadline`, loses only its pages (the engine recomputes
    them). Returns the pages copied."""
    if not pages:
        return 0
    home_id = lease.holder_worker_id
    try:
        workers = node.store.call("ListWorkers", pb.Empty()).workers
        data_addr = next(w.data_addr for w in workers if w.worker_id == home_id and w.data_addr)
    except (TensorcastError, StopIteration):
        log.warning("shard hand-off: %d pages not copied: %s has no data port", len(pages), home_id)
        return 0
    batch: list = []
    copied, size = 0, 0

    def flush() -> int:
        left = min((p.expires_at for p in batch), default=0.0) - time.monotonic()
        timeout_s = min(deadline - time.monotonic(), HANDOFF_COPY_S)
        if not batch or left <= 0 or timeout_s <= 0:
            return 0
        _, failures = native.remote_put(
            [(p.key, p.shard, lease.token, p.dtype, p.shape) for p in batch],
            [node.pages.pool.region(p.offset, p.size_bytes) for p in batch],
            [native.remote_home(data_addr, list(range(len(batch))))],
            send_token(node.token),
            ttl_s=batch[0].ttl_s,
            hashes=[p.hash_hex for p in batch],
            if_absent=True,
            tls=node.tls,
            timeout_s=timeout_s,
            expires_in_s=min(left, batch[0].ttl_s),
        )
        if failures[0] is not None:
            log.warning(
                "shard hand-off: %d pages not copied to %s: %s", len(batch), home_id, failures[0]
            )
            return 0
        return len(batch)

    for page in pages:  # soonest to expire first
        if page.expires_at <= time.monotonic() + 0.1:
            continue
        if batch and (
            size + page.size_bytes > HANDOFF_BATCH_BYTES
            or len(batch) >= native.MAX_PAGE_BATCH
            # a batch's pages all get its first page's time left: only pages close to it,
            # and renew for one TTL: only pages put with it
            or page.expires_at > batch[0].expires_at + HANDOFF_TTL_SLACK_S
            or page.ttl_s != batch[0].ttl_s
        ):
            copied += flush()
            batch, size = [], 0
        batch.append(page)
        size += page.size_bytes
    return copied + flush()
