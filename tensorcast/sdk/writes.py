"""Writing new content into the pool: choose a worker, fill a region, commit.

Same host: reserve a region over the local socket, map it, fill it in place (memcpy or parallel
file reads), commit. Other hosts: fill a local buffer, then stream it with per-chunk checksums and
per-tensor hash claims that the worker verifies. Any failure aborts the reservation: nothing is
half-written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tensorcast.config import STREAM_CHUNK_BYTES
from tensorcast.errors import ResourceExhausted
from tensorcast.model_dir import ModelFiles, layout
from tensorcast.transport import native
from tensorcast.types import Committed, TensorMeta

if TYPE_CHECKING:
    from tensorcast.sdk.runtime import Progress, Runtime

# fill(dest, base_offset, progress): write the content's bytes into dest[base_offset:].
Filler = Callable[[Any, int, "Progress | None"], None]
FILE_READ_STEP_BYTES = 256 * 1024 * 1024


def buffer_filler(metas: list[TensorMeta], sources: Sequence[Any]) -> Filler:
    def fill(dest: Any, base: int, progress: Progress | None) -> None:
        for meta, source in zip(metas, sources):
            if meta.size_bytes:
                native.copy_into(dest, base + meta.offset_bytes, source)
            if progress:
                progress(meta.size_bytes)

    return fill


def plan_files(files: ModelFiles) -> tuple[list[TensorMeta], int, Filler]:
    """Lay the files out as one content (`model_dir.layout`) and read them into a region."""
    plan = layout(files)

    def fill(dest: Any, base: int, progress: Progress | None) -> None:
        for e in plan.extents:
            for start in range(0, e.length, FILE_READ_STEP_BYTES):
                step = min(FILE_READ_STEP_BYTES, e.length - start)
                native.read_file_into(
                    e.path, e.file_offset + start, step, dest, base + e.region_offset + start
                )
                if progress:
                    progress(step)

    return list(plan.tensors), plan.size_bytes, fill


def write_content(
    runtime: Runtime,
    metas: list[TensorMeta],
    size_bytes: int,
    fill: Filler,
    progress: Progress | None,
    worker_name: str | None = None,
) -> Committed:
    last_error: Exception | None = None
    for worker in runtime.write_targets(worker_name):
        try:
            if runtime.is_local(worker):
                return _write_local(runtime, worker, metas, size_bytes, fill, progress)
            return _write_remote(runtime, worker, metas, size_bytes, fill, progress)
        except ResourceExhausted as e:
            last_error = e  # this worker is full: try the next one
    assert last_error is not None
    raise last_error


def _write_local(runtime, worker, metas, size_bytes, fill, progress) -> Committed:
    conn = runtime.local_connection(worker)
    res = conn.request({"op": "reserve", "size_bytes": size_bytes})
    try:
        mm, base = conn.map(res["offset"], size_bytes, writable=True)
        try:
            fill(mm, base, progress)
        finally:
            mm.close()
        reply = conn.request(
            {
                "op": "commit",
                "verify": all(t.hash_hex for t in metas),
                "reservation_id": res["reservation_id"],
                "tensors": [t.to_json() for t in metas],
            }
        )
    except BaseException:
        try:
            conn.request({"op": "abort", "reservation_id": res["reservation_id"]})
        except Exception:
            pass  # the connection is gone: the worker aborted it already
        raise
    return Committed(
        reply["content_id"],
        reply["size_bytes"],
        tuple(TensorMeta.from_json(t) for t in reply["tensors"]),
        reply["deduplicated"],
    )


def _write_remote(runtime, worker, metas, size_bytes, fill, progress) -> Committed:
    from tensorcast.rpc.convert import tensors_from_pb

    staging = bytearray(size_bytes)
    fill(staging, 0, progress)
    view = memoryview(staging)
    hashes = native.hash_buffers(
        [view[t.offset_bytes : t.offset_bytes + t.size_bytes] for t in metas]
    )
    claimed = [
        TensorMeta(t.name, t.dtype, t.shape, t.size_bytes, t.offset_bytes, h)
        for t, h in zip(metas, hashes)
    ]
    chunks = (
        (start, bytes(view[start : start + STREAM_CHUNK_BYTES]))
        for start in range(0, size_bytes, STREAM_CHUNK_BYTES)
    )
    reply = runtime.stream_write(worker, claimed, size_bytes, chunks)
    return Committed(
        reply.content_id, reply.size_bytes, tensors_from_pb(reply.tensors), reply.deduplicated
    )
