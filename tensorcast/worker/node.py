"""The worker's state and its conversation with the Global Store: registration, heartbeats,
committing contents (cluster-wide dedupe, then replica registration) and dropping them."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace

from tensorcast.config import DEFAULT_HEARTBEAT_TTL_S, TLSFiles, host_id
from tensorcast.errors import (
    DeadlineExceeded,
    IntegrityError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    TensorcastError,
    Unavailable,
)
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.proto import tensorcast_pb2_grpc as pb_grpc
from tensorcast.rpc.client import Stub, make_channel
from tensorcast.rpc.convert import (
    artifact_from_pb,
    instance_to_pb,
    shard_table_from_pb,
    tensor_to_pb,
    tensors_from_pb,
)
from tensorcast.rpc.frames import StoreClient
from tensorcast.sharding import hrw_rank
from tensorcast.store.base import Inventory, ReplicaKey, member
from tensorcast.types import ArtifactInfo, Committed, TensorMeta
from tensorcast.worker.disk_tier import DiskTier
from tensorcast.worker.file_refs import FileReference, FileReferences, describe
from tensorcast.worker.handoff import HANDOFF_COPY_S, copy_and_drop, hand_off
from tensorcast.worker.instances import Instances
from tensorcast.worker.inventory import InventoryReporter, beat_result, inventory_fields
from tensorcast.worker.leases import LeaseCache
from tensorcast.worker.pages import PageStore
from tensorcast.worker.pool import Content, Pool, Reservation
from tensorcast.worker.store_batch import StoreBatcher

log = logging.getLogger("tensorcast.worker")

HANDOFFS_PER_BEAT = 2  # shards given to a newly joined home per heartbeat (spreads the copying)
REFRESH_MIN_INTERVAL_S = 0.05
HEARTBEAT_BACKOFF = 2.0  # most intervals between beats while the store is unreachable
LOAD_LOCKS = 64

ROLES = ("basic", "gateway", "shard-home")


class WorkerNode:
    def __init__(
        self,
        pool: Pool,
        store_addr: str,
        token: str,
        name: str,
        roles: tuple[str, ...],
        rpc_timeout_s: float,
        disk: DiskTier | None = None,
        tls: TLSFiles | None = None,
    ) -> None:
        self.pool = pool
        self.disk = disk
        self.references = FileReferences()
        self.inventory = InventoryReporter()
        # One load per content at a time, through a fixed set of locks (bounded memory).
        self._load_locks = [threading.Lock() for _ in range(LOAD_LOCKS)]
        self.worker_id = uuid.uuid4().hex[:12]
        self.name = name or f"worker-{self.worker_id[:6]}"
        self.roles = roles
        self.host_id = host_id()
        self.token = token
        self.addr = ""
        self.data_addr = ""
        self.metrics_addr = ""
        # Outgoing transfers in flight (set by the transfer service): the load peers see.
        self.active_transfers: Callable[[], int] = lambda: 0
        self.transfer_bytes_total: Callable[[], int] = lambda: 0
        self.store_addr = store_addr
        self.heartbeat_interval_s = 1.0
        self.heartbeat_ttl_s = DEFAULT_HEARTBEAT_TTL_S  # the store's, once registered
        # KV pages (homed or cached), the shard leases behind them, attached instances.
        self.pages = PageStore(pool)
        self.leases = LeaseCache(self.worker_id, self.pages.index.set_leases)
        self.instances = Instances(self.worker_id, self.name)
        self.instances.on_change = self._report_soon
        # One address, or several members of a replicated store ("h1:7400,h2:7400").
        self.tls = tls
        self.rpc_timeout_s = rpc_timeout_s
        self.store = StoreClient(store_addr, token, rpc_timeout_s, tls)
        # Same-host callers' store requests (puts, lookups, deletes), coalesced.
        self.batcher = StoreBatcher(self.store, rpc_timeout_s)
        self._stop = threading.Event()
        self.last_heartbeat_ok = time.monotonic()
        self.store_reached_at = self.last_heartbeat_ok  # since when beats land without a gap
        self._peers: dict[tuple[str, str], Stub] = {}
        self._peers_lock = threading.Lock()
        self._beat_lock = threading.Lock()
        self._last_refresh = 0.0
        self._refresh_lock = threading.Lock()

    def peer(self, worker_id: str, addr: str, name: str = "") -> Stub:
        """A cached stub for another worker's service."""
        with self._peers_lock:
            stub = self._peers.get((worker_id, addr))
            if stub is None:
                stub = Stub(
                    pb_grpc.WorkerServiceStub(make_channel(addr, self.tls)),
                    f"worker {name or worker_id} ({addr})",
                    self.token,
                    30.0,
                )
                self._peers[(worker_id, addr)] = stub
            return stub

    @property
    def local_socket(self) -> str:
        return f"worker-{self.worker_id}"

    def register(self) -> float:
        stats = self.pool.stats()
        reply = self.store.call(
            "RegisterWorker",
            pb.RegisterWorkerRequest(
                worker=pb.Worker(
                    worker_id=self.worker_id,
                    name=self.name,
                    addr=self.addr,
                    host_id=self.host_id,
                    local_socket=self.local_socket,
                    roles=list(self.roles),
                    mem_cap_bytes=stats.capacity_bytes,
                    pid=os.getpid(),
                    data_addr=self.data_addr,
                )
            ),
        )
        self.heartbeat_ttl_s = reply.heartbeat_ttl_s
        return reply.heartbeat_ttl_s

    def reserve(self, size_bytes: int) -> Reservation:
        """A pool region, making room when the pool is full.

        First evicts least recently used replicas that another live worker also holds; then,
        with a disk tier, spills last copies to disk. Pinned or mapped contents never move, and
        the last copy of an artifact is never dropped silently (ResourceExhausted instead).
        """
        try:
            return self.pool.reserve(size_bytes)
        except ResourceExhausted as full:
            error = full
        if size_bytes > self.pool.capacity_bytes:
            raise error  # no eviction can make room for it: evict nothing
        for content_id in self.pool.eviction_candidates():
            found = self.store.call("FindContent", pb.FindContentRequest(content_id=content_id))
            # Unknown to the store, or registered by reference (read again from its files):
            # nothing is lost by dropping it.
            if not found.exists or self.references.get(content_id) is not None:
                if self.pool.drop(content_id):
                    log.info("evicted content %s to make room", content_id)
                    self.store.call(
                        "RemoveReplica",
                        pb.RemoveReplicaRequest(
                            worker_id=self.worker_id, content_id=content_id, tier="cpu"
                        ),
                    )
                last_copy = False
            elif any(r.worker_id != self.worker_id for r in found.replicas):
                outcome = self._give_up_copy(content_id)
                if outcome == "busy":
                    continue
                # "last": the other holders went meanwhile, or evicted theirs first
                last_copy = outcome == "last"
            else:
                last_copy = True
            if last_copy and self.disk is None:
                continue
            if last_copy and not self._spill(content_id):
                continue
            try:
                return self.pool.reserve(size_bytes)
            except ResourceExhausted as still_full:
                error = still_full
        raise ResourceExhausted(
            f"{error} (nothing evictable: the rest is pinned, in use, or the last copy"
            + ("" if self.disk else " and this worker has no --disk tier")
            + ")"
        )

    def persist(self) -> int:
        """A planned stop with a disk tier: write every content held only in memory to disk,
        so that the worker started next on this directory serves it again (its heartbeats
        report the files). Contents read from files by reference are not copied. Returns how
        many were written."""
        if self.disk is None:
            return 0
        on_disk = set(self.disk.content_ids())
        written = 0
        lost: list[str] = []
        for content_id in self.pool.stats().content_ids:
            if content_id in on_disk or self.references.get(content_id) is not None:
                continue
            try:
                content = self.pool.hold(content_id)
            except NotFound:
                continue  # dropped meanwhile
            try:
                region = self.pool.region(content.offset, content.size_bytes)
                self.disk.save(content_id, content.tensors, region)
                written += 1
            except ResourceExhausted:
                lost.append(content_id)  # the disk is full for this one: smaller ones may fit
            finally:
                self.pool.release(content)
        if lost:
            log.error(
                "the disk tier is full: %d content(s) held only in memory were not saved (%s)",
                len(lost),
                ", ".join(lost[:5]),
            )
        return written

    def _give_up_copy(self, content_id: str) -> str:
        """Drop this worker's copy of a content another live worker holds too: "dropped".
        The store decides (RemoveReplica `unless_last`, one transaction): two workers evicting
        the same content at once from FindContent snapshots would otherwise both drop it.
        "last" when the store finds this the last copy now, "busy" when the copy came into
        use here meanwhile (it stays, with its row)."""
        reply = self.store.call(
            "RemoveReplica",
            pb.RemoveReplicaRequest(
                worker_id=self.worker_id, content_id=content_id, tier="cpu", unless_last=True
            ),
        )
        if not reply.removed:
            return "last"
        if self.pool.drop(content_id):
            log.info("evicted content %s to make room", content_id)
            return "dropped"
        try:  # held or registering since it was chosen: it stays, and so must its row
            content = self.pool.get(content_id)
        except NotFound:
            return "dropped"  # by another path meanwhile
        self.store.call(
            "AddReplica",
            pb.AddReplicaRequest(
                worker_id=self.worker_id,
                content_id=content_id,
                size_bytes=content.size_bytes,
                tensors=[tensor_to_pb(t) for t in content.tensors],
            ),
        )
        return "busy"

    def _spill(self, content_id: str) -> bool:
        """Move a content from memory to the disk tier; False if it is in use meanwhile, or
        the disk has no room for it (the caller tries its next candidate: a smaller one may
        fit, or one that needs no disk)."""
        assert self.disk is not None
        try:
            content = self.pool.hold(content_id)
        except NotFound:
            return False
        try:
            region = self.pool.region(content.offset, content.size_bytes)
            self.disk.save(content_id, content.tensors, region)
        except ResourceExhausted as e:
            log.warning("cannot spill %s: %s", content_id, e)
            return False
        finally:
            self.pool.release(content)
        self.pool.drop(content_id)
        log.info("spilled content %s (%d bytes) to disk", content_id, content.size_bytes)
        self._moved_tier(content_id, old_tier="cpu")
        return True

    def load(self, content_id: str) -> None:
        """Bring a content into the pool from the disk tier or its referenced files (no-op when
        it is in memory). One load per content at a time; the others wait and find it."""
        with self._load_locks[hash(content_id) % LOAD_LOCKS]:
            try:
                self.pool.get(content_id)
                return
            except NotFound:
                ref = self.references.get(content_id)
                if ref is not None:
                    self._load_reference(ref)
                    return
                if self.disk is None:
                    raise
            self._load_spilled(content_id)

    def load_and_hold(self, content_id: str) -> Content:
        """Load a content and hold it (it cannot be freed or evicted until released). Retries
        when the pool evicts it between the two steps (it can always be read again)."""
        for _ in range(3):
            self.load(content_id)
            try:
                return self.pool.hold(content_id)
            except NotFound:
                continue
        raise NotFound(f"content {content_id} was evicted as fast as it was loaded; retry")

    def _load_spilled(self, content_id: str) -> None:
        assert self.disk is not None
        _, size, tensors = self.disk.layout(content_id)
        res = self.reserve(size)
        try:
            self.disk.read_into(content_id, self.pool.view, res.offset)
        except BaseException:
            self.pool.abort(res.reservation_id)
            raise
        try:
            self.commit(
                res.reservation_id,
                list(tensors),
                verify_hashes=True,
                replica=True,
                content_id=content_id,
            )
        except IntegrityError as e:  # the reservation is freed already
            # A spill file gone bad is no replica: forget it, so a prefetch here pulls the
            # content from a peer and readers go to the other replicas.
            log.warning("spilled content %s is corrupt on disk, deleted: %s", content_id, e)
            self.disk.delete(content_id)
            try:
                self.store.call(
                    "RemoveReplica",
                    pb.RemoveReplicaRequest(
                        worker_id=self.worker_id, content_id=content_id, tier="disk"
                    ),
                )
            except TensorcastError:
                pass  # the next heartbeat no longer reports it
            raise NotFound(f"content {content_id} was corrupt on this worker's disk tier") from e
        self.disk.delete(content_id)
        log.info("loaded content %s back from disk", content_id)
        self._moved_tier(content_id, old_tier="disk")

    def _load_reference(self, ref: FileReference) -> None:
        """The cold path: read the tensors' byte ranges from the files into the pool, hashing
        as they arrive. The first read's hashes become the content's; a later read must
        reproduce them."""
        started = time.monotonic()
        res = self.reserve(ref.layout.size_bytes)
        try:
            hashes = self.references.read(ref, self.pool.view, res.offset)
            read_s = time.monotonic() - started
            for t, h, first in zip(ref.layout.tensors, hashes, ref.hashes or hashes):
                if h != first:
                    raise IntegrityError(
                        f"tensor {t.name!r} of {ref.content_id}: read again from its files it "
                        f"hashes to {h}, the first read to {first}; nothing was stored"
                    )
        except BaseException:
            self.pool.abort(res.reservation_id)
            raise
        committed = self.commit(
            res.reservation_id,
            [replace(t, hash_hex=h) for t, h in zip(ref.layout.tensors, hashes)],
            hashed=True,
            replica=True,
            content_id=ref.content_id,
        )
        self.references.learned(ref.content_id, committed.tensors)
        log.info(
            "read content %s from its files: %d bytes in %.3fs (%.2f GB/s), %.3fs in total",
            ref.content_id,
            ref.layout.size_bytes,
            read_s,
            ref.layout.size_bytes / max(read_s, 1e-9) / 1e9,
            time.monotonic() - started,
        )

    def adopt_references(self) -> int:
        """Serve again the files registered by reference on this host (by a previous run of
        this worker, or another worker here) whose files are unchanged; the next heartbeat
        lists them. Returns how many."""
        try:
            reply = self.store.call(
                "ListReferences", pb.ListReferencesRequest(host_id=self.host_id)
            )
        except TensorcastError as e:
            log.warning("could not list the file references of this host: %s", e)
            return 0
        adopted = 0
        for record in reply.references:
            try:
                ref = FileReference.from_json(record.spec)
            except (ValueError, KeyError, TypeError):
                log.warning("ignoring a malformed file reference for %s", record.content_id)
                continue
            if ref.content_id != record.content_id or not ref.unchanged():
                log.info("not adopting %s: its files changed or are gone", record.content_id)
                continue
            self.references.add(ref)
            adopted += 1
        if adopted:
            log.info("serving %d contents registered by reference on this host", adopted)
        return adopted

    def register_reference(self, path: str) -> Committed:
        """`tc put --by-reference`: describe the files (headers only) and record a "file"
        replica; no tensor byte is read until the first load."""
        ref = describe(path)
        capacity = self.pool.stats().capacity_bytes
        if ref.layout.size_bytes > capacity:  # every read loads it whole into the pool
            raise ResourceExhausted(
                f"{path} holds {ref.layout.size_bytes} bytes of tensors, more than worker "
                f"{self.name}'s pool ({capacity} bytes): it could never be read; put it on a "
                "worker with a larger --mem"
            )
        known = self.references.get(ref.content_id)
        ref = known or ref
        self.references.add(ref)
        try:
            self.store.call(
                "AddReplica",
                pb.AddReplicaRequest(
                    worker_id=self.worker_id,
                    content_id=ref.content_id,
                    size_bytes=ref.layout.size_bytes,
                    tensors=[tensor_to_pb(t) for t in ref.tensors],
                    tier="file",
                    reference=ref.to_json(),
                ),
            )
        except TensorcastError:
            if known is None:
                self.references.remove(ref.content_id)  # nothing half-registered stays
            raise
        return Committed(ref.content_id, ref.layout.size_bytes, ref.tensors, False)

    def _moved_tier(self, content_id: str, old_tier: str) -> None:
        """Tell the store at once: forget the old tier's row, report the new one. The move is
        done either way: a store out of reach hears of it from the next heartbeats."""
        try:
            self.store.call(
                "RemoveReplica",
                pb.RemoveReplicaRequest(
                    worker_id=self.worker_id, content_id=content_id, tier=old_tier
                ),
            )
            self.heartbeat_once()
        except Unavailable as e:
            log.warning("the store has not heard %s left the %s tier: %s", content_id, old_tier, e)

    def commit(
        self,
        reservation_id: int,
        tensors: list[TensorMeta],
        verify_hashes: bool = False,
        replica: bool = False,
        content_id: str | None = None,
        hashed: bool = False,
    ) -> Committed:
        """Turn a written reservation into content known to the Global Store.

        New content (`replica=False`) that another live worker already holds is dropped here:
        identical content is stored once. A `replica` is a deliberate extra copy (prefetch).
        """
        result = self.pool.commit(reservation_id, tensors, verify_hashes, content_id, hashed)
        content = result.content
        registered = False
        try:
            if not result.deduplicated and not replica:
                found = self.store.call(
                    "FindContent", pb.FindContentRequest(content_id=content.content_id)
                )
                if found.exists and any(r.worker_id != self.worker_id for r in found.replicas):
                    return Committed(
                        content.content_id,
                        content.size_bytes,
                        tensors_from_pb(found.tensors),
                        True,
                    )
            # Register even a local duplicate: the store may have forgotten it (deleted, not
            # yet dropped here), and AddReplica is idempotent.
            try:
                self.store.call(
                    "AddReplica",
                    pb.AddReplicaRequest(
                        worker_id=self.worker_id,
                        content_id=content.content_id,
                        size_bytes=content.size_bytes,
                        tensors=[tensor_to_pb(t) for t in content.tensors],
                    ),
                )
                registered = True
            except (Unavailable, DeadlineExceeded) as e:
                if not replica:
                    raise
                # A verified copy of content the store already knows: throwing it away would
                # cost a pull from every source. Marked registered, the heartbeats report it,
                # so the store lists this replica once it answers again.
                registered = True
                log.warning(
                    "kept replica %s unregistered (the store will hear of it with the next "
                    "heartbeat): %s",
                    content.content_id,
                    e,
                )
        finally:
            self.pool.end_registration(content.content_id, registered)
            if not registered and not result.deduplicated:
                # Held elsewhere, or the store refused it: ours alone, nothing refers to it
                # (unless another commit registered it meanwhile).
                self.pool.drop(content.content_id, unless_registered=True)
        return Committed(
            content.content_id, content.size_bytes, content.tensors, result.deduplicated
        )

    def put_batch(
        self, items: list[dict], blob: bytearray | None = None, brief: bool = False
    ) -> tuple[list[ArtifactInfo], list[bool]]:
        """Write and name artifacts for a same-host caller with ONE Global Store request
        (PutArtifacts: one transaction, all or nothing). Each item names its artifact
        (`art_id`, `owner`, `ttl_s`, `parent`) and its content, one of: bytes inline
        (`blob_offset` into `blob`, `size_bytes`, `tensors` with offsets and the caller's
        hashes), a reservation the caller wrote (`reservation_id`, `tensors`), or a content the
        cluster holds already (`content_id`). Every hash is checked against the bytes here. On
        any failure nothing is named, the contents this call wrote are freed, and the error
        names the batch member. Returns each artifact (none when `brief`: the caller needs only
        to know the batch is named) and whether it existed already."""
        committed: list[tuple[str, bool]] = []  # (content id, written by this call)
        replicas: dict[str, pb.NewReplica] = {}
        layouts: dict[str, tuple[TensorMeta, ...]] = {}
        artifacts = []
        open_reservations = {int(i["reservation_id"]) for i in items if "reservation_id" in i}
        try:
            for index, item in enumerate(items):
                try:
                    content_id = self._commit_item(item, blob, committed, replicas, layouts)
                except TensorcastError as e:
                    raise type(e)(f"{member(index, str(item.get('art_id')))}: {e}") from None
                # Committed (now registered), or the held content it named: not ours to abort.
                open_reservations.discard(int(item.get("reservation_id", -1)))
                artifacts.append(
                    pb.NewArtifact(
                        art_id=str(item["art_id"]),
                        content_id=content_id,
                        owner=str(item["owner"]),
                        ttl_s=float(item.get("ttl_s", 0.0)),
                        parent=str(item.get("parent", "")),
                    )
                )
            request = pb.PutArtifactsRequest(
                worker_id=self.worker_id,
                replicas=list(replicas.values()),
                artifacts=artifacts,
                brief=brief,
            )
            reply = self.batcher.call(pb.StoreOp(put=request)).put
        except (Unavailable, DeadlineExceeded):
            # The store may have committed the batch before its answer was lost: keep what
            # was written and report it; the next heartbeat's answer drops what the store
            # does not know (decision 7), so a committed batch never loses its bytes.
            for reservation_id in open_reservations:
                self.pool.abort(reservation_id)
            self._end_registrations(committed, set())
            raise
        except BaseException:
            for reservation_id in open_reservations:
                self.pool.abort(reservation_id)
            self._end_registrations(committed, set(c for c, _ in committed))
            raise
        self._end_registrations(committed, set(reply.redundant_content_ids))
        infos = []
        for a in reply.artifacts:
            info = artifact_from_pb(a)
            if not info.tensors and info.content_id in layouts:  # left out: we sent them
                info = replace(info, tensors=layouts[info.content_id])
            infos.append(info)
        return infos, list(reply.existed)

    def _commit_item(
        self,
        item: dict,
        blob: bytearray | None,
        committed: list[tuple[str, bool]],
        replicas: dict[str, pb.NewReplica],
        layouts: dict[str, tuple[TensorMeta, ...]],
    ) -> str:
        """Commit one batch item's bytes (unless it names held content); returns its content."""
        if "content_id" in item:
            if "reservation_id" in item:
                raise InvalidArgument("an item names held content or bytes it wrote, not both")
            return str(item["content_id"])
        tensors = [TensorMeta.from_json(t) for t in item["tensors"]]
        if "reservation_id" in item:
            reservation_id = int(item["reservation_id"])
        else:
            start, size = int(item["blob_offset"]), int(item["size_bytes"])
            if blob is None or not 0 <= start <= start + size <= len(blob):
                raise InvalidArgument("inline bytes out of the message's range")
            res = self.reserve(size)
            self.pool.view[res.offset : res.offset + size] = memoryview(blob)[start : start + size]
            reservation_id = res.reservation_id
        verify = all(t.hash_hex for t in tensors)
        result = self.pool.commit(reservation_id, tensors, verify_hashes=verify)
        content = result.content
        committed.append((content.content_id, not result.deduplicated))
        layouts[content.content_id] = content.tensors
        replicas.setdefault(
            content.content_id,
            pb.NewReplica(
                content_id=content.content_id,
                size_bytes=content.size_bytes,
                tensors=[tensor_to_pb(t) for t in content.tensors],
            ),
        )
        return content.content_id

    def _end_registrations(self, committed: list[tuple[str, bool]], unregistered: set[str]) -> None:
        """End a batch's registrations; free what this call wrote and the store did not record
        (held by another worker, or the batch failed)."""
        for content_id, _ in committed:
            self.pool.end_registration(content_id, content_id not in unregistered)
        for content_id, fresh in committed:
            if fresh and content_id in unregistered:
                self.pool.drop(content_id, unless_registered=True)

    def _report_soon(self) -> None:
        """Attach/detach: tell the store now rather than at the next heartbeat."""
        threading.Thread(target=self._heartbeat_quietly, name="report", daemon=True).start()

    def _heartbeat_quietly(self) -> None:
        try:
            self.heartbeat_once()
        except TensorcastError as e:
            log.warning("heartbeat failed: %s", e)

    def heartbeat_once(self) -> None:
        # One at a time: lease tables must be applied in the order the store produced them.
        with self._beat_lock:
            self._heartbeat()

    def _heartbeat(self) -> None:
        stats = self.pool.stats()
        sent_at = time.time()
        sent_mono = time.monotonic()
        held = dict(
            Inventory.of(
                stats.content_ids,
                stats.pinned_content_ids,
                self.disk.content_ids() if self.disk else [],
                self.references.content_ids(),
            ).held
        )
        reply = self._beat(held, stats.used_bytes, sent_mono)
        now = time.monotonic()
        if now - self.last_heartbeat_ok > 2 * self.heartbeat_interval_s:
            self.store_reached_at = now  # back after missed beats: so may the other homes be
        self.last_heartbeat_ok = now
        self._take_shard_table(reply.shards, sent_mono)
        for content_id in reply.drop_content_ids:
            if self.pool.drop(content_id, unless_committed_after=sent_at):
                log.info("dropped content %s (no artifact references it)", content_id)
            if self.disk is not None and (content_id, "disk") in held:
                self.disk.delete(content_id)
            if self.references.remove(content_id, unless_added_after=sent_at):
                log.info("forgot file reference %s (no artifact references it)", content_id)

    def _beat(self, held: dict[ReplicaKey, bool], used_bytes: int, now: float) -> pb.HeartbeatReply:
        """One Heartbeat call carrying what changed since the store's acknowledged inventory;
        the whole inventory at once when the store asks for it or forgot this worker."""
        registered = False
        while True:  # at most 3 calls: a full inventory is never refused, NotFound once
            inventory = self.inventory.report(held, now)
            shards = self.leases.held()
            request = pb.HeartbeatRequest(
                worker_id=self.worker_id,
                mem_used_bytes=used_bytes,
                active_transfers=self.active_transfers(),
                transfer_bytes_total=self.transfer_bytes_total(),
                disk_used_bytes=self.disk.used_bytes() if self.disk else 0,
                held_shards=[pb.ShardLease(shard=s, token=t) for s, t in shards.items()],
                instances=[instance_to_pb(i) for i in self.instances.infos()],
                **inventory_fields(inventory),
            )
            try:
                # Well within the TTL: a hung store member must leave time to beat through
                # another before this worker counts as dead.
                reply = self.store.call("Heartbeat", request, timeout_s=self.heartbeat_ttl_s / 2)
            except NotFound:
                if registered:
                    raise
                log.warning("global store does not know this worker; registering again")
                self.register()
                self.inventory.forget()
                registered = True
                continue
            result = beat_result(reply)
            self.inventory.answered(inventory, held, result, now)
            if not result.resync:
                return reply

    def refresh_leases(self, wanted: set[tuple[int, int]] | None = None) -> None:
        """Fetch the lease table now: a page operation named (shard, token)s newer than ours
        (`wanted`), or a home we asked said it moved (None). Callers queue; whoever finds the
        wanted tokens already known skips the fetch, and fetches are at least
        REFRESH_MIN_INTERVAL_S apart (bounded store traffic, bounded waits)."""
        with self._refresh_lock:
            if wanted is not None and not any(
                self.leases.is_newer(shard, token) for shard, token in wanted
            ):
                return
            wait = self._last_refresh + REFRESH_MIN_INTERVAL_S - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            sent = self._last_refresh = time.monotonic()
            table = self.store.call("ListShards", pb.Empty(), timeout_s=2.0)
            self._apply_shard_table(table, sent)

    def _apply_shard_table(self, table: pb.ShardTable, sent_mono: float) -> None:
        self.drop_lost_pages(self.leases.update(shard_table_from_pb(table), sent_mono))

    def drop_lost_pages(self, lost: dict[int, int | None]) -> None:
        """Drop the pages of shards another home holds (or held meanwhile): see LeaseCache."""
        for shard, max_token in sorted(lost.items()):
            dropped = self.pages.drop_shards({shard}, max_token)
            log.info("lost shard %d: dropped %d pages", shard, dropped)

    def _take_shard_table(self, table: pb.ShardTable, sent_mono: float) -> None:
        self._apply_shard_table(table, sent_mono)
        if "shard-home" not in self.roles:
            return
        for shard, token, to in self.leases.to_hand_off()[:HANDOFFS_PER_BEAT]:
            lease = hand_off(self, shard, token, to)
            if lease is not None:
                threading.Thread(
                    target=copy_and_drop,
                    args=(self, lease, token, time.monotonic() + HANDOFF_COPY_S),
                    name=f"hand-off-{shard}",
                    daemon=True,
                ).start()
        wanted = self.leases.to_acquire(
            self.heartbeat_interval_s, time.monotonic() - self.store_reached_at
        )
        if wanted:
            sent_mono = time.monotonic()
            reply = self.store.call(
                "AcquireShards", pb.AcquireShardsRequest(worker_id=self.worker_id, shards=wanted)
            )
            self.drop_lost_pages(self.leases.update(shard_table_from_pb(reply), sent_mono))
            got = sorted(set(wanted) & set(self.leases.held()))
            if got:
                log.info("now home of shards %s", got)

    def heartbeat_loop(self, interval_s: float, on_tick: Callable[[], None]) -> None:
        """Heartbeat every `interval_s`. While the store cannot be reached the worker keeps
        serving what it holds and beats at a slower pace (at most HEARTBEAT_BACKOFF times the
        interval apart), logging the outage once; the first beat that lands re-reports its
        whole inventory (a restarted store lists every replica again). Nothing ends the loop
        but `stop`: a bug in one beat is logged and the next beat tries again (the store would
        count a worker whose beats stopped as dead, and all it holds as lost)."""
        self.heartbeat_interval_s = interval_s
        delay_s = interval_s
        while not self._stop.wait(delay_s):
            try:
                on_tick()
                self.pages.expire()
                self.heartbeat_once()
            except Exception as e:
                if delay_s == interval_s:
                    if isinstance(e, TensorcastError):
                        log.warning("heartbeat failed, still serving, retrying: %s", e)
                    else:
                        log.exception("heartbeat failed (a bug), still serving, retrying")
                delay_s = min(delay_s * 1.5, interval_s * HEARTBEAT_BACKOFF)
                continue
            if delay_s != interval_s:
                log.info("heartbeats reach the global store again (%s)", self.store.current_addr)
            delay_s = interval_s

    def start_heartbeats(
        self, interval_s: float, on_tick: Callable[[], None] = lambda: None
    ) -> threading.Thread:
        thread = threading.Thread(
            target=self.heartbeat_loop, args=(interval_s, on_tick), name="heartbeat", daemon=True
        )
        thread.start()
        return thread

    def hand_over_shards(self, budget_s: float) -> int:
        """A planned stop: give each held shard with pages here to the live home hashing ranks
        first among the others, copying the pages along within `budget_s` (what is not copied
        by then is lost, as with a crash; shards without pages are freed by deregistration).
        This worker is no shard home from then on. Returns the shards handed over."""
        deadline = time.monotonic() + budget_s
        with self._beat_lock:
            table = self.leases.table
            others = [h for h in table.live_homes if h != self.worker_id] if table else []
            moves = [
                (shard, token, hrw_rank(shard, others)[0])
                for shard, token in sorted(self.leases.held().items())
                if others and self.pages.home_pages(shard, max_token=token)
            ]
            if not moves:
                return 0
            # Resign the role first, or the homes would hand the shards back while it is live.
            self.roles = tuple(r for r in self.roles if r != "shard-home")
            try:
                self.register()
            except TensorcastError as e:
                log.warning("no hand-over of shards: %s", e)
                return 0
            leases = []
            for shard, token, to in moves:
                if time.monotonic() >= deadline:
                    break
                lease = hand_off(self, shard, token, to)
                if lease is not None:
                    leases.append((lease, token))
        for lease, token in leases:
            copy_and_drop(self, lease, token, deadline)
        return len(leases)

    def stop(self) -> None:
        self._stop.set()
        try:
            self.store.call(
                "DeregisterWorker", pb.DeregisterWorkerRequest(worker_id=self.worker_id), 2.0
            )
        except TensorcastError as e:
            log.warning("deregistration failed: %s", e)
        self.store.close()
