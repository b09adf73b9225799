"""KV pages whose bytes live on a GPU (an engine's KV cache blocks), for same-host shard homes.

`put_pages({key: cuda_tensor})` copies each page device-to-host straight into a region of the
home's pool (allocated over the page socket, then committed), and `get_pages(keys, into=[cuda
tensors])` copies host-to-device straight out of the pool: no intermediate host buffer. The
caller's mapping of the pool is page-locked once per connection (cudaHostRegister) so both are
plain DMA; where the platform refuses, the same copies go through CUDA's own staging.

Ordering: copies run on the current stream of the tensor's device, so a page is read after the
kernels that wrote it were queued, and pages read into `into` are usable by kernels queued
after `get_pages` returns (it waits for the copies, to check their hashes).

Integrity as on the CPU path: a page put is hashed from the pool region the device wrote; a page
read is hashed from its pool region *after* its copy finished, and one whose region changed
meanwhile (evicted and reused) reads as absent (None), never as other bytes. Homes on other hosts
move through host memory (gRPC) and are copied to or from the device on this side.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tensorcast import errors
from tensorcast.transport import native

if TYPE_CHECKING:
    import torch

    from tensorcast.sdk.page_client import PageConnection, PutMeta, Wanted
    from tensorcast.sdk.pages import PageData, PageRef, Pages

_pinned: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_pinned_lock = threading.Lock()


def on_device(value: Any) -> bool:
    """A torch tensor on a GPU (not a CPU tensor, not bytes)."""
    return bool(getattr(value, "is_cuda", False))


def host_bytes(value: Any) -> Any:
    """A GPU page's bytes in host memory (for homes on other hosts); others as they are."""
    if not on_device(value):
        return value
    from tensorcast import tensors as tmod

    return tmod.tensor_bytes(value).data


def pool_tensor(conn: PageConnection) -> torch.Tensor:
    """The home's pool as a CPU uint8 tensor over this process's mapping, page-locked for DMA
    once per connection (where allowed)."""
    from tensorcast.transport import cuda

    with _pinned_lock:
        pinned = _pinned.get(conn)
        if pinned is None:
            pinned = _pinned[conn] = cuda.PinnedHost(conn.arena())
        return pinned.tensor


def unpin(conn: PageConnection) -> None:
    """Unlock the pool mapping `pool_tensor` page-locked for `conn`, which is closing: left
    registered, the pages of a dead worker's pool would stay locked (and allocated) for as long
    as this process runs."""
    with _pinned_lock:
        pinned = _pinned.pop(conn, None)
    if pinned is not None:
        pinned.close()


def _flat(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _sync(devices: set[Any]) -> None:
    import torch

    for device in devices:
        torch.cuda.current_stream(device).synchronize()


def put_local(
    conn: PageConnection, ttl_s: float, metas: Sequence[PutMeta], values: Sequence[Any]
) -> list[str]:
    """Put pages to a same-host home, GPU tensors copied device-to-host into the pool, the rest
    as the native client puts them. Returns the hashes in order."""
    gpu = [i for i, v in enumerate(values) if on_device(v)]
    rest = [i for i in range(len(values)) if not on_device(values[i])]
    hashes = [""] * len(values)
    if rest:
        for i, h in zip(rest, conn.put(ttl_s, [metas[i] for i in rest], [values[i] for i in rest])):
            hashes[i] = h
    if gpu:
        for i, h in zip(
            gpu, _put_device(conn, ttl_s, [metas[i] for i in gpu], [values[i] for i in gpu])
        ):
            hashes[i] = h
    return hashes


def _put_device(
    conn: PageConnection, ttl_s: float, metas: Sequence[PutMeta], values: Sequence[Any]
) -> list[str]:
    host = pool_tensor(conn)
    flats = [_flat(v) for v in values]
    offsets = conn.alloc([f.numel() for f in flats])
    try:
        for offset, flat in zip(offsets, flats):
            if flat.numel():
                host[offset : offset + flat.numel()].copy_(flat, non_blocking=True)
        _sync({f.device for f in flats})
        arena = conn.arena()
        hashes = native.hash_buffers([arena[o : o + f.numel()] for o, f in zip(offsets, flats)])
    except BaseException:
        # The socket has no "free": closing it gives the worker back the regions it allocated
        # (the connection is broken from now on, and the next call opens another).
        conn.close()
        raise
    conn.commit(
        ttl_s,
        [
            {
                "key": key,
                "shard": shard,
                "token": token,
                "dtype": dtype,
                "shape": shape,
                "offset": offset,
                "size_bytes": flat.numel(),
                "hash": digest,
            }
            for (key, shard, token, dtype, shape), offset, flat, digest in zip(
                metas, offsets, flats, hashes
            )
        ],
        [],
    )
    return hashes


def get_into_device(
    pages: Pages, keys: Sequence[str | PageRef], into: Sequence[Any], cache: Any = None
) -> list[PageData | None]:
    """`Pages.get_pages(keys, into=...)` where the buffers are GPU tensors."""
    from tensorcast.sdk.pages import PageRef, drop_other_versions

    if not all(on_device(b) for b in into):
        raise errors.InvalidArgument("`into` mixes GPU and host buffers: one kind per call")
    if not all(b.is_contiguous() for b in into):
        raise errors.InvalidArgument("`into` GPU buffers must be contiguous")
    dests = [_flat(b) for b in into]
    names = [k.key if isinstance(k, PageRef) else k for k in keys]
    out: list[PageData | None] = [None] * len(names)
    todo = list(range(len(names)))
    if cache is not None:
        expected = {i: k.hash for i, k in enumerate(keys) if isinstance(k, PageRef)}
        conn = pages._connection(cache.worker_id, cache.local_socket)
        got = _get_local(conn, [(names[i], 0, 0) for i in todo], [dests[i] for i in todo])
        for i, page in zip(todo, got):
            if page is not None and (i not in expected or page.hash == expected[i]):
                out[i] = page
        todo = [i for i in todo if out[i] is None]
    if not todo:
        return out

    def local(conn: PageConnection, ix: list[int], wanted: list[Wanted]) -> None:
        indexes = [todo[j] for j in ix]
        for i, page in zip(indexes, _get_local(conn, wanted, [dests[i] for i in indexes])):
            out[i] = page

    def remote(groups: list) -> list:
        """Remote homes: received into host memory (hash-checked), then copied to the GPU."""
        import torch

        indexes = [todo[j] for _, ix, _ in groups for j in ix]
        got, failures = pages._get_remote(
            [w for _, _, ws in groups for w in ws], pages._remote_homes(groups), None
        )
        for i, page in zip(indexes, got):
            if page is not None:
                dest = _fit(dests[i], len(page.data))
                if len(page.data):
                    dest.copy_(torch.frombuffer(page.data, dtype=torch.uint8))
                page = _device_page(page.key, page.dtype, page.shape, dest, page.hash)
            out[i] = page
        return failures

    pages._each_home([names[i] for i in todo], local, remote, partial=True)
    drop_other_versions(keys, out, todo)
    return out


def _fit(dest: torch.Tensor, size: int) -> torch.Tensor:
    if dest.numel() < size:
        raise errors.InvalidArgument(
            f"a {size}-byte page does not fit its {dest.numel()}-byte buffer"
        )
    return dest[:size]


def _device_page(key: str, dtype: str, shape: tuple[int, ...], data: Any, digest: str) -> PageData:
    from tensorcast.sdk.pages import PageData

    return PageData(key, dtype, tuple(shape), data, digest)


def _get_local(
    conn: PageConnection, wanted: Sequence[Wanted], dests: Sequence[torch.Tensor]
) -> list[PageData | None]:
    """Copy the pages a same-host worker holds into `dests` (host-to-device out of its pool),
    then check each against its hash from the pool region."""
    found = conn.get(list(wanted))
    host = pool_tensor(conn)
    hits = []
    for i, info in enumerate(found):
        if info is None:
            continue
        offset, size, _, _, _ = info
        dest = _fit(dests[i], size)
        if size:
            dest.copy_(host[offset : offset + size], non_blocking=True)
        hits.append((i, dest))
    _sync({dests[i].device for i, _ in hits})
    arena = conn.arena()
    hashes = native.hash_buffers([arena[found[i][0] : found[i][0] + found[i][1]] for i, _ in hits])  # type: ignore[index]
    out: list[PageData | None] = [None] * len(found)
    for (i, dest), digest in zip(hits, hashes):
        _, _, dtype, shape, expected = found[i]  # type: ignore[misc]
        if digest == expected:
            out[i] = _device_page(wanted[i][0], dtype, shape, dest, digest)
    return out
