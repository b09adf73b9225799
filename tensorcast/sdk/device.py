"""Artifacts on a GPU: `Artifact.tensor_dict(device="cuda:N")` and GPU-tier prefetches.

Where the bytes come from, best first:

1. The GPU tier of a worker on this host whose GPU is ours (same UUID, whatever the indexes in
   each process): the tier's device memory, mapped by CUDA IPC, no copy (`shared=True`, the
   default; a content not in the tier yet is copied in from the worker's pool first, once, for
   every later caller), or a private device-to-device copy of it (`shared=False`, only when the
   tier holds the content already).
2. That worker's pool, copied by the worker straight into a buffer this process allocated and
   exported to it by CUDA IPC: the worker's pool is page-locked once, at its start, so this is
   plain DMA (a private copy of a content not in the tier, or one the tier has no room for).
3. A worker on this host without a GPU tier: its pool region is mapped here and copied to the
   GPU, chunked on a stream of its own, through pinned staging buffers or page-locked chunk by
   chunk (`TC_CUDA_COPY`; transport/cuda.py). `TC_CUDA_COPY=register|staging` also forces this
   route where 2 would apply (for measurements).
4. A worker on another host: pulled into this process as for the CPU, then copied.

A same-host worker without a replica gets one first (a prefetch from a peer), as for the CPU.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tensorcast import config
from tensorcast.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.types import ArtifactInfo, TensorMeta, WorkerInfo

if TYPE_CHECKING:
    import torch

    from tensorcast.sdk.artifact import Artifact
    from tensorcast.sdk.local_client import LocalConnection
    from tensorcast.sdk.runtime import Runtime

# How this process copies a same-host pool's bytes to a GPU when no worker does it for it
# (`TC_CUDA_COPY=auto`): through pinned staging buffers. Registering a fresh mapping chunk by
# chunk faults every 4 KiB page in first and ran at a third of that on an H200 (decision 53).
AUTO_ROUTE = "staging"


@dataclass(frozen=True)
class TierInfo:
    """A same-host worker's GPU tier, as its `gpu_hello` describes it."""

    worker_id: str
    device_uuid: str
    device_index: int  # in the worker's own numbering
    capacity_bytes: int
    export: dict[str, Any]


_tiers: dict[str, TierInfo | None] = {}
_tiers_lock = threading.Lock()
# The last pool-to-GPU copy of this process (route, seconds, registration time): diagnostics and
# benchmarks only.
last_copy_report: Any = None


def is_cuda(device: str) -> bool:
    from tensorcast.transport import cuda

    return cuda.is_cuda(device)


def tier_of(rt: Runtime, worker: WorkerInfo) -> TierInfo | None:
    """The GPU tier of a worker on this host, or None when it has none (asked once per
    worker process)."""
    with _tiers_lock:
        if worker.worker_id in _tiers:
            return _tiers[worker.worker_id]
    try:
        reply = rt.local_connection(worker).request({"op": "gpu_hello"})
        tier: TierInfo | None = TierInfo(
            worker.worker_id,
            str(reply["device_uuid"]),
            int(reply["device_index"]),
            int(reply["capacity_bytes"]),
            dict(reply["export"]),
        )
    except (NotFound, InvalidArgument):
        tier = None  # started without --gpu-mem (or a worker that predates GPU tiers)
    except Unavailable:
        return None  # gone, though still listed alive: no tier this time (not remembered)
    with _tiers_lock:
        _tiers[worker.worker_id] = tier
    return tier


def copy_route() -> str:
    method = config.cuda_copy_method()
    return AUTO_ROUTE if method == "auto" else method


def materialize(
    art: Artifact, device: str, timeout_s: float, shared: bool
) -> dict[str, torch.Tensor]:
    """Every tensor of `art` (model files included) on the CUDA device `device`."""
    from tensorcast.transport import cuda

    target = cuda.resolve(device)
    rt = art.runtime
    info = art.refresh().info
    workers = rt.workers()
    sources = rt.read_sources(info, workers)
    local = [w for w in workers if w.alive and rt.is_local(w)]
    uuid = cuda.device_uuid(target) if local else ""
    tiered = [w for w in local if (t := tier_of(rt, w)) is not None and t.device_uuid == uuid]
    home = (tiered or local)[0] if local else None
    if home is not None and (
        not rt.is_local(sources[0])  # no copy on this host yet: as for the CPU
        or (tiered and shared and home.worker_id not in {w.worker_id for w in sources})
    ):
        art.prefetch(home, timeout_s=timeout_s)
        sources = [home]
    errors: list[str] = []
    if tiered:
        tier = tier_of(rt, tiered[0])
        assert tier is not None
        try:
            return _from_tier(rt, tiered[0], tier, info, target, shared)
        except (NotFound, ResourceExhausted, Unavailable) as e:
            errors.append(f"{tiered[0].name} GPU tier: {e}")
        if config.cuda_copy_method() == "auto":
            try:
                return _through_worker(rt.local_connection(tiered[0]), info, target)
            except (NotFound, Unavailable, InvalidArgument) as e:  # not in that worker's pool
                errors.append(f"{tiered[0].name} DMA: {e}")
    for worker in sources:
        try:
            if rt.is_local(worker):
                return _from_pool(rt.local_connection(worker), info.content_id, target)
            tensors = art._materialize(worker, info, timeout_s)
            return {k: v.to(target) for k, v in tensors.items()}
        except (NotFound, Unavailable) as e:  # replica just went away: try the next one
            errors.append(f"{worker.name}: {e}")
    raise Unavailable(f"no replica of {art.art_id!r} could be read: {'; '.join(errors)}")


def _from_tier(
    rt: Runtime,
    worker: WorkerInfo,
    tier: TierInfo,
    info: ArtifactInfo,
    target: torch.device,
    shared: bool,
) -> dict[str, torch.Tensor]:
    import torch

    from tensorcast.transport import cuda

    conn = rt.local_connection(worker)
    reply = conn.request({"op": "gpu_open", "content_id": info.content_id, "load": shared})
    hold_id = int(reply["hold_id"])
    metas = tuple(TensorMeta.from_json(t) for t in reply["tensors"])
    size = int(reply["size_bytes"])
    if size == 0:
        conn.release_now(hold_id)
        return cuda.views_over(torch.empty(0, dtype=torch.uint8, device=target), metas)
    try:
        storage = cuda.open_allocation(tier.export, target)
        flat, region = cuda.region_tensor(storage, int(reply["offset"]), size, target)
    except BaseException:
        conn.release_now(hold_id)
        raise
    # From here the hold lives exactly as long as some tensor over the range does.
    conn.release_when_collected(region, hold_id)
    del region
    if shared:
        return cuda.views_over(flat, metas)
    private = torch.empty(size, dtype=torch.uint8, device=target)
    private.copy_(flat)
    torch.cuda.current_stream(target).synchronize()  # before the hold can end
    return cuda.views_over(private, metas)


def _through_worker(
    conn: LocalConnection, info: ArtifactInfo, target: torch.device
) -> dict[str, torch.Tensor]:
    """A private copy made by the worker: it writes its (page-locked) pool region into a
    buffer of ours that it maps by CUDA IPC."""
    global last_copy_report
    import torch

    from tensorcast.transport import cuda

    if info.size_bytes == 0:
        return cuda.views_over(torch.empty(0, dtype=torch.uint8, device=target), info.tensors)
    started = time.perf_counter()
    dest = torch.empty(info.size_bytes, dtype=torch.uint8, device=target)
    reply = conn.request(
        {"op": "gpu_copy", "content_id": info.content_id, "target": cuda.export_allocation(dest)}
    )
    size = int(reply["size_bytes"])
    last_copy_report = cuda.CopyReport("worker", size, time.perf_counter() - started)
    metas = tuple(TensorMeta.from_json(t) for t in reply["tensors"])
    return cuda.views_over(dest[:size], metas)


def _from_pool(
    conn: LocalConnection, content_id: str, target: torch.device
) -> dict[str, torch.Tensor]:
    """Hold the content in the worker's pool, copy its region to the GPU, release it."""
    import torch

    from tensorcast.transport import cuda

    reply = conn.request({"op": "open", "content_id": content_id})
    try:
        size = int(reply["size_bytes"])
        metas = tuple(TensorMeta.from_json(t) for t in reply["tensors"])
        dest = torch.empty(size, dtype=torch.uint8, device=target)
        if size:
            copy_region(conn, int(reply["offset"]), size, dest, copy_route())
    finally:
        conn.release_now(int(reply["hold_id"]))
    return cuda.views_over(dest, metas)


def copy_region(
    conn: LocalConnection, offset: int, size_bytes: int, dest: torch.Tensor, route: str
) -> Any:
    """Copy [offset, offset+size) of a same-host worker's pool (held by the caller) into
    `dest`; returns the CopyReport."""
    from tensorcast.transport import cuda

    global last_copy_report
    mm, base = conn.map(offset, size_bytes, writable=True)  # shared: registrable, no COW
    try:
        host = cuda.host_tensor(memoryview(mm)[base : base + size_bytes])
        report = cuda.copy_to_device(host, dest, route)
        del host
        last_copy_report = report
        return report
    finally:
        with contextlib.suppress(BufferError):  # still exported: unmapped when collected
            mm.close()


def prefetch_to_tier(
    art: Artifact, worker: WorkerInfo, device: str, timeout_s: float
) -> pb.PrefetchReply:
    """Make a same-host worker hold `art` in its GPU tier (and in its pool, pulled from a peer
    first when needed). `device` ("cuda" or "cuda:N", N in the worker's numbering) must name
    the tier's GPU. Needs no GPU in the calling process."""
    from tensorcast.transport import cuda

    parsed = cuda.parse(device)
    if parsed.type != "cuda":
        raise InvalidArgument(f"device {device!r}: only 'cpu' and CUDA devices have tiers")
    rt = art.runtime
    if not rt.is_local(worker):
        raise InvalidArgument(
            f"GPU-tier prefetch goes through the worker's local socket: run it on "
            f"{worker.name}'s host"
        )
    tier = tier_of(rt, worker)
    if tier is None:
        raise InvalidArgument(f"worker {worker.name} has no GPU tier (start it with --gpu-mem)")
    if parsed.index is not None and parsed.index != tier.device_index:
        raise InvalidArgument(
            f"worker {worker.name}'s GPU tier is on its cuda:{tier.device_index}, not {device}"
        )
    started = time.monotonic()
    pulled = art.prefetch(worker, timeout_s=timeout_s)
    reply = rt.local_connection(worker).request({"op": "gpu_load", "content_id": art.content_id})
    return pb.PrefetchReply(
        already_present=bool(reply["already_present"]),
        bytes_moved=int(reply["bytes_moved"]) + pulled.bytes_moved,
        source_worker_id=pulled.source_worker_id or worker.worker_id,
        elapsed_s=time.monotonic() - started,
        retries=pulled.retries,
    )


def tier_stats(rt: Runtime, worker: WorkerInfo) -> dict[str, Any]:
    """A same-host worker's GPU tier: capacity, used bytes, contents, holds, loads, evictions."""
    reply = rt.local_connection(worker).request({"op": "gpu_stats"})
    return {k: v for k, v in reply.items() if k != "ok"}
