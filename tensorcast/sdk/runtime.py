"""`Runtime`: a caller's handle on a cluster. Talks to the Global Store for metadata and to
workers for data; on the same host through shared memory, elsewhere through gRPC streams."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensorcast import config
from tensorcast.errors import InvalidArgument, NotFound, Unavailable
from tensorcast.placement import order_sources, order_targets
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.proto import tensorcast_pb2_grpc as pb_grpc
from tensorcast.rpc.client import FailoverStub, Stub, make_channel
from tensorcast.rpc.convert import (
    artifact_from_pb,
    instance_from_pb,
    plan_from_pb,
    shard_table_from_pb,
    tensor_to_pb,
    worker_from_pb,
)
from tensorcast.sdk.cluster_file import ClusterRecord, read_token
from tensorcast.sdk.local_client import LocalConnection
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
# Writes of one put whose content another caller's delete freed before it was named.
NAME_ATTEMPTS = 4


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
    if addr is None:
        record = ClusterRecord.load(directory)
        if record is None:
            raise Unavailable(
                f"no local cluster in {directory}: run `tc up`, or pass --addr / set TC_ADDR"
            )
        addr = record.store_addr
    config.parse_store_addrs(addr)
    token = token or config.env_token() or read_token(directory)
    if not token:
        raise InvalidArgument("no cluster token: pass --token, set TC_TOKEN, or use the state dir")
    tls = tls or config.tls_files(directory)
    runtime = Runtime(addr, token, timeout_s or config.timing().rpc_timeout_s, tls)
    runtime.store_status()  # fail fast on a wrong address or token
    return runtime


class Runtime:
    def __init__(
        self,
        store_addr: str,
        token: str,
        timeout_s: float,
        tls: config.TLSFiles | None = None,
    ) -> None:
        self.store_addr = store_addr
        self.token = config.send_token(token)  # what this caller presents everywhere
        self.timeout_s = timeout_s
        self.tls = tls
        self.host_id = config.host_id()
        self.store = FailoverStub(
            store_addr, pb_grpc.GlobalStoreStub, "global store", token, timeout_s, tls
        )
        self._worker_stubs: dict[str, tuple[Any, Stub, str]] = {}
        self._local: dict[str, LocalConnection] = {}
        self._lock = threading.Lock()
        self._signals: Signals | None = None
        self._pages: Pages | None = None

    # -- cluster -------------------------------------------------------------------------------

    def store_status(self) -> pb.StoreStatus:
        return self.store.call("Status", pb.Empty())

    def workers(self) -> list[WorkerInfo]:
        return [worker_from_pb(w) for w in self.store.call("ListWorkers", pb.Empty()).workers]

    def worker_stub(self, worker: WorkerInfo) -> Stub:
        return self.worker_stub_at(worker.worker_id, worker.addr, worker.name)

    def worker_stub_at(self, worker_id: str, addr: str, name: str = "") -> Stub:
        with self._lock:
            cached = self._worker_stubs.get(worker_id)
            if cached is None or cached[2] != addr:
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
        if conn is None:
            conn = LocalConnection(local_socket, self.token, self.timeout_s)
            with self._lock:
                conn = self._local.setdefault(worker_id, conn)
        return conn

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

    def gateway(self, name_or_id: str | None = None) -> WorkerInfo:
        """A live gateway worker to submit plans to: the named one, else same host first."""
        if name_or_id is not None:
            worker = self.resolve_worker(name_or_id)
            if "gateway" not in worker.roles:
                raise InvalidArgument(f"worker {worker.name} does not have the gateway role")
            return worker
        gateways = [w for w in self.workers() if w.alive and "gateway" in w.roles]
        if not gateways:
            raise Unavailable("no live gateway worker: start one with --roles ...,gateway")
        return sorted(gateways, key=lambda w: (w.host_id != self.host_id, w.name))[0]

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

    def _store_tensors(
        self,
        tensors: Mapping[str, torch.Tensor],
        art_id: str,
        owner: str,
        ttl_s: float,
        worker: str | None,
        progress: Progress | None,
    ) -> Artifact:
        from tensorcast import tensors as tmod
        from tensorcast.identity import content_id
        from tensorcast.sdk import writes
        from tensorcast.transport import native
        from tensorcast.types import pack_layout

        items = tmod.check_tensors(tensors)
        metas, size = pack_layout([(n, tmod.dtype_name(t.dtype), tuple(t.shape)) for n, t in items])
        sources = [tmod.tensor_bytes(t) for _, t in items]
        # Hash first: content the cluster already holds moves no bytes. The worker re-hashes what
        # it receives and rejects a mismatch, so the copy is checked end to end.
        hashes = native.hash_buffers(sources)
        metas = [replace(m, hash_hex=h) for m, h in zip(metas, hashes)]
        filler = writes.buffer_filler(metas, sources)
        return self._write_and_name(
            art_id,
            owner,
            ttl_s,
            lambda: writes.write_content(self, metas, size, filler, progress, worker).content_id,
            known=content_id(metas),
        )

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
        from tensorcast.sdk import put_cache, writes

        owner = OWNER_LEASE if ttl_s else OWNER_SYSTEM
        if by_reference:
            return self._put_reference(art_id, path, owner, ttl_s or 0.0, worker)
        files = model_dir.scan(path)
        key = put_cache.fingerprint(files.fingerprint_paths())

        def write() -> str:  # reads the files: only when the cluster lacks the content
            metas, size, filler = writes.plan_files(files)
            committed = writes.write_content(self, metas, size, filler, progress, worker)
            put_cache.record(key, committed.content_id)
            return committed.content_id

        known = put_cache.lookup(key) if worker is None else None
        return self._write_and_name(art_id, owner, ttl_s or 0.0, write, known)

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

    def _write_and_name(
        self, art_id: str, owner: str, ttl_s: float, write: Callable[[], str], known: str | None
    ) -> Artifact:
        """Name content, writing it first (`write` returns its id) unless the cluster already
        holds `known`. The content can vanish between that check (or the write) and the naming,
        when another caller deletes the last artifact naming it: then write it again, a bounded
        number of times, rather than fail with an error the caller cannot act on."""
        for attempt in range(NAME_ATTEMPTS):
            if attempt or known is None or not self._held(known):
                known = write()
            try:
                return self._name(art_id, known, owner, ttl_s, "")
            except NotFound:
                if attempt == NAME_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    def _held(self, content_id: str) -> bool:
        found = self.store.call("FindContent", pb.FindContentRequest(content_id=content_id))
        return found.exists and bool(found.replicas)

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

        return Artifact(self, self.info(art_id))

    def info(self, art_id: str) -> ArtifactInfo:
        return artifact_from_pb(self.store.call("GetArtifact", pb.ArtifactRequest(art_id=art_id)))

    def list_artifacts(self, prefix: str = "") -> list[ArtifactInfo]:
        reply = self.store.call("ListArtifacts", pb.ListArtifactsRequest(prefix=prefix))
        return [artifact_from_pb(a) for a in reply.artifacts]

    def delete(self, art_id: str) -> None:
        """Forget `art_id`; its memory is freed once no artifact shares the content and no caller
        still maps it (tensors already materialized stay valid)."""
        self.store.call("DeleteArtifact", pb.ArtifactRequest(art_id=art_id))

    def delete_lost(self, prefix: str = "", *, dry_run: bool = False) -> list[str]:
        """Delete the artifacts (ids starting with `prefix`) that no live worker holds a copy
        of: their bytes are gone (every worker that held them died or stopped without a disk
        tier). Returns their ids; `dry_run` only lists them. A worker that is restarting and
        has not reported yet makes its artifacts look lost: run this once the cluster is up."""
        lost = [a.art_id for a in self.list_artifacts(prefix) if not a.replicas]
        if not dry_run:
            for art_id in lost:
                try:
                    self.delete(art_id)
                except NotFound:
                    pass  # deleted meanwhile
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
        """A live worker by name (worker-1) or id."""
        for w in self.workers():
            if name_or_id in (w.name, w.worker_id):
                if not w.alive:
                    raise Unavailable(f"worker {name_or_id!r} is dead (missed heartbeats)")
                return w
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
