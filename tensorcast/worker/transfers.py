"""Worker-to-worker replication: tickets that let peers pull a content from this worker's pool,
and prefetch, which pulls a content from the best peer into this one.

A ticket holds its content (it cannot be freed mid-transfer) until closed or expired. A pulled
replica is verified against the per-tensor hashes recorded in the Global Store before it is
committed and listed: a partial or corrupt replica is never visible.

Chain fan-out: a replica being received can be read by the next worker of a chain (a relay
ticket on the reservation; the data server makes READs wait for bytes not yet arrived and the
pull announces its verified prefix), so N destinations cost about one transfer. The reservation
is committed or freed only after its relay readers are done; each reader verifies its own copy.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
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
from tensorcast.types import TensorMeta
from tensorcast.worker.node import WorkerNode
from tensorcast.worker.pool import Content, Reservation

log = logging.getLogger(__name__)

DEFAULT_TICKET_TTL_MS = 120_000
MAX_TICKET_TTL_MS = (1 << 32) - 1  # the field is a uint32
# A ticket no READ used for this long is closed early: its puller died (a live pull reads every
# few milliseconds, and gives up a connection after 10 s without data), and its hold would keep
# the content in memory until the ticket's deadline.
TICKET_IDLE_S = 20.0
MAX_TICKETS = 1024
# A relay open waits this long at most for this worker's own pull of the content to start (the
# links of a chain are asked at once) before the reader falls back to the usual sources.
RELAY_START_WAIT_S = 5.0
# A chain's links pull in smaller chunks than the default 4 MiB: the next link reads a chunk
# only once it is whole and verified, and with several streams a few chunks complete together,
# so each link lags the one before by about streams x chunk. 1 MiB x 4 streams kept three
# links within 1.2x of one transfer on 2 Gbit/s links, 4 MiB gave 1.4x (scripts/bench/fanout.py).
CHAIN_CHUNK_BYTES = 1 << 20
# Once a relay has received everything, a reader of it that has not read for this long is
# taken for dead (a live one reads continuously now that no byte is missing): the relay stops
# waiting for it before committing.
RELAY_IDLE_S = 3.0


@dataclass
class _Ticket:
    content: Content | None  # None: a relay ticket on a replica still being received
    expires_at: float
    receiving: str = ""  # that replica's content id


@dataclass
class _Receiving:
    """A replica being pulled into a reservation here, readable by relay tickets."""

    offset: int
    size_bytes: int
    tensors: list[TensorMeta]
    tickets: set[int] = field(default_factory=set)


@dataclass
class _Gate:
    """One prefetch of a content at a time; removed when its last caller leaves."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    users: int = 0  # callers holding or waiting for `lock`


@dataclass(frozen=True)
class OpenedTicket:
    ticket: int
    offset: int
    size_bytes: int
    tensors: tuple[TensorMeta, ...]


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
        self._changed = threading.Condition(self._lock)  # receiving started/ended, ticket closed
        self._receiving: dict[str, _Receiving] = {}
        self._inflight: dict[str, _Gate] = {}
        self.bytes_received_total = 0
        node.active_transfers = self.active
        node.transfer_bytes_total = lambda: (
            self.data_server.stats()["bytes_sent"] + self.bytes_received_total
        )

    # -- serving peers -------------------------------------------------------------------------

    def open(self, content_id: str, ttl_ms: int, relay: bool = False) -> OpenedTicket:
        """A ticket on a content held here; with `relay`, also on one still being received
        (waiting up to RELAY_START_WAIT_S for that pull to start).

        It lasts `ttl_ms` (the puller asks for its own deadline), uncapped: a transfer may take
        as long as its caller allows, and a ticket whose puller died is closed once idle for
        TICKET_IDLE_S (`expire`)."""
        ttl_ms = ttl_ms or DEFAULT_TICKET_TTL_MS
        self.expire()
        with self._lock:
            if len(self._tickets) >= MAX_TICKETS:
                raise Unavailable("too many transfers in flight on this worker; retry later")
        if relay:
            opened = self._open_relay(content_id, ttl_ms)
            if opened is not None:
                return opened
        content = self.node.load_and_hold(content_id)
        ticket = self.data_server.open_ticket(content.offset, content.size_bytes, ttl_ms)
        with self._lock:
            self._tickets[ticket] = _Ticket(content, time.monotonic() + ttl_ms / 1000)
        return OpenedTicket(ticket, content.offset, content.size_bytes, content.tensors)

    def _open_relay(self, content_id: str, ttl_ms: int) -> OpenedTicket | None:
        """A ticket on the replica being received, or None once the content is held here."""
        give_up = time.monotonic() + min(RELAY_START_WAIT_S, ttl_ms / 1000)
        with self._changed:
            while True:
                receiving = self._receiving.get(content_id)
                if receiving is not None:
                    ticket = self.data_server.open_ticket(
                        receiving.offset, receiving.size_bytes, ttl_ms
                    )
                    receiving.tickets.add(ticket)
                    self._tickets[ticket] = _Ticket(
                        None, time.monotonic() + ttl_ms / 1000, receiving=content_id
                    )
                    return OpenedTicket(
                        ticket, receiving.offset, receiving.size_bytes, tuple(receiving.tensors)
                    )
                try:
                    self.node.pool.get(content_id)
                    return None
                except NotFound:
                    pass
                left = give_up - time.monotonic()
                if left <= 0:
                    raise NotFound(
                        f"worker {self.node.name} neither holds nor receives content {content_id}"
                    )
                self._changed.wait(left)

    def close(self, ticket: int) -> None:
        with self._changed:
            entry = self._tickets.pop(ticket, None)
            if entry is not None and entry.receiving in self._receiving:
                self._receiving[entry.receiving].tickets.discard(ticket)
            self._changed.notify_all()
        if entry is not None:
            self.data_server.close_ticket(ticket)
            if entry.content is not None:
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

    def prefetch(
        self,
        content_id: str,
        timeout_s: float,
        streams: int,
        relay_from: str = "",
        chain: bool = False,
    ) -> PrefetchResult:
        """Pull `content_id` here from the best replica; with `relay_from` (a chain's previous
        worker), from that worker while it receives the content itself, if it can serve.
        `chain`: this worker is a link of a chain (small chunks, so the next one lags little)."""
        started = time.monotonic()
        deadline = started + timeout_s
        with self._lock:
            gate = self._inflight.setdefault(content_id, _Gate())
            gate.users += 1
        try:
            # One pull per content at a time; a concurrent caller waits and finds it present.
            if not gate.lock.acquire(timeout=timeout_s):
                raise DeadlineExceeded(f"prefetch of {content_id} did not finish in {timeout_s}s")
            try:
                try:
                    self.node.load(content_id)
                    return PrefetchResult(True, 0, self.node.worker_id, 0.0, 0)
                except NotFound:
                    pass
                return self._pull(content_id, started, deadline, streams, relay_from, chain)
            finally:
                gate.lock.release()
        finally:
            # A gate per content ever prefetched would grow without bound.
            with self._lock:
                gate.users -= 1
                if gate.users == 0:
                    del self._inflight[content_id]

    def _pull(
        self,
        content_id: str,
        started: float,
        deadline: float,
        streams: int,
        relay_from: str,
        chain: bool,
    ) -> PrefetchResult:
        node = self.node
        found = node.store.call("FindContent", pb.FindContentRequest(content_id=content_id))
        if not found.exists:
            raise NotFound(f"no content {content_id} in the cluster")
        workers = [worker_from_pb(w) for w in node.store.call("ListWorkers", pb.Empty()).workers]
        sources = [
            (source, False)
            for source in order_sources(
                [replica_from_pb(r) for r in found.replicas],
                workers,
                node.host_id,
                node.worker_id,
            )
        ]
        upstream = next(
            (
                w
                for w in workers
                if w.worker_id == relay_from and w.alive and relay_from != node.worker_id
            ),
            None,
        )
        if upstream is not None:
            # Asked with relay, it serves a replica it holds as well: once is enough.
            sources = [(upstream, True)] + [s for s in sources if s[0].worker_id != relay_from]
        if not sources:
            raise Unavailable(f"content {content_id} has no live replica to copy from")
        tensors = list(tensors_from_pb(found.tensors))
        size = max((t.offset_bytes + t.size_bytes for t in tensors), default=0)
        errors: list[str] = []
        for attempt, (source, relay) in enumerate(sources):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            peer = self.node.peer(source.worker_id, source.addr, source.name)
            try:
                ticket = peer.call(
                    "OpenTransfer",
                    pb.OpenTransferRequest(
                        content_id=content_id,
                        ttl_ms=min(int(remaining * 1000) + 5000, MAX_TICKET_TTL_MS),  # a uint32
                        relay=relay,
                    ),
                    timeout_s=min(remaining, 10.0 + (RELAY_START_WAIT_S if relay else 0.0)),
                )
                try:
                    if not all(t.hash_hex for t in tensors):
                        # Registered by reference and read for the first time by this open: the
                        # source has just recorded the hashes.
                        again = node.store.call(
                            "FindContent", pb.FindContentRequest(content_id=content_id)
                        )
                        tensors = list(tensors_from_pb(again.tensors))
                    res = self._receive(content_id, ticket, tensors, deadline, streams, chain)
                finally:
                    self._close_remote(peer, ticket.ticket, deadline)
                # Relay readers read from the reservation: it lives until they are done.
                self._stop_receiving(content_id, wait_until=deadline - 0.5)
                try:
                    node.commit(
                        res.reservation_id,
                        tensors,
                        verify_hashes=True,
                        replica=True,
                        content_id=content_id,
                    )
                finally:
                    with self._changed:  # relay opens waiting for it find the content now
                        self._changed.notify_all()
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
                errors.append(f"{source.name}{' (relay)' if relay else ''}: {e}")
                log.warning("prefetch of %s: %s", content_id, errors[-1])
        if time.monotonic() >= deadline:
            raise DeadlineExceeded(
                f"prefetch of {content_id} ({size} bytes) missed its deadline: {'; '.join(errors)}"
            )
        raise Unavailable(f"no replica of {content_id} could be copied: {'; '.join(errors)}")

    def _receive(
        self,
        content_id: str,
        ticket: pb.TransferTicket,
        tensors: list[TensorMeta],
        deadline: float,
        streams: int,
        chain: bool,
    ) -> Reservation:
        """Pull a peer's ticket into a new reservation, served onward to relay readers as it
        arrives; on any failure the reservation is given back."""
        node = self.node
        res = node.reserve(ticket.size_bytes)
        try:
            self._begin_receiving(content_id, res, tensors)
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
                relay=self.data_server,
                chunk_bytes=CHAIN_CHUNK_BYTES if chain else 0,
            )
        except BaseException:
            self._stop_receiving(content_id, wait_until=None)  # a no-op if never begun
            node.pool.abort(res.reservation_id)
            raise
        return res

    # -- chain fan-out -------------------------------------------------------------------------

    def _begin_receiving(
        self, content_id: str, res: Reservation, tensors: list[TensorMeta]
    ) -> None:
        if res.size_bytes == 0:
            return  # nothing to serve onward: relay opens wait for the commit
        self.data_server.begin_growing(res.offset, res.size_bytes)
        with self._changed:
            self._receiving[content_id] = _Receiving(res.offset, res.size_bytes, tensors)
            self._changed.notify_all()

    def _stop_receiving(self, content_id: str, wait_until: float | None) -> None:
        """Open no more relay tickets on this reservation; wait (until `wait_until`, if any)
        for its readers to finish, unless all that are left went idle (dead readers), then cut
        off the rest (they fall back to other sources). The last look and the end happen under
        one lock: no reader slips in between."""
        with self._changed:
            receiving = self._receiving.get(content_id)
            if receiving is None:
                return
            while receiving.tickets and wait_until is not None:
                left = wait_until - time.monotonic()
                idle = self.data_server.idle_tickets(int(RELAY_IDLE_S * 1000))
                if left <= 0 or receiving.tickets <= set(idle):
                    break
                self._changed.wait(min(left, RELAY_IDLE_S / 4))
            del self._receiving[content_id]
            self._changed.notify_all()
        for ticket in list(receiving.tickets):
            self.close(ticket)
        self.data_server.end_growing(receiving.offset)
