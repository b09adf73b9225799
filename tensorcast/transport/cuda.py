"""CUDA for the data plane: device names, host-to-device copies out of shared memory, and device
memory shared between processes of one host by CUDA IPC handles.

Imports torch; CUDA itself is initialised only by the functions that need a GPU, and each of them
raises `Unavailable` naming why there is none (a CPU-only torch build, no visible GPU) rather
than torch's own error.

Host-to-device copies (`copy_to_device`) take one of three routes, all chunked and all on a
dedicated stream per device so that the caller's default stream stays free:

- *pinned*: the source is already page-locked (the worker registers its whole pool once, at
  start): one asynchronous DMA per chunk, nothing else.
- *register*: the source is pageable shared memory mapped for this one copy; each chunk is
  registered with `cudaHostRegister` just before its DMA is queued, so registering chunk i+1
  overlaps the DMA of chunk i, and chunks are unregistered as their DMA completes.
- *staging*: a ring of pinned buffers; the CPU copies chunk i+1 into one buffer (all cores, GIL
  released) while the DMA engine drains chunk i from another. Used when registering is not
  allowed (some containers and VMs refuse it) or slower.

Device memory is shared by exporting one allocation (a worker's whole GPU tier) with
`UntypedStorage._share_cuda_` and opening it once per process with `_new_shared_cuda`; callers then
take ranges of it (`region_tensor`) whose lifetime is tracked per range, so a worker knows when a
caller no longer uses a content (see `DeviceRegion`).
"""

from __future__ import annotations

import base64
import ctypes
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tensorcast.errors import InvalidArgument, Unavailable
from tensorcast.types import TensorMeta

log = logging.getLogger("tensorcast.cuda")

CHUNK_BYTES = 64 << 20  # one DMA; a staging buffer
STAGING_BUFFERS = 3  # CPU fills one while the DMA engine drains another; one spare
HOST_REGISTER_DEFAULT = 0  # cudaHostRegisterDefault
PAGE_BYTES = 4096
COPY_ROUTES = ("pinned", "register", "staging")


# -- devices -----------------------------------------------------------------------------------


def unavailable_reason() -> str | None:
    """Why this process cannot use CUDA, or None when it can."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    if not torch.cuda.is_available():
        return "torch sees no GPU (no driver, or CUDA_VISIBLE_DEVICES hides them)"
    return None


def is_cuda(device: str | torch.device) -> bool:
    """Whether `device` names a CUDA device ("cuda", "cuda:1"); InvalidArgument if unparsable."""
    return parse(device).type == "cuda"


def parse(device: str | torch.device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise InvalidArgument(
            f"bad device {device!r} ({e}): use 'cpu', 'cuda' or 'cuda:N'"
        ) from None


def resolve(device: str | torch.device) -> torch.device:
    """A usable CUDA device with its index ("cuda" -> the current one)."""
    parsed = parse(device)
    if parsed.type != "cuda":
        raise InvalidArgument(f"{device!r} is not a CUDA device")
    reason = unavailable_reason()
    if reason is not None:
        raise Unavailable(
            f"device {str(device)!r} needs CUDA, but {reason}: use device='cpu', or run "
            "where torch has CUDA and sees a GPU"
        )
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if parsed.index is None else parsed.index
    if not 0 <= index < count:
        raise InvalidArgument(
            f"device {str(device)!r}: this process sees {count} GPU(s), cuda:0 to cuda:{count - 1}"
        )
    return torch.device("cuda", index)


def device_uuid(device: torch.device) -> str:
    """The GPU's UUID: the same card has different indexes in processes whose
    CUDA_VISIBLE_DEVICES differ, but one UUID."""
    return str(torch.cuda.get_device_properties(device).uuid)


def _clear_last_error() -> None:
    """Reset CUDA's per-thread "last error" after a runtime call that failed on purpose (a
    refused cudaHostRegister): torch checks it after every kernel launch and would blame the
    next kernel for it."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
        if paths:
            return
    except OSError:
        pass
    try:  # torch linked the runtime statically: a launch reads (and clears) the error
        torch.zeros(1, device="cuda")
    except RuntimeError:
        pass


# -- page-locking host memory --------------------------------------------------------------------


def register_host(ptr: int, size_bytes: int) -> int:
    """cudaHostRegister [ptr, ptr+size); returns the CUDA error code (0 on success)."""
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, size_bytes, HOST_REGISTER_DEFAULT))
    if err:
        _clear_last_error()
    return err


def unregister_host(ptr: int) -> None:
    if int(torch.cuda.cudart().cudaHostUnregister(ptr)):
        _clear_last_error()


class PinnedHost:
    """A host buffer (e.g. the worker's whole pool mapping) page-locked for CUDA for as long as
    this object is open, so that copies from and to it are plain DMA. `pinned` is False where
    the platform refuses (`error` says why); copies then fall back to staging."""

    def __init__(self, buffer: Any) -> None:
        self.tensor = host_tensor(buffer)
        self.size_bytes = self.tensor.numel()
        self.error = 0
        started = time.perf_counter()
        if self.size_bytes:
            self.error = register_host(self.tensor.data_ptr(), self.size_bytes)
        self.register_s = time.perf_counter() - started
        self.pinned = self.size_bytes > 0 and self.error == 0

    def close(self) -> None:
        if self.pinned:
            torch.cuda.synchronize()  # no DMA may still read or write it
            unregister_host(self.tensor.data_ptr())
            self.pinned = False


def host_tensor(buffer: Any) -> torch.Tensor:
    """A CPU uint8 tensor over a writable buffer (a pool mapping): no copy."""
    view = memoryview(buffer).cast("B")
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(view, dtype=torch.uint8)


# -- copies ----------------------------------------------------------------------------------------


def chunk_spans(size_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of consecutive chunks covering `size_bytes`."""
    if chunk_bytes <= 0:
        raise InvalidArgument("chunk_bytes must be > 0")
    return [(off, min(chunk_bytes, size_bytes - off)) for off in range(0, size_bytes, chunk_bytes)]


class DeviceQueue(Protocol):
    """Where chunks go. `CudaQueue` is the real one (a CUDA stream); tests use a CPU stand-in
    that runs each copy only when waited for, as an asynchronous device would."""

    def submit(self, dest_offset: int, source: torch.Tensor) -> Any:
        """Queue a copy of `source` (host) to dest[dest_offset:]; returns its completion."""
        ...

    def done(self, completion: Any) -> bool:
        """Whether that copy has finished (no wait)."""
        ...

    def wait(self, completion: Any) -> None:
        """Block until that copy has finished: its source may be reused."""
        ...

    def finish(self) -> None:
        """Block until every queued copy has finished."""
        ...


class CudaQueue:
    """Copies into `dest` (a contiguous CUDA uint8 tensor) on a stream of their own."""

    def __init__(self, dest: torch.Tensor, stream: torch.cuda.Stream) -> None:
        self.dest = dest
        self.stream = stream
        # dest was allocated on the caller's stream: ours must not write it before that.
        stream.wait_stream(torch.cuda.current_stream(dest.device))

    def submit(self, dest_offset: int, source: torch.Tensor) -> Any:
        with torch.cuda.stream(self.stream):
            self.dest[dest_offset : dest_offset + source.numel()].copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def done(self, completion: Any) -> bool:
        return bool(completion.query())

    def wait(self, completion: Any) -> None:
        completion.synchronize()

    def finish(self) -> None:
        self.stream.synchronize()


def staged_copy(
    source: Any,
    queue: DeviceQueue,
    staging: Sequence[torch.Tensor],
    copy_bytes: Callable[[Any, Any], None],
) -> int:
    """Copy `source` (host bytes, sliceable) through the pinned `staging` buffers: chunk i is
    copied into buffer i % n by the CPU, then queued; a buffer is refilled only once its last
    copy has finished. Returns the number of chunks. `copy_bytes(dest, source)` is the CPU copy
    (the native parallel memcpy)."""
    pending: list[Any] = [None] * len(staging)
    spans = chunk_spans(len(source), staging[0].numel())
    for i, (offset, length) in enumerate(spans):
        slot = i % len(staging)
        if pending[slot] is not None:
            queue.wait(pending[slot])
        buffer = staging[slot][:length]
        copy_bytes(buffer.numpy(), source[offset : offset + length])
        pending[slot] = queue.submit(offset, buffer)
    queue.finish()
    return len(spans)


@dataclass
class CopyReport:
    route: str  # pinned | register | staging | register+staging (registering stopped midway)
    size_bytes: int
    seconds: float
    register_s: float = 0.0  # time spent in cudaHostRegister / cudaHostUnregister
    chunks: int = 0

    @property
    def gb_per_s(self) -> float:
        return self.size_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


_lock = threading.Lock()
_streams: dict[int, torch.cuda.Stream] = {}
_staging: list[torch.Tensor] = []
_staging_lock = threading.Lock()  # one staged copy at a time per process: the buffers are shared


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """This process's stream for TensorCast's copies to `device`."""
    with _lock:
        stream = _streams.get(device.index or 0)
        if stream is None:
            stream = _streams[device.index or 0] = torch.cuda.Stream(device)
        return stream


def _staging_buffers() -> list[torch.Tensor]:
    if not _staging:
        _staging.extend(
            torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
            for _ in range(STAGING_BUFFERS)
        )
    return _staging


def _cpu_copy(dest: Any, source: Any) -> None:
    from tensorcast.transport import native

    native.copy_into(dest, 0, source)


def copy_to_device(
    host: torch.Tensor,
    dest: torch.Tensor,
    route: str = "staging",
    *,
    chunk_bytes: int = CHUNK_BYTES,
) -> CopyReport:
    """Copy `host` (a contiguous CPU uint8 tensor, e.g. over a pool mapping) into `dest` (a
    contiguous CUDA uint8 tensor of the same size) and wait for it. `route`: "pinned" when
    `host` is page-locked already, "register" to page-lock it chunk by chunk for this copy, or
    "staging". A refused registration continues through staging from that chunk on."""
    if route not in COPY_ROUTES:
        raise InvalidArgument(f"copy route {route!r}: choose one of {', '.join(COPY_ROUTES)}")
    if host.numel() != dest.numel():
        raise InvalidArgument(f"copy of {host.numel()} bytes into {dest.numel()}")
    started = time.perf_counter()
    size = host.numel()
    queue = CudaQueue(dest, copy_stream(dest.device))
    report = CopyReport(route, size, 0.0)
    if route == "pinned":
        for offset, length in chunk_spans(size, chunk_bytes):
            queue.submit(offset, host[offset : offset + length])
            report.chunks += 1
        queue.finish()
    else:
        done = 0
        if route == "register":
            done = _registered_copy(host, queue, chunk_bytes, report)
        if done < size:
            if route == "register":
                report.route = "register+staging"
            source = host[done:].numpy()
            with _staging_lock:
                report.chunks += staged_copy(
                    source, _Shifted(queue, done), _staging_buffers(), _cpu_copy
                )
    report.seconds = time.perf_counter() - started
    return report


class _Shifted:
    """A queue whose offsets start `base` bytes into the real one's destination."""

    def __init__(self, queue: DeviceQueue, base: int) -> None:
        self.queue = queue
        self.base = base

    def submit(self, dest_offset: int, source: torch.Tensor) -> Any:
        return self.queue.submit(self.base + dest_offset, source)

    def done(self, completion: Any) -> bool:
        return self.queue.done(completion)

    def wait(self, completion: Any) -> None:
        self.queue.wait(completion)

    def finish(self) -> None:
        self.queue.finish()


def _registered_copy(
    host: torch.Tensor, queue: DeviceQueue, chunk_bytes: int, report: CopyReport
) -> int:
    """Register, queue and (once copied) unregister chunk after chunk; registering the next
    chunk overlaps the DMA of this one. Returns how many bytes were copied this way (less than
    all when registration was refused)."""
    base = host.data_ptr()
    registered: list[tuple[int, Any]] = []  # (pointer, completion), oldest first
    copied = 0
    # Chunks start on page boundaries: two registrations never share a page.
    head = min(-base % PAGE_BYTES, host.numel())
    spans = [(0, head)] if head else []
    spans += [(head + o, n) for o, n in chunk_spans(host.numel() - head, chunk_bytes)]
    try:
        for offset, length in spans:
            started = time.perf_counter()
            err = register_host(base + offset, length)
            report.register_s += time.perf_counter() - started
            if err:
                log.info("cudaHostRegister refused (error %d): staging the rest", err)
                break
            completion = queue.submit(offset, host[offset : offset + length])
            registered.append((base + offset, completion))
            report.chunks += 1
            copied = offset + length
            while len(registered) > 1 and queue.done(registered[0][1]):
                started = time.perf_counter()
                unregister_host(registered.pop(0)[0])
                report.register_s += time.perf_counter() - started
    finally:
        queue.finish()  # even on error: no DMA may read a chunk after it is unregistered
        started = time.perf_counter()
        for ptr, _ in registered:
            unregister_host(ptr)
        report.register_s += time.perf_counter() - started
    return copied


# -- tensors over device bytes -----------------------------------------------------------------


def views_over(flat: torch.Tensor, metas: Sequence[TensorMeta]) -> dict[str, torch.Tensor]:
    """Tensors over `flat` (a uint8 tensor holding a content's bytes): views where a tensor's
    offset suits its dtype's alignment, a copy of just that tensor where it does not."""
    from tensorcast.tensors import TORCH_DTYPES

    out = {}
    for m in metas:
        dtype = TORCH_DTYPES[m.dtype]
        if m.size_bytes == 0:
            out[m.name] = torch.empty(m.shape, dtype=dtype, device=flat.device)
            continue
        piece = flat[m.offset_bytes : m.offset_bytes + m.size_bytes]
        if (flat.storage_offset() + m.offset_bytes) % dtype.itemsize == 0:
            out[m.name] = piece.view(dtype).view(m.shape)
        else:
            aligned = torch.empty(m.shape, dtype=dtype, device=flat.device)
            aligned.view(-1).view(torch.uint8).copy_(piece)
            out[m.name] = aligned
    return out


# -- CUDA IPC ------------------------------------------------------------------------------------


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def export_allocation(tensor: torch.Tensor) -> dict[str, Any]:
    """What another process of this host needs to map `tensor`'s whole storage (JSON-able).
    Export once per allocation: the exporting process must keep it alive while others map it
    (the worker keeps its GPU tier for its lifetime and tracks each caller's use itself)."""
    (
        _device,
        handle,
        size_bytes,
        offset_bytes,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ) = tensor.untyped_storage()._share_cuda_()
    return {
        "handle": _b64(handle),
        "size_bytes": int(size_bytes),
        "offset_bytes": int(offset_bytes),
        "ref_counter_handle": _b64(ref_counter_handle),
        "ref_counter_offset": int(ref_counter_offset),
        "event_handle": _b64(event_handle),
        "event_sync_required": bool(event_sync_required),
    }


_opened: dict[tuple[str, int], torch.UntypedStorage] = {}


def open_allocation(
    export: dict[str, Any], device: torch.device, *, keep: bool = True
) -> torch.UntypedStorage:
    """Map an exported allocation into this process. `device` is this process's index of the
    exporter's GPU. With `keep` (a worker's GPU tier) the mapping is opened once per process and
    kept; without (a caller's buffer the worker writes into once) it closes when the returned
    storage is dropped."""
    key = (str(export["handle"]), int(export["offset_bytes"]))
    with _lock:
        storage = _opened.get(key) if keep else None
        if storage is None:
            torch.cuda.init()
            storage = torch.UntypedStorage._new_shared_cuda(
                device.index,
                _unb64(export["handle"]),
                int(export["size_bytes"]),
                int(export["offset_bytes"]),
                _unb64(export["ref_counter_handle"]),
                int(export["ref_counter_offset"]),
                _unb64(export["event_handle"]),
                bool(export["event_sync_required"]),
            )
            if keep:
                _opened[key] = storage
        return storage


class DeviceRegion:
    """`size_bytes` of an opened allocation at `offset`, as a CUDA array (the
    `__cuda_array_interface__` protocol): `torch.as_tensor` wraps it without copying and keeps
    this object alive for as long as any tensor over it lives, so `weakref.finalize` on it
    tells when the last one is gone."""

    def __init__(self, storage: torch.UntypedStorage, offset: int, size_bytes: int) -> None:
        if offset < 0 or offset + size_bytes > storage.nbytes():
            raise InvalidArgument(
                f"region [{offset}, {offset + size_bytes}) outside a {storage.nbytes()}-byte "
                "allocation"
            )
        self._storage = storage  # the mapping stays open while a region of it lives
        self.ptr = storage.data_ptr() + offset
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": (size_bytes,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "strides": None,
            "version": 3,
        }


def region_tensor(
    storage: torch.UntypedStorage, offset: int, size_bytes: int, device: torch.device
) -> tuple[torch.Tensor, DeviceRegion]:
    """A uint8 tensor over [offset, offset+size) of an opened allocation, no copy, and the
    region object it keeps alive: `weakref.finalize(region, ...)` runs once that tensor and
    every view of it are gone."""
    region = DeviceRegion(storage, offset, size_bytes)
    flat = torch.as_tensor(region, device=device)
    if flat.data_ptr() != region.ptr:
        raise AssertionError("torch copied a CUDA array instead of wrapping it")
    return flat, region
