"""Worker-to-worker replication: tickets that let peers pull a content from this worker's pool,
and prefetch, which pulls a content from the best peer into this one.

A ticket holds its content (it cannot be freed mid-transfer) until closed or expired. A pulled
replica is verified against the per-tensor hashes recorded in the Global Store before it is
committed and listed: a partial or corrupt replica is never visible.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from tensorcast.config import send_token
from tensorcast.errors import (
    DeadlineExceeded,
    IntegrityError,
    NotFound,
    TensorcastError,
    Unavailable,
)
from tensorcast.placement import order_sources
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.rpc.client import Stub
from tensorcast.rpc.convert import replica_from_pb, tensors_from_pb, worker_from_pb
from tensorcast.transport import native
from tensorcast.worker.node import WorkerNode
from tensorcast.worker.pool import Content

DEFAULT_TICKET_TTL_MS = 120_000
# A ticket no READ used for this long is closed early: its puller died (a live pull reads every
# few milliseconds, and gives up a connection after 10 s without data), and its hold would keep
# the content in memory until the ticket's deadline.
TICKET_IDLE_S = 20.0
MAX_TICKETS = 1024


@dataclass
class _Ticket:
    content: Content
    expires_at: float


@dataclass(frozen=True)
class PrefetchResult:
    already_present: bool
    bytes_moved: int
    source_worker_id: str
    elapsed_s: float
    retries: int


class Transfers:
    def __init__(self, node: WorkerNode, data_server: Any) -> None:
        self.node = node
        self.data_server = data_server
        self._tickets: dict[int, _Ticket] = {}
        self._lock = threading.Lock()
        self._inflight: dict[str, threading.Lock] = {}
        self.bytes_received_total = 0
        node.active_transfers = self.active
        node.transfer_bytes_total = lambda: (
            self.data_server.stats()["bytes_sent"] + self.bytes_received_total
        )

    # -- serving peers -------------------------------------------------------------------------

    def open(self, content_id: str, ttl_ms: int) -> tuple[int, Content]:
        ttl_ms = min(ttl_ms or DEFAULT_TICKET_TTL_MS, 10 * DEFAULT_TICKET_TTL_MS)
        self.expire()
        with self._lock:
            if len(self._tickets) >= MAX_TICKETS:
                raise Unavailable("too many transfers in flight on this worker; retry later")
        content = self.node.load_and_hold(content_id)
        ticket = self.data_server.open_ticket(content.offset, content.size_bytes, ttl_ms)
        with self._lock:
            self._tickets[ticket] = _Ticket(content, time.monotonic() + ttl_ms / 1000)
        return ticket, content

    def close(self, ticket: int) -> None:
        with self._lock:
            entry = self._tickets.pop(ticket, None)
        if entry is not None:
            self.data_server.close_ticket(ticket)
            self.node.pool.release(entry.content)

    def expire(self) -> None:
        """Close tickets past their deadline, and those left idle by a puller that died."""
        now = time.monotonic()
        idle = set(self.data_server.idle_tickets(int(TICKET_IDLE_S * 1000)))
        with self._lock:
            expired = [t for t, e in self._tickets.items() if e.expires_at <= now or t in idle]
        for ticket in expired:
            self.close(ticket)

    def active(self) -> int:
        with self._lock:
            return len(self._tickets)

    # -- pulling from peers --------------------------------------------------------------------

    @staticmethod
    def _close_remote(peer: Stub, ticket: int, deadline: float) -> None:
        """Best effort, within the caller's deadline: an unclosed ticket expires by itself."""
        remaining = deadline - time.monotonic()
        if remaining < 0.05:
            return
        try:
            peer.call(
                "CloseTransfer",
                pb.CloseTransferRequest(ticket=ticket),
                timeout_s=min(1.0, remaining),
            )
        except TensorcastError:
            pass

    def prefetch(self, content_id: str, timeout_s: float, streams: int) -> PrefetchResult:
        started = time.monotonic()
        deadline = started + timeout_s
        with self._lock:
            gate = self._inflight.setdefault(content_id, threading.Lock())
        # One pull per content at a time; a concurrent caller waits and finds it present.
        if not gate.acquire(timeout=timeout_s):
            raise DeadlineExceeded(f"prefetch of {content_id} did not finish in {timeout_s}s")
        try:
            try:
                self.node.load(content_id)
                return PrefetchResult(True, 0, self.node.worker_id, 0.0, 0)
            except NotFound:
                pass
            return self._pull(content_id, started, deadline, streams)
        finally:
            gate.release()

    def _pull(
        self, content_id: str, started: float, deadline: float, streams: int
    ) -> PrefetchResult:
        node = self.node
        found = node.store.call("FindContent", pb.FindContentRequest(content_id=content_id))
        if not found.exists:
            raise NotFound(f"no content {content_id} in the cluster")
        workers = [worker_from_pb(w) for w in node.store.call("ListWorkers", pb.Empty()).workers]
        sources = order_sources(
            [replica_from_pb(r) for r in found.replicas], workers, node.host_id, node.worker_id
        )
        if not sources:
            raise Unavailable(f"content {content_id} has no live replica to copy from")
        tensors = list(tensors_from_pb(found.tensors))
        size = max((t.offset_bytes + t.size_bytes for t in tensors), default=0)
        errors: list[str] = []
        for attempt, source in enumerate(sources):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            peer = self.node.peer(source.worker_id, source.addr, source.name)
            try:
                ticket = peer.call(
                    "OpenTransfer",
                    pb.OpenTransferRequest(
                        content_id=content_id, ttl_ms=int(remaining * 1000) + 5000
                    ),
                    timeout_s=min(remaining, 10.0),
                )
                if not all(t.hash_hex for t in tensors):
                    # Registered by reference and read for the first time by this open: the
                    # source has just recorded the hashes.
                    again = node.store.call(
                        "FindContent", pb.FindContentRequest(content_id=content_id)
                    )
                    tensors = list(tensors_from_pb(again.tensors))
                res = node.reserve(ticket.size_bytes)
                try:
                    native.pull(
                        ticket.data_addr,
                        send_token(node.token),
                        ticket.ticket,
                        ticket.offset_bytes,
                        ticket.size_bytes,
                        node.pool.mm,
                        res.offset,
                        streams=streams,
                        timeout_s=deadline - time.monotonic(),
                        tls=node.tls,
                    )
                except BaseException:
                    node.pool.abort(res.reservation_id)
                    raise
                finally:
                    self._close_remote(peer, ticket.ticket, deadline)
                node.commit(
                    res.reservation_id,
                    tensors,
                    verify_hashes=True,
                    replica=True,
                    content_id=content_id,
                )
                with self._lock:
                    self.bytes_received_total += ticket.size_bytes
                return PrefetchResult(
                    False,
                    ticket.size_bytes,
                    source.worker_id,
                    time.monotonic() - started,
                    attempt,
                )
            except (Unavailable, NotFound, IntegrityError, DeadlineExceeded) as e:
                errors.append(f"{source.name}: {e}")
        if time.monotonic() >= deadline:
            raise DeadlineExceeded(
                f"prefetch of {content_id} ({size} bytes) missed its deadline: {'; '.join(errors)}"
            )
        raise Unavailable(f"no replica of {content_id} could be copied: {'; '.join(errors)}")
