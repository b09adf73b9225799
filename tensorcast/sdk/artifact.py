"""`Artifact`: a handle on an immutable, named set of tensors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tensorcast.errors import (
    IntegrityError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    TensorcastError,
    Unavailable,
)
from tensorcast.model_dir import FILE_PREFIX
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.types import OWNER_LEASE, ArtifactInfo, TensorMeta, WorkerInfo

if TYPE_CHECKING:
    import torch

    from tensorcast.sdk.runtime import Runtime

SliceLike = slice | int | Sequence[slice]
# Closing a transfer ticket after a read is a courtesy (it expires by itself): wait this long
# at most, so a source that died after serving the bytes does not hold up the result.
CLOSE_TRANSFER_TIMEOUT_S = 1.0
MAX_PREFETCH_TIMEOUT_S = 86_400.0  # a day: the worker counts it in uint32 milliseconds
# prefetch_chain's calls in flight at once (one thread each).
MAX_CHAIN_THREADS = 64


class Artifact:
    def __init__(self, runtime: Runtime, info: ArtifactInfo, fresh: bool = False) -> None:
        self.runtime = runtime
        self.info = info
        self._fresh = fresh  # `info` was just read from the store: the first read trusts it

    def __repr__(self) -> str:
        return (
            f"Artifact({self.art_id!r}, {len(self.info.tensors)} tensors, "
            f"{self.size_bytes} bytes, owner={self.info.owner})"
        )

    @property
    def art_id(self) -> str:
        return self.info.art_id

    @property
    def content_id(self) -> str:
        return self.info.content_id

    @property
    def size_bytes(self) -> int:
        return self.info.size_bytes

    def tensor_meta(self) -> dict[str, TensorMeta]:
        """Name -> dtype, shape, size and content hash; no data moves."""
        return {t.name: t for t in self.info.tensors}

    def refresh(self) -> Artifact:
        self.info = self.runtime.info(self.art_id)
        return self

    def files(self, *, timeout_s: float = 60.0) -> dict[str, bytes]:
        """The small files put alongside the weights of a model directory (config.json, ...)."""
        tensors = self._all_tensors("cpu", timeout_s)
        return {
            name[len(FILE_PREFIX) :]: t.numpy().tobytes()
            for name, t in tensors.items()
            if name.startswith(FILE_PREFIX)
        }

    def tensor_dict(
        self, device: str = "cpu", *, timeout_s: float = 60.0, shared: bool = True
    ) -> dict[str, torch.Tensor]:
        """Materialize the tensors.

        On a host with a worker: zero-copy, tensors over a private mapping of the worker's shared
        memory (writes stay in the caller's copy, never reach the pool), valid for as long as the
        caller keeps them, even if the artifact is deleted meanwhile. A same-host worker without
        a replica first pulls one from a peer (and keeps it for the next caller). On a host with
        no worker the bytes are pulled straight into this process's memory, checksummed per
        chunk and verified against the tensor hashes.

        `device="cuda"` / `"cuda:N"`: on that GPU. From a same-host worker's GPU tier
        (`--gpu-mem`) on the same GPU the tensors are the tier's device memory, mapped by CUDA
        IPC with no copy (`shared=True`; the content is copied into the tier first if needed):
        every process doing so shares them, so treat them as read-only (a write reaches every
        reader). `shared=False` gives a private copy (device to device from the tier when it
        holds the content, else from the pool). Without a tier, the pool's bytes are copied to
        the GPU in chunks on a stream of their own (page-locked or through pinned staging).
        Other devices copy the CPU tensors there. Unavailable when this process has no CUDA.
        A model directory's other files (config.json, ...) are not tensors: see `files()`.
        """
        tensors = self._all_tensors(device, timeout_s, shared)
        return {k: v for k, v in tensors.items() if not k.startswith(FILE_PREFIX)}

    def _all_tensors(
        self, device: str, timeout_s: float, shared: bool = True
    ) -> dict[str, torch.Tensor]:
        if device != "cpu":
            from tensorcast.sdk import device as on_device

            if on_device.is_cuda(device):
                return on_device.materialize(self, device, timeout_s, shared)
        cached = self._fresh
        info = self.info if cached else self.refresh().info
        self._fresh = False
        # One listing serves both decisions below (cached briefly: reads are frequent).
        workers = self.runtime.cached_workers({r.worker_id for r in info.replicas})
        sources = self.runtime.read_sources(info, workers)
        local = [w for w in workers if w.alive and self.runtime.is_local(w)]
        if local and not self.runtime.is_local(sources[0]):
            self.prefetch(local[0], timeout_s=timeout_s)
            sources = [local[0]]
        errors: list[str] = []
        corrupt = absent = full = 0
        for worker in sources:
            try:
                tensors = self._materialize(worker, info, timeout_s)
            # The replica just went away, arrived corrupt (a bad copy), or its worker has no
            # room to load it from its disk or file tier: try the next one.
            except (NotFound, Unavailable, IntegrityError, ResourceExhausted) as e:
                errors.append(f"{worker.name}: {e}")
                corrupt += isinstance(e, IntegrityError)
                absent += isinstance(e, NotFound)
                full += isinstance(e, ResourceExhausted)
                continue
            if device != "cpu":
                tensors = {k: v.to(device) for k, v in tensors.items()}
            return tensors
        if cached and errors and absent == len(errors):
            # Read with what put/register answered: the artifact may be gone since (an
            # expired lease, a delete). Ask the store: NotFound then, not a retryable error.
            return self._all_tensors(device, timeout_s, shared)
        detail = "; ".join(errors)
        if errors and full == len(errors):
            raise ResourceExhausted(
                f"no worker holding {self.art_id!r} has room to load it: {detail}"
            )
        if errors and corrupt == len(errors):  # every copy is bad: no retry will help
            raise IntegrityError(f"no replica of {self.art_id!r} is intact: {detail}")
        raise Unavailable(f"no replica of {self.art_id!r} could be read: {detail}")

    def _materialize(
        self, worker: WorkerInfo, info: ArtifactInfo, timeout_s: float
    ) -> dict[str, torch.Tensor]:
        from tensorcast import tensors as tmod
        from tensorcast.transport import native

        if self.runtime.is_local(worker):
            mm, base, metas = self.runtime.local_connection(worker).open(info.content_id)
            return tmod.tensors_over(mm, base, metas)
        stub = self.runtime.worker_stub(worker)
        ticket = stub.call(
            "OpenTransfer",
            pb.OpenTransferRequest(content_id=info.content_id, ttl_ms=int(timeout_s * 1000)),
        )
        if not all(t.hash_hex for t in info.tensors):
            info = self.refresh().info  # by reference, first read: hashes known only now
        buffer = bytearray(ticket.size_bytes)
        try:
            native.pull(
                ticket.data_addr,
                self.runtime.token,
                ticket.ticket,
                ticket.offset_bytes,
                ticket.size_bytes,
                buffer,
                0,
                timeout_s=timeout_s,
                tls=self.runtime.tls,
            )
        finally:
            try:  # never in place of the pull's own result or error
                stub.call(
                    "CloseTransfer",
                    pb.CloseTransferRequest(ticket=ticket.ticket),
                    timeout_s=CLOSE_TRANSFER_TIMEOUT_S,
                )
            except TensorcastError:
                pass
        view = memoryview(buffer)
        hashes = native.hash_buffers(
            [view[t.offset_bytes : t.offset_bytes + t.size_bytes] for t in info.tensors]
        )
        for t, h in zip(info.tensors, hashes):
            if t.hash_hex != h:
                raise IntegrityError(f"tensor {t.name!r} of {self.art_id!r} arrived corrupt")
        return tmod.tensors_over(buffer, 0, info.tensors)

    def transform_into(
        self,
        target: Mapping[str, torch.Tensor],
        spec: Mapping[str, str] | None = None,
        *,
        strict: bool = True,
    ) -> list[str]:
        """Fill existing tensors in place (e.g. a model's parameters) from this artifact.

        `spec` maps target names to artifact tensor names (default: the same names). Each target
        must have the source's shape; dtypes convert as `Tensor.copy_` does. The source tensors
        are mapped, not copied, so no second full-size allocation is made. With `strict`, every
        target must have a source. Every pair is checked before any is written: a refusal (a
        target missing or not a tensor, another shape, an expanded view) writes nothing.
        Returns the names filled.
        """
        import torch

        sources = self.tensor_dict()
        mapping = dict(spec) if spec is not None else {name: name for name in target}
        missing = sorted(t for t, s in mapping.items() if s not in sources)
        if strict and missing:
            raise InvalidArgument(f"{self.art_id!r} lacks tensors for {missing[:10]}")
        pairs = []  # every pair checked before any is written: a refusal writes nothing
        for name, source_name in mapping.items():
            if source_name not in sources:
                continue
            dest = target.get(name) if isinstance(target, Mapping) else None
            if not isinstance(dest, torch.Tensor):
                raise InvalidArgument(f"{name}: no target tensor of that name")
            source = sources[source_name]
            if tuple(source.shape) != tuple(dest.shape):
                raise InvalidArgument(
                    f"{name}: target shape {tuple(dest.shape)} != stored "
                    f"{source_name} {tuple(source.shape)}"
                )
            if any(st == 0 and n > 1 for st, n in zip(dest.stride(), dest.shape)):
                raise InvalidArgument(f"{name}: the target's elements overlap (an expanded view)")
            pairs.append((name, source, dest))
        with torch.no_grad():
            for _, source, dest in pairs:
                dest.copy_(source)
        return [name for name, _, _ in pairs]

    def prefetch(
        self,
        worker: str | WorkerInfo,
        device: str = "cpu",
        *,
        timeout_s: float = 60.0,
        streams: int = 0,
    ) -> pb.PrefetchReply:
        """Make `worker` hold a replica (pulled from the best peer; no-op if it has one).

        `device="cuda"` also puts it in the worker's GPU tier (a worker on this host started
        with --gpu-mem), where later `tensor_dict(device="cuda")` calls map it with no copy.
        """
        target = worker if isinstance(worker, WorkerInfo) else self.runtime.resolve_worker(worker)
        if device != "cpu":
            from tensorcast.sdk import device as on_device

            return on_device.prefetch_to_tier(self, target, device, timeout_s)
        return self._prefetch(target, timeout_s, streams, relay_from="", chain=False)

    def prefetch_chain(
        self,
        workers: Sequence[str | WorkerInfo],
        *,
        timeout_s: float = 60.0,
        streams: int = 0,
    ) -> list[pb.PrefetchReply]:
        """Make every worker of `workers` hold a replica, as a pipelined chain: the first pulls
        from the best replica, each next one from the one before while it receives, so N
        workers cost about one transfer, not N through the source's link. Workers that hold it
        already stay out of the chain. A link that cannot relay makes the next one pull from
        the usual sources; every replica is verified. Replies in the order of `workers`."""
        from concurrent.futures import ThreadPoolExecutor

        targets = [
            w if isinstance(w, WorkerInfo) else self.runtime.resolve_worker(w) for w in workers
        ]
        if len({t.worker_id for t in targets}) != len(targets):
            raise InvalidArgument("prefetch_chain: a worker is named twice")
        if not targets:
            return []
        holders = {r.worker_id for r in self.refresh().info.replicas if r.tier == "cpu"}
        upstream: dict[str, str] = {}
        previous = ""
        for t in targets:
            if t.worker_id not in holders:
                upstream[t.worker_id] = previous
                previous = t.worker_id
        relays = set(upstream.values())
        # Every link must pull at once for the chain to be a pipeline; past MAX_CHAIN_THREADS
        # the tail links start as others finish (from a whole replica, not a pipelined one).
        with ThreadPoolExecutor(max_workers=min(len(targets), MAX_CHAIN_THREADS)) as pool:
            futures = [
                pool.submit(
                    self._prefetch,
                    t,
                    timeout_s,
                    streams,
                    upstream.get(t.worker_id, ""),
                    t.worker_id in relays,
                )
                for t in targets
            ]
            return [f.result() for f in futures]

    def _prefetch(
        self, target: WorkerInfo, timeout_s: float, streams: int, relay_from: str, chain: bool
    ) -> pb.PrefetchReply:
        if not 0 < timeout_s <= MAX_PREFETCH_TIMEOUT_S:
            raise InvalidArgument(
                f"prefetch timeout_s must be in (0, {MAX_PREFETCH_TIMEOUT_S:.0f}], not {timeout_s}"
            )
        return self.runtime.worker_stub(target).call(
            "Prefetch",
            pb.PrefetchRequest(
                content_id=self.content_id,
                timeout_ms=int(timeout_s * 1000),
                streams=streams,
                relay_from=relay_from,
                chain=chain,
            ),
            timeout_s=timeout_s + 5.0,
        )

    def pin(self, worker: str | WorkerInfo, *, timeout_s: float = 60.0) -> None:
        """Keep a replica on `worker` that eviction never drops (prefetched first if needed)."""
        target = worker if isinstance(worker, WorkerInfo) else self.runtime.resolve_worker(worker)
        self.prefetch(target, timeout_s=timeout_s)
        self.runtime.worker_stub(target).call(
            "Pin", pb.PinRequest(content_id=self.content_id, pinned=True)
        )

    def unpin(self, worker: str | WorkerInfo) -> None:
        target = worker if isinstance(worker, WorkerInfo) else self.runtime.resolve_worker(worker)
        self.runtime.worker_stub(target).call(
            "Pin", pb.PinRequest(content_id=self.content_id, pinned=False)
        )

    def view(self, slices: Mapping[str, SliceLike], name: str, ttl_s: float = 0.0) -> Artifact:
        """A derived artifact `name`: every tensor, those named in `slices` sliced by the worker
        holding the data (basic indexing: an int or slice for dim 0, or a sequence of slices).
        Owned like this artifact, or caller-leased for `ttl_s` when given."""
        from tensorcast.store.base import check_lease_ttl, validate_art_id

        # Checked before the worker cuts the slices: refused afterwards, the copy it made
        # would hold pool memory unnamed until the unreferenced sweep.
        validate_art_id(name)
        if ttl_s:
            check_lease_ttl(ttl_s)
        if not isinstance(slices, Mapping):
            raise InvalidArgument("slices must map tensor names to an index")
        meta = self.tensor_meta()
        specs = []
        for tensor, index in slices.items():
            if tensor not in meta:
                raise InvalidArgument(f"{self.art_id!r} has no tensor {tensor!r}")
            specs.append(_slice_spec(tensor, meta[tensor].shape, index))
        info = self.refresh().info
        last: TensorcastError | None = None
        for worker in self.runtime.read_sources(info):
            try:
                reply = self.runtime.worker_stub(worker).call(
                    "View", pb.ViewRequest(content_id=info.content_id, slices=specs)
                )
            except (NotFound, Unavailable) as e:
                last = e
                continue
            if ttl_s:
                owner, ttl = OWNER_LEASE, ttl_s
            else:
                owner, ttl = info.owner, _remaining_ttl(info)
            return self.runtime._name(name, reply.content_id, owner, ttl, self.art_id)
        assert last is not None
        raise last

    def renew(self, ttl_s: float) -> Artifact:
        """Extend a caller-leased artifact's lease to `ttl_s` from now."""
        self.info = self.runtime.renew(self.art_id, ttl_s)
        return self


def _remaining_ttl(info: ArtifactInfo) -> float:
    import time

    return max(0.001, info.expires_at - time.time()) if info.expires_at else 0.0


def _slice_spec(tensor: str, shape: tuple[int, ...], index: SliceLike) -> pb.SliceSpec:
    one = isinstance(index, (slice, int)) and not isinstance(index, bool)
    if not one and not isinstance(index, (list, tuple)):
        raise InvalidArgument(f"{tensor!r}: use an int, a slice or a sequence of them")
    dims: list[Any] = [index] if one else list(index)  # type: ignore[arg-type]
    if len(dims) > len(shape):
        raise InvalidArgument(f"{tensor!r} has {len(shape)} dims, got {len(dims)} indices")
    spec = pb.SliceSpec(tensor=tensor)
    for size, d in zip(shape, dims):
        if isinstance(d, int) and not isinstance(d, bool):  # an int keeps a length-1 dim
            if not -size <= d < size:
                raise InvalidArgument(f"{tensor!r}: index {d} out of range for size {size}")
            d = slice(d % size, d % size + 1)
        if not isinstance(d, slice):
            raise InvalidArgument(f"{tensor!r}: use ints or slices, got {d!r}")
        try:
            start, stop, step = d.indices(size)
        except (TypeError, ValueError) as e:  # a zero step, a float bound
            raise InvalidArgument(f"{tensor!r}: bad slice {d!r}: {e}") from None
        if step < 1:
            raise InvalidArgument(f"{tensor!r}: negative steps are not supported")
        spec.start.append(start)
        spec.stop.append(max(start, stop))
        spec.step.append(step)
    return spec
