"""Giving a KV shard to the home that joined after we took it (architecture decision 30): move
the lease in the store (new fencing token), stop serving, then copy the shard's pages to the new
home in the background and drop ours."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from tensorcast.errors import FencingError, IntegrityError, InvalidArgument, TensorcastError
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.rpc.convert import shard_table_from_pb
from tensorcast.transport import native
from tensorcast.types import ShardLease

if TYPE_CHECKING:
    from tensorcast.worker.node import WorkerNode

log = logging.getLogger("tensorcast.worker")


def hand_off(node: WorkerNode, shard: int, token: int, to: str) -> None:
    """Give `shard` to the home hashing ranks first (under the heartbeat lock, so lease
    tables still apply in order), then copy its pages there in the background, keeping any
    the new home already has. Until a page is copied, reads of it find it absent."""
    sent = time.monotonic()
    try:
        reply = node.store.call(
            "HandOffShard",
            pb.HandOffShardRequest(
                worker_id=node.worker_id, shard=shard, token=token, to_worker_id=to
            ),
        )
    except (FencingError, InvalidArgument) as e:
        log.info("no hand-off of shard %d: %s", shard, e)
        return
    table = shard_table_from_pb(reply)
    lost = node.leases.update(table, sent) - {shard}
    if lost:
        node.pages.drop_shards(lost)
    threading.Thread(
        target=_finish,
        args=(node, table.lease(shard), token),
        name=f"hand-off-{shard}",
        daemon=True,
    ).start()


def _finish(node: WorkerNode, lease: ShardLease, old_token: int) -> None:
    """Copy the shard's pages (written under tokens up to `old_token`: this worker stopped
    serving the shard before this runs) to the new home, then drop them here."""
    shard = lease.shard
    pages = node.pages.home_pages(shard, max_token=old_token)
    copied = _copy_pages(node, pages, lease.holder_worker_id, lease.holder_addr, lease.token)
    # A put that passed its lease check just before the hand-off may have landed since.
    seen = {p.key for p in pages}
    late = [p for p in node.pages.home_pages(shard, max_token=old_token) if p.key not in seen]
    copied += _copy_pages(node, late, lease.holder_worker_id, lease.holder_addr, lease.token)
    node.pages.drop_shards({shard}, max_token=old_token)
    log.info(
        "handed shard %d to %s (token %d): copied %d of %d pages",
        shard,
        lease.holder_worker_id,
        lease.token,
        copied,
        len(pages) + len(late),
    )


def _copy_pages(node: WorkerNode, pages: list, home_id: str, home_addr: str, token: int) -> int:
    """PutPages (if absent) in batches below the gRPC message and page-count limits, each
    with the shortest TTL left in it, so no page outlives its original expiry. A failed
    batch loses only its pages (the engine recomputes them). Returns the pages copied."""
    from tensorcast.worker.page_service import MAX_REPLY_BYTES

    peer = node.peer(home_id, home_addr)
    batch: list[tuple[pb.Page, float]] = []  # page, monotonic expiry
    copied, size = 0, 0

    def flush() -> int:
        ttl = min((expiry for _, expiry in batch), default=0.0) - time.monotonic()
        if not batch or ttl <= 0:
            return 0
        try:
            peer.call(
                "PutPages",
                pb.PutPagesRequest(pages=[p for p, _ in batch], ttl_s=ttl, if_absent=True),
                timeout_s=10.0,
            )
        except TensorcastError as e:
            log.warning("shard hand-off: %d pages not copied to %s: %s", len(batch), home_id, e)
            return 0
        return len(batch)

    for page in pages:  # soonest to expire first
        if page.expires_at <= time.monotonic() + 0.1:
            continue
        try:
            data = node.pages.read(page)
        except IntegrityError:
            continue  # evicted meanwhile
        if batch and (size + len(data) > MAX_REPLY_BYTES or len(batch) >= native.MAX_PAGE_BATCH):
            copied += flush()
            batch, size = [], 0
        batch.append(
            (
                pb.Page(
                    key=page.key,
                    shard=page.shard,
                    token=token,
                    dtype=page.dtype,
                    shape=list(page.shape),
                    data=data,
                    hash=page.hash_hex,
                ),
                page.expires_at,
            )
        )
        size += len(data)
    return copied + flush()
