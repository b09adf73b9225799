"""Producing a content's bytes (fillers: tensors or files) and streaming them to a worker on
another host. Which worker, and how a batch is named, is `sdk/batch.py`'s.

Other hosts: fill a local buffer, then stream it with per-chunk checksums and per-tensor hash
claims that the worker verifies. Any failure aborts the write: nothing is half-written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensorcast.config import STREAM_CHUNK_BYTES
from tensorcast.errors import IntegrityError, NotFound
from tensorcast.model_dir import FileFacts, ModelFiles, file_facts, layout
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
    """Lay the files out as one content (`model_dir.layout`) and read them into a region.
    Files replaced or rewritten since they were scanned (size, mtime or inode changed), before
    or while they are read, fail the fill: their bytes no longer match the scanned layout."""
    plan = layout(files)
    scanned = files.facts()  # as the headers were read: a file replaced since fails the fill

    def fill(dest: Any, base: int, progress: Progress | None) -> None:
        _check_unchanged(scanned)
        for e in plan.extents:
            for start in range(0, e.length, FILE_READ_STEP_BYTES):
                step = min(FILE_READ_STEP_BYTES, e.length - start)
                native.read_file_into(
                    e.path, e.file_offset + start, step, dest, base + e.region_offset + start
                )
                if progress:
                    progress(step)
        _check_unchanged(scanned)

    return list(plan.tensors), plan.size_bytes, fill


def _facts(paths: Sequence[Path]) -> list[FileFacts]:
    out = []
    for path in paths:
        try:
            out.append(file_facts(path))
        except FileNotFoundError:
            raise NotFound(f"{path} is gone (removed since it was scanned)") from None
    return out


def _check_unchanged(scanned: list[FileFacts]) -> None:
    now = _facts([Path(f[0]) for f in scanned])
    for before, after in zip(scanned, now):
        if before != after:
            raise IntegrityError(
                f"{before[0]} changed while it was being put (size, mtime or inode differ): "
                "nothing was stored; put it again once it is written"
            )


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
