"""Contents registered by reference (`tc put --by-reference`): the bytes stay in the caller's
files until the first read, which copies only the tensors' byte ranges into the pool (the cold
path); the pool copy then serves every later read (the warm path) and may be evicted, since the
files can always be read again.

A reference remembers each file's (size, mtime, inode) at registration; a file changed since is
refused (`IntegrityError`), never read as the registered content. The first read's tensor hashes
become the content's hashes; later reads of the same files must match them.
"""

from __future__ import annotations

import json
import mmap
import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tensorcast.errors import IntegrityError, InvalidArgument, NotFound
from tensorcast.identity import reference_id
from tensorcast.model_dir import Extent, FileFacts, FileLayout, file_facts, layout, scan
from tensorcast.transport import native
from tensorcast.types import TensorMeta


@dataclass(frozen=True)
class FileReference:
    content_id: str
    layout: FileLayout
    facts: tuple[FileFacts, ...]
    hashes: tuple[str, ...] = ()  # known after the first read

    def to_json(self) -> str:
        """What the Global Store keeps so a worker of this host can serve it after a restart."""
        return json.dumps(
            {
                "content_id": self.content_id,
                "size_bytes": self.layout.size_bytes,
                "tensors": [t.to_json() for t in self.layout.tensors],
                "extents": [
                    [str(e.path), e.file_offset, e.length, e.region_offset]
                    for e in self.layout.extents
                ],
                "facts": [list(f) for f in self.facts],
            }
        )

    @classmethod
    def from_json(cls, text: str) -> FileReference:
        d = json.loads(text)
        layout = FileLayout(
            tuple(TensorMeta.from_json(t) for t in d["tensors"]),
            int(d["size_bytes"]),
            tuple(Extent(Path(p), int(a), int(n), int(r)) for p, a, n, r in d["extents"]),
        )
        facts = tuple((str(p), int(s), int(m), int(i)) for p, s, m, i in d["facts"])
        return cls(str(d["content_id"]), layout, facts)

    def unchanged(self) -> bool:
        try:
            _check_unchanged(self)
        except (NotFound, IntegrityError):
            return False
        return True

    @property
    def tensors(self) -> tuple[TensorMeta, ...]:
        if not self.hashes:
            return self.layout.tensors
        return tuple(replace(t, hash_hex=h) for t, h in zip(self.layout.tensors, self.hashes))


def _check_unchanged(ref: FileReference) -> None:
    for recorded in ref.facts:
        try:
            now = file_facts(Path(recorded[0]))
        except FileNotFoundError:
            raise NotFound(
                f"{recorded[0]} was registered by reference and is gone; put it again"
            ) from None
        if now != recorded:
            raise IntegrityError(
                f"{recorded[0]} changed since it was registered by reference (size, mtime "
                "or inode differ); put it again"
            )


def _selected_span(meta: TensorMeta, dims: list) -> tuple[int, int]:
    """[begin, end) bytes of a row-major tensor that hold every element a slice selects."""
    from tensorcast.types import DTYPE_ITEMSIZE

    itemsize = DTYPE_ITEMSIZE[meta.dtype]
    strides, step = [], itemsize
    for size in reversed(meta.shape):
        strides.append(step)
        step *= size
    strides.reverse()
    first = last = 0
    for i, stride in enumerate(strides):
        if i < len(dims):
            d = dims[i]
            count = len(range(d.start, d.stop, d.step))
            first += d.start * stride
            last += (d.start + (count - 1) * d.step) * stride
        else:
            last += (meta.shape[i] - 1) * stride
    return first, last + itemsize


def _extent_of(ref: FileReference, t: TensorMeta) -> Extent:
    return next(
        e
        for e in ref.layout.extents
        if e.region_offset <= t.offset_bytes < e.region_offset + e.length
    )


def describe(path: str | os.PathLike[str]) -> FileReference:
    """Validate a file or model directory and describe it, reading headers only."""
    try:
        files = scan(Path(path).resolve())
        plan = layout(files)
        facts = tuple(files.facts())  # as read: a file replaced since is refused on read
    except OSError as e:
        raise InvalidArgument(f"{path}: {e.strerror or e}") from None
    return FileReference(reference_id(plan.tensors, facts), plan, facts)


class FileReferences:
    def __init__(self) -> None:
        self._refs: dict[str, FileReference] = {}
        self._added_at: dict[str, float] = {}
        self._lock = threading.Lock()
        self.bytes_read_total = 0

    def add(self, ref: FileReference) -> None:
        with self._lock:
            self._refs.setdefault(ref.content_id, ref)
            self._added_at[ref.content_id] = time.time()

    def get(self, content_id: str) -> FileReference | None:
        with self._lock:
            return self._refs.get(content_id)

    def remove(self, content_id: str, unless_added_after: float = float("inf")) -> bool:
        """Forget a reference, unless it was (re)registered after `unless_added_after`."""
        with self._lock:
            if self._added_at.get(content_id, 0.0) > unless_added_after:
                return False
            self._added_at.pop(content_id, None)
            return self._refs.pop(content_id, None) is not None

    def content_ids(self) -> list[str]:
        with self._lock:
            return sorted(self._refs)

    def read(self, ref: FileReference, dest: memoryview, dest_offset: int) -> list[str]:
        """Read every tensor of `ref` into `dest[dest_offset:]` (all files in one parallel pass)
        and return their hashes, each chunk hashed by the thread that read it. Refuses files
        changed before or while they were read."""
        _check_unchanged(ref)
        files = list(dict.fromkeys(e.path for e in ref.layout.extents))
        file_index = {path: i for i, path in enumerate(files)}
        spans = []
        for t in ref.layout.tensors:
            if t.size_bytes == 0:  # in no extent; hashes as empty
                spans.append((0, 0, 0, dest_offset + t.offset_bytes))
                continue
            e = _extent_of(ref, t)
            file_offset = e.file_offset + t.offset_bytes - e.region_offset
            spans.append(
                (file_index[e.path], file_offset, t.size_bytes, dest_offset + t.offset_bytes)
            )
        hashes = native.read_files(files, spans, dest, hash=True)
        assert hashes is not None
        _check_unchanged(ref)  # rewritten in place while we read: refuse, commit nothing
        self._count(sum(t.size_bytes for t in ref.layout.tensors))
        return hashes

    def copy_view(
        self, ref: FileReference, slices: dict, target: memoryview, targets: list[TensorMeta]
    ) -> None:
        """Cut a view straight from the files (a TP rank reads only its shard): per tensor,
        only the byte span from its first to its last selected element is read (positional
        reads, so a file truncated meanwhile is a clean error, not a crash), then sliced."""
        from tensorcast.worker.slicing import copy_slices

        _check_unchanged(ref)
        for source, dest in zip(ref.layout.tensors, targets):
            if dest.size_bytes == 0:
                continue
            begin, end = _selected_span(source, slices.get(source.name, []))
            extent = _extent_of(ref, source)
            # Anonymous memory: only the pages of the span read are ever touched.
            with mmap.mmap(-1, source.size_bytes) as scratch:
                native.read_file_into(
                    extent.path,
                    extent.file_offset + source.offset_bytes - extent.region_offset + begin,
                    end - begin,
                    scratch,
                    begin,
                )
                view = memoryview(scratch)
                try:
                    local = replace(source, offset_bytes=0)
                    copy_slices(view, (local,), target, [dest], slices)
                finally:
                    view.release()
            self._count(end - begin)
        _check_unchanged(ref)  # rewritten in place while we read: refuse, commit nothing

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_read_total += nbytes

    def learned(self, content_id: str, tensors: tuple[TensorMeta, ...]) -> None:
        """Record the hashes of the first read."""
        with self._lock:
            ref = self._refs.get(content_id)
            if ref is not None and not ref.hashes:
                by_name = {t.name: t.hash_hex for t in tensors}
                hashes = tuple(by_name[t.name] for t in ref.layout.tensors)
                self._refs[content_id] = replace(ref, hashes=hashes)
