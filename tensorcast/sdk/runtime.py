"""`Runtime`: a caller's handle on a cluster. Talks to the Global Store for metadata and to
workers for data; on the same host through shared memory, elsewhere through gRPC streams."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensorcast import config
from tensorcast.errors import InvalidArgument, NotFound, Unavailable
from tensorcast.placement import order_sources, order_targets
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.rpc.client import Stub, make_channel
from tensorcast.rpc.convert import (
    artifact_from_pb,
    instance_from_pb,
    plan_from_pb,
    shard_table_from_pb,
    tensor_to_pb,
    worker_from_pb,
)
from tensorcast.rpc.frames import StoreClient
from tensorcast.sdk.cluster_file import ClusterRecord, read_token
from tensorcast.sdk.local_client import LocalConnection
from tensorcast.store.base import MAX_PAGE
from tensorcast.types import (
    OWNER_LEASE,
    OWNER_SYSTEM,
    ArtifactInfo,
    InstanceInfo,
    PlanRecord,
    ShardTable,
    TensorMeta,
    WorkerInfo,
)

if TYPE_CHECKING:
    import torch

    from tensorcast.sdk.artifact import Artifact
    from tensorcast.sdk.pages import Pages
    from tensorcast.sdk.signals import Signals

Progress = Callable[[int], None]  # called with bytes just moved
# Hot paths (puts, reads) reuse the worker list this long; a failure lists the workers again.
WORKERS_CACHE_S = 2.0


def connect(
    addr: str | None = None,
    token: str | None = None,
    *,
    state_dir: str | os.PathLike[str] | None = None,
    timeout_s: float | None = None,
    tls: config.TLSFiles | None = None,
) -> Runtime:
    """Connect to a cluster's Global Store.

    With no `addr`, uses `TC_ADDR`, else the local cluster recorded in the state dir
    (`--state-dir`, `TC_STATE_DIR`, default ~/.local/state/tensorcast). The token comes from
    `token`, `TC_TOKEN`, or the state dir; TLS files from `tls`, `TC_TLS_CA/CERT/KEY`, or the
    state dir's tls/ folder (plaintext when none). Raises `Unavailable` when no cluster can be
    found.
    """
    directory = Path(state_dir) if state_dir else config.default_state_dir()
    addr = addr or config.env_addr()
    frame_ports: dict[str, int] = {}
    if addr is None:
        record = ClusterRecord.load(directory)
        if record is None:
            raise Unavailable(
                f"no local cluster in {directory}: run `tc up`, or pass --addr / set TC_ADDR"
            )
        addr = record.store_addr
        frame_ports = record.store_frame_ports()
    config.parse_store_addrs(addr)
    token = token or config.env_token() or read_token(directory)
    if not token:
        raise InvalidArgument("no cluster token: pass --token, set TC_TOKEN, or use the state dir")
    tls = tls or config.tls_files(directory)
    runtime = Runtime(addr, token, timeout_s or config.timing().rpc_timeout_s, tls, frame_ports)
    runtime.store_status()  # fail fast on a wrong address or token
    return runtime


class Runtime:
    def __init__(
        self,
        store_addr: str,
        token: str,
        timeout_s: float,
        tls: config.TLSFiles | None = None,
        frame_ports: dict[str, int] | None = None,
    ) -> None:
        self.store_addr = store_addr
        self.token = config.send_token(token)  # what this caller presents everywhere
        self.timeout_s = timeout_s
        self.tls = tls
        self.host_id = config.host_id()
        self.store = StoreClient(store_addr, token, timeout_s, tls, frame_ports)
        self._worker_stubs: dict[str, tuple[Any, Stub, str]] = {}
        self._local: dict[str, LocalConnection] = {}
        self._lock = threading.Lock()
        self._signals: Signals | None = None
        self._pages: Pages | None = None
        self._workers_cache: tuple[float, list[WorkerInfo]] | None = None

    # -- cluster -------------------------------------------------------------------------------

    def store_status(self) -> pb.StoreStatus:
        return self.store.call("Status", pb.Empty())

    def workers(self) -> list[WorkerInfo]:
        workers = [worker_from_pb(w) for w in self.store.call("ListWorkers", pb.Empty()).workers]
        with self._lock:
            self._workers_cache = (time.monotonic(), workers)
        return workers

    def cached_workers(self, require: Collection[str] = ()) -> list[WorkerInfo]:
        """The worker list, reused for WORKERS_CACHE_S (puts and reads need it on every call);
        listed again when it is older, or lacks a worker id in `require`."""
        with self._lock:
            cached = self._workers_cache
        if cached is not None and time.monotonic() - cached[0] < WORKERS_CACHE_S:
            known = {w.worker_id for w in cached[1]}
            if all(r in known for r in require):
                return cached[1]
        return self.workers()

    def forget_workers(self) -> None:
        """Drop the cached worker list (a worker we knew was not there)."""
        with self._lock:
            self._workers_cache = None

    def worker_stub(self, worker: WorkerInfo) -> Stub:
        return self.worker_stub_at(worker.worker_id, worker.addr, worker.name)

    def worker_stub_at(self, worker_id: str, addr: str, name: str = "") -> Stub:
        with self._lock:
            cached = self._worker_stubs.get(worker_id)
            if cached is None or cached[2] != addr:
                from tensorcast.proto import tensorcast_pb2_grpc as pb_grpc  # imports grpc

                channel = make_channel(addr, self.tls)
                stub = Stub(
                    pb_grpc.WorkerServiceStub(channel),
                    f"worker {name or worker_id} ({addr})",
                    self.token,
                    self.timeout_s,
                )
                cached = self._worker_stubs[worker_id] = (channel, stub, addr)
            return cached[1]

    def local_connection(self, worker: WorkerInfo) -> LocalConnection:
        return self.local_connection_to(worker.worker_id, worker.local_socket)

    def local_connection_to(self, worker_id: str, local_socket: str) -> LocalConnection:
        with self._lock:
            conn = self._local.get(worker_id)
            if conn is not None and conn.broken:
                del self._local[worker_id]
                conn.close()  # once its mappings are gone
                conn = None
        if conn is None:
            self._drop_gone_connections()
            conn = LocalConnection(local_socket, self.token, self.timeout_s)
            with self._lock:
                conn = self._local.setdefault(worker_id, conn)
        return conn

    def _drop_gone_connections(self) -> None:
        """Close the connections to same-host workers that died or restarted (a restarted
        worker has a new id: nothing would ask for the old one again). Each maps its worker's
        whole pool: kept, it would keep that memory allocated for as long as this caller runs."""
        with self._lock:
            gone = [w for w, conn in self._local.items() if conn.gone]
            for worker_id in gone:
                self._local.pop(worker_id).close()  # unmapped once no tensor uses it
        if gone and self._pages is not None:
            self._pages.drop_gone_connections()  # they map the same pools

    def has_live_local_connection(self, worker_id: str) -> bool:
        with self._lock:
            conn = self._local.get(worker_id)
            return conn is not None and not conn.gone

    # -- signals, plans, pages -------------------------------------------------------------------

    def signals(self) -> Signals:
        """Snapshots of workers and instances for caller-side policies (routers, autoscalers)."""
        from tensorcast.sdk.signals import Signals

        with self._lock:
            if self._signals is None:
                self._signals = Signals(self)
            return self._signals

    def pages(self) -> Pages:
        """The KV page API (`put_pages`, `get_pages`, `exists_pages`) with a cached lease table."""
        from tensorcast.sdk.pages import Pages

        with self._lock:
            if self._pages is None:
                self._pages = Pages(self)
            return self._pages

    def gateways(self, name_or_id: str | None = None) -> list[WorkerInfo]:
        """Gateway workers to submit plans to, in the order to try them: the named one alone,
        else every live gateway, same host first."""
        if name_or_id is not None:
            worker = self.resolve_worker(name_or_id)
            if "gateway" not in worker.roles:
                raise InvalidArgument(f"worker {worker.name} does not have the gateway role")
            return [worker]
        gateways = [w for w in self.workers() if w.alive and "gateway" in w.roles]
        if not gateways:
            raise Unavailable("no live gateway worker: start one with --roles ...,gateway")
        return sorted(gateways, key=lambda w: (w.host_id != self.host_id, w.name))

    def instances(self) -> list[InstanceInfo]:
        reply = self.store.call("ListInstances", pb.Empty())
        return [instance_from_pb(i) for i in reply.instances]

    def resolve_instance(self, instance_id: str) -> InstanceInfo:
        for inst in self.instances():
            if inst.instance_id == instance_id:
                if not inst.alive:
                    raise Unavailable(f"instance {instance_id!r} is not alive")
                return inst
        raise NotFound(f"no instance {instance_id!r} (see `tc instances`)")

    def plans(self, limit: int = 50) -> list[PlanRecord]:
        reply = self.store.call("ListPlans", pb.ListPlansRequest(limit=limit))
        return [plan_from_pb(p) for p in reply.plans]

    def plan(self, idempotency_key: str) -> PlanRecord:
        """The plan recorded under `idempotency_key` (running, ok or failed); NotFound if none."""
        request = pb.PlanRecord(idempotency_key=idempotency_key)
        return plan_from_pb(self.store.call("GetPlan", request))

    def shards(self) -> ShardTable:
        return shard_table_from_pb(self.store.call("ListShards", pb.Empty()))

    def is_local(self, worker: WorkerInfo) -> bool:
        return worker.host_id == self.host_id

    def close(self) -> None:
        if self._pages is not None:
            self._pages.close()
        with self._lock:
            for conn in self._local.values():
                conn.close()
            for channel, _, _ in self._worker_stubs.values():
                channel.close()
            self._local.clear()
            self._worker_stubs.clear()
        self.store.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- artifacts -----------------------------------------------------------------------------

    def put(
        self,
        tensors: Mapping[str, torch.Tensor],
        art_id: str,
        *,
        worker: str | None = None,
        progress: Progress | None = None,
    ) -> Artifact:
        """Copy tensors into the pool as a system-owned artifact (lives until deleted).

        Idempotent for the same content; `AlreadyExists` if `art_id` names other content.
        `worker` (name or id) places the first replica; by default a same-host worker with the
        most free memory.
        """
        return self._store_tensors(tensors, art_id, OWNER_SYSTEM, 0.0, worker, progress)

    def register(
        self,
        tensors: Mapping[str, torch.Tensor],
        art_id: str,
        *,
        ttl_s: float,
        worker: str | None = None,
        progress: Progress | None = None,
    ) -> Artifact:
        """A caller-leased artifact: gone `ttl_s` after creation unless renewed (`renew`)."""
        if not ttl_s > 0:
            raise InvalidArgument("ttl_s must be > 0")
        return self._store_tensors(tensors, art_id, OWNER_LEASE, ttl_s, worker, progress)

    def put_many(
        self,
        items: Mapping[str, Mapping[str, torch.Tensor]],
        *,
        worker: str | None = None,
        progress: Progress | None = None,
    ) -> dict[str, Artifact]:
        """Put several system-owned artifacts ({art_id: {name: tensor}}) at once: all of them
        or none (one Global Store transaction; a bad member changes nothing, and the error
        names it). Same-host contents move in one or two round trips to the worker."""
        return self._store_many(items, OWNER_SYSTEM, 0.0, worker, progress)

    def register_many(
        self,
        items: Mapping[str, Mapping[str, torch.Tensor]],
        *,
        ttl_s: float,
        worker: str | None = None,
        progress: Progress | None = None,
    ) -> dict[str, Artifact]:
        """Caller-leased `put_many`: every artifact gone `ttl_s` after creation unless renewed."""
        if not ttl_s > 0:
            raise InvalidArgument("ttl_s must be > 0")
        return self._store_many(items, OWNER_LEASE, ttl_s, worker, progress)

    def _store_tensors(
        self,
        tensors: Mapping[str, torch.Tensor],
        art_id: str,
        owner: str,
        ttl_s: float,
        worker: str | None,
        progress: Progress | None,
    ) -> Artifact:
        return self._store_many({art_id: tensors}, owner, ttl_s, worker, progress)[art_id]

    def _store_many(
        self,
        items: Mapping[str, Mapping[str, torch.Tensor]],
        owner: str,
        ttl_s: float,
        worker: str | None,
        progress: Progress | None,
    ) -> dict[str, Artifact]:
        from tensorcast.sdk import batch
        from tensorcast.sdk.artifact import Artifact

        if not isinstance(items, Mapping):
            raise InvalidArgument("put_many takes a mapping of art_id -> {name: tensor}")
        # Hash first: content the cluster already holds moves no bytes. The worker re-hashes
        # what it receives and rejects a mismatch, so the copy is checked end to end.
        specs = batch.tensor_specs(list(items.items()), owner, ttl_s)
        infos = batch.put_batch(self, specs, worker, progress)
        return {info.art_id: Artifact(self, info, fresh=True) for info in infos}

    def put_files(
        self,
        art_id: str,
        path: str | os.PathLike[str],
        *,
        ttl_s: float | None = None,
        worker: str | None = None,
        progress: Progress | None = None,
        by_reference: bool = False,
    ) -> Artifact:
        """Put a safetensors file or a model directory (shards, index, config and tokenizer files)
        as one artifact.

        Everything is validated before any data moves; bytes are read by parallel positional
        reads straight into pool memory. An unchanged set of files put before (same paths, sizes,
        mtimes) whose content the cluster still holds moves no data.

        `by_reference` registers the files with this host's worker without reading them: the
        first `tensor_dict()` reads the tensors' byte ranges into its pool (cold), later ones
        map that copy (warm). The files must stay unchanged; a changed file is refused on read.
        """
        from tensorcast import model_dir
        from tensorcast.sdk import batch, put_cache, writes
        from tensorcast.sdk.artifact import Artifact

        if ttl_s is not None and not ttl_s > 0:  # 0 made a permanent artifact
            raise InvalidArgument("ttl_s must be > 0 (or None: lives until deleted)")
        owner = OWNER_LEASE if ttl_s else OWNER_SYSTEM
        if by_reference:
            return self._put_reference(art_id, path, owner, ttl_s or 0.0, worker)
        files = model_dir.scan(Path(path).resolve())
        key = put_cache.fingerprint(files.facts())
        known = put_cache.lookup(key) if worker is None else None
        if known is not None and self.held_contents([known]):
            try:  # the cluster holds these files' content: name it, read nothing
                return self._name(art_id, known, owner, ttl_s or 0.0, "")
            except NotFound:
                pass  # freed since: read the files after all
        metas, size, filler = writes.plan_files(files)  # reads the files when filled
        spec = batch.Spec(
            art_id,
            owner,
            ttl_s or 0.0,
            metas,
            size,
            filler,
            on_written=lambda content_id: put_cache.record(key, content_id),
        )
        (info,) = batch.put_batch(self, [spec], worker, progress)
        return Artifact(self, info, fresh=True)

    def _put_reference(
        self,
        art_id: str,
        path: str | os.PathLike[str],
        owner: str,
        ttl_s: float,
        worker: str | None,
    ) -> Artifact:
        local = [w for w in self.write_targets(worker) if self.is_local(w)]
        if not local:
            raise InvalidArgument(
                "--by-reference needs a live worker on this host (it reads the files in place)"
                + (f"; {worker!r} is on another host" if worker else "")
            )
        reply = self.local_connection(local[0]).request(
            {"op": "put_reference", "path": os.path.abspath(path)}
        )
        return self._name(art_id, reply["content_id"], owner, ttl_s, "")

    def held_contents(self, content_ids: list[str]) -> set[str]:
        """Those of `content_ids` a live worker holds (one Global Store request)."""
        reply = self.store.call(
            "HeldContents", pb.HeldContentsRequest(content_ids=list(content_ids))
        )
        return set(reply.content_ids)

    def _name(
        self, art_id: str, content_id: str, owner: str, ttl_s: float, parent: str
    ) -> Artifact:
        from tensorcast.sdk.artifact import Artifact

        reply = self.store.call(
            "CreateArtifact",
            pb.CreateArtifactRequest(
                art_id=art_id, content_id=content_id, owner=owner, ttl_s=ttl_s, parent=parent
            ),
        )
        return Artifact(self, artifact_from_pb(reply.artifact))

    def artifact(self, art_id: str) -> Artifact:
        from tensorcast.sdk.artifact import Artifact

        return Artifact(self, self.info(art_id), fresh=True)

    def info(self, art_id: str) -> ArtifactInfo:
        gateway = self._gateway()
        if gateway is not None:
            try:
                reply = gateway.request({"op": "info", "art_id": art_id})
                return ArtifactInfo.from_wire(reply["artifact"])
            except Unavailable:
                pass  # the worker, or its way to the store, is down: ask the store ourselves
        return artifact_from_pb(self.store.call("GetArtifact", pb.ArtifactRequest(art_id=art_id)))

    def _gateway(self) -> LocalConnection | None:
        """A same-host worker this caller already talks to: its lookups and deletes go through
        it (one local round trip, then the worker's coalesced store request), so that many
        callers on a host share store requests. None: ask the store directly (also when another
        thread of this caller is using the connection: threads do not queue behind each
        other)."""
        with self._lock:
            for worker_id, conn in list(self._local.items()):
                if conn.broken:
                    del self._local[worker_id]  # gone: a later write connects again
                    conn.close()
                elif not conn.busy:
                    return conn
        return None

    def list_artifacts(self, prefix: str = "") -> list[ArtifactInfo]:
        """Every live artifact whose id starts with `prefix`, by id, with its tensors (fetched
        a page at a time; `list_artifacts_page` for summaries and paging)."""
        infos, after = self.list_artifacts_page(prefix, summary=False)
        while after:
            page, after = self.list_artifacts_page(prefix, after=after, summary=False)
            infos += page
        return infos

    def list_artifacts_page(
        self,
        prefix: str = "",
        *,
        after: str = "",
        limit: int = 0,
        summary: bool = True,
        delimiter: str = "",
    ) -> tuple[list[ArtifactInfo], str]:
        """One page of artifacts whose id starts with `prefix`, by id, after `after`: at most
        `limit` (0: the store's page, 1000). Returns the page and the `after` of the next one
        ("" when this is the last). With `summary` the tensors are left out (`num_tensors`
        says how many): what listings of thousands of artifacts need. With a `delimiter`, only
        ids whose part after `prefix` does not contain it (one level of a hierarchy)."""
        if limit < 0:
            raise InvalidArgument("limit must be >= 0")
        reply = self.store.call(
            "ListArtifacts",
            pb.ListArtifactsRequest(
                prefix=prefix,
                after=after,
                limit=limit or MAX_PAGE,
                summary=summary,
                delimiter=delimiter,
            ),
        )
        return [artifact_from_pb(a) for a in reply.artifacts], reply.next_after

    def delete(self, art_id: str) -> None:
        """Forget `art_id`; its memory is freed once no artifact shares the content and no caller
        still maps it (tensors already materialized stay valid)."""
        self.delete_many([art_id])

    def delete_many(self, art_ids: list[str], *, missing_ok: bool = False) -> int:
        """Delete several artifacts with one Global Store request, in order; returns how many
        existed. Without `missing_ok`, one that does not exist is NotFound (naming it) and
        nothing is deleted."""
        if not art_ids:
            return 0
        gateway = self._gateway()
        if gateway is not None:
            try:
                message = {"op": "delete", "art_ids": list(art_ids), "missing_ok": missing_ok}
                return int(gateway.request(message)["deleted"])
            except Unavailable:
                pass  # the worker, or its way to the store, is down: ask the store ourselves
        if len(art_ids) == 1 and not missing_ok:
            self.store.call("DeleteArtifact", pb.ArtifactRequest(art_id=art_ids[0]))
            return 1
        reply = self.store.call(
            "DeleteArtifacts",
            pb.DeleteArtifactsRequest(art_ids=list(art_ids), missing_ok=missing_ok),
            timeout_s=max(self.timeout_s, 0.005 * len(art_ids)),
        )
        return reply.deleted

    def delete_lost(self, prefix: str = "", *, dry_run: bool = False) -> list[str]:
        """Delete the artifacts (ids starting with `prefix`) that no live worker holds a copy
        of: their bytes are gone (every worker that held them died or stopped without a disk
        tier). Returns their ids; `dry_run` only lists them. A worker that is restarting and
        has not reported yet makes its artifacts look lost: run this once the cluster is up.
        A store just started (or back from an outage of its backend) waits a heartbeat TTL
        for its workers to report: this waits for that first (every copy looks lost until
        then)."""
        give_up_at = time.monotonic() + 2 * self.store_status().heartbeat_ttl_s
        while (settling_s := self.store_status().settling_s) > 0:
            if time.monotonic() + settling_s > give_up_at:
                raise Unavailable(
                    f"the Global Store is still waiting {settling_s:.1f}s for its workers to "
                    "report (it or its backend was down): retry then"
                )
            time.sleep(min(settling_s, 0.5))  # bounded: settling_s is at most one TTL
        lost: list[str] = []
        page, after = self.list_artifacts_page(prefix)
        while True:
            lost += [a.art_id for a in page if not a.replicas]
            if not after:
                break
            page, after = self.list_artifacts_page(prefix, after=after)
        if not dry_run:
            self.delete_many(lost, missing_ok=True)  # deleted meanwhile: fine
        return lost

    def renew(self, art_id: str, ttl_s: float) -> ArtifactInfo:
        return artifact_from_pb(
            self.store.call("RenewLease", pb.RenewLeaseRequest(art_id=art_id, ttl_s=ttl_s))
        )

    # -- placement -----------------------------------------------------------------------------

    def write_targets(self, worker: str | None = None) -> list[WorkerInfo]:
        """Live workers to write to: `worker` if named, else same host first, then most free
        memory."""
        if worker is not None:
            return [self.resolve_worker(worker)]
        targets = order_targets(self.workers(), self.host_id)
        if not targets:
            raise Unavailable("no live worker in the cluster: start one (tc worker start / tc up)")
        return targets

    def cached_write_targets(self, worker: str | None = None) -> list[WorkerInfo]:
        """`write_targets` from the cached worker list (listed again when it cannot answer)."""
        workers = self.cached_workers()
        if worker is not None:
            named = [w for w in workers if worker in (w.name, w.worker_id) and w.alive]
            return named or [self.resolve_worker(worker)]
        targets = order_targets(workers, self.host_id)
        return targets or self.write_targets()

    def read_sources(
        self, info: ArtifactInfo, workers: list[WorkerInfo] | None = None
    ) -> list[WorkerInfo]:
        """Live workers holding the artifact: same host first, then least loaded."""
        workers = self.workers() if workers is None else workers
        sources = order_sources(info.replicas, workers, self.host_id)
        if not sources:
            raise Unavailable(
                f"artifact {info.art_id!r} has no live replica (its workers are down)"
            )
        return sources

    def prefetch_many(
        self,
        artifacts: list[Artifact | str],
        worker: str | WorkerInfo,
        *,
        timeout_s: float = 60.0,
        concurrency: int = 4,
    ) -> list[pb.PrefetchReply]:
        """Prefetch several artifacts to one worker, `concurrency` at a time; in order."""
        from concurrent.futures import ThreadPoolExecutor

        target = worker if isinstance(worker, WorkerInfo) else self.resolve_worker(worker)
        arts = [a if not isinstance(a, str) else self.artifact(a) for a in artifacts]
        with ThreadPoolExecutor(max_workers=max(1, min(concurrency, 16))) as pool:
            return list(pool.map(lambda a: a.prefetch(target, timeout_s=timeout_s), arts))

    def resolve_worker(self, name_or_id: str) -> WorkerInfo:
        """A live worker by name (worker-1) or id. A name restarted stays listed dead (under
        its old id) for a while beside the live one: the live one is meant."""
        matches = [w for w in self.workers() if name_or_id in (w.name, w.worker_id)]
        for w in matches:
            if w.alive:
                return w
        if matches:
            raise Unavailable(f"worker {name_or_id!r} is dead (missed heartbeats)")
        raise NotFound(f"no worker {name_or_id!r} (see `tc status`)")

    def stream_write(
        self,
        worker: WorkerInfo,
        metas: list[TensorMeta],
        size_bytes: int,
        chunks: Iterator[tuple[int, bytes]],
    ) -> pb.CommitReply:
        from tensorcast.transport import native

        def messages():
            yield pb.WriteMessage(tensors=[tensor_to_pb(t) for t in metas], size_bytes=size_bytes)
            for offset, data in chunks:
                yield pb.WriteMessage(
                    chunk=pb.Chunk(offset_bytes=offset, data=data, hash=native.hash_buffer(data))
                )

        stub = self.worker_stub(worker)
        return stub.call("WriteChunks", messages())
