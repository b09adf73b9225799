"""Producing a content's bytes (fillers: tensors or files) and streaming them to a worker on
another host. Which worker, and how a batch is named, is `sdk/batch.py`'s.

Other hosts: fill a local buffer, then stream it with per-chunk checksums and per-tensor hash
claims that the worker verifies. Any failure aborts the write: nothing is half-written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tensorcast.config import STREAM_CHUNK_BYTES
from tensorcast.model_dir import ModelFiles, layout
from tensorcast.transport import native
from tensorcast.types import Committed, TensorMeta

if TYPE_CHECKING:
    from tensorcast.sdk.runtime import Progress

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


def write_remote(runtime, worker, metas, size_bytes, fill, progress) -> Committed:
    """Stream a content to a worker on another host; it verifies and registers it."""
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
