"""Contents registered by reference (`tc put --by-reference`): the bytes stay in the caller's
files until the first read, which copies only the tensors' byte ranges into the pool (the cold
path); the pool copy then serves every later read (the warm path) and may be evicted, since the
files can always be read again.

A reference remembers each file's (size, mtime, inode) at registration; a file changed since is
refused (`IntegrityError`), never read as the registered content. The first read's tensor hashes
become the content's hashes; later reads of the same files must match them.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tensorcast.errors import IntegrityError, InvalidArgument, NotFound
from tensorcast.identity import reference_id
from tensorcast.model_dir import FileLayout, layout, scan
from tensorcast.transport import native
from tensorcast.types import TensorMeta

FileFacts = tuple[str, int, int, int]  # path, size, mtime_ns, inode


def file_facts(path: Path) -> FileFacts:
    st = os.stat(path)
    return (str(path), st.st_size, st.st_mtime_ns, st.st_ino)


@dataclass(frozen=True)
class FileReference:
    content_id: str
    layout: FileLayout
    facts: tuple[FileFacts, ...]
    hashes: tuple[str, ...] = ()  # known after the first read

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


def describe(path: str | os.PathLike[str]) -> FileReference:
    """Validate a file or model directory and describe it, reading headers only."""
    try:
        files = scan(Path(path).resolve())
        plan = layout(files)
        facts = tuple(file_facts(p) for p in dict.fromkeys(e.path for e in plan.extents))
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

    def read_into(self, ref: FileReference, dest: memoryview, dest_offset: int) -> None:
        """Copy the referenced bytes into `dest` (parallel positional reads per file)."""
        _check_unchanged(ref)
        for e in ref.layout.extents:
            native.read_file_into(
                e.path, e.file_offset, e.length, dest, dest_offset + e.region_offset
            )
        with self._lock:
            self.bytes_read_total += sum(e.length for e in ref.layout.extents)

    def copy_view(
        self, ref: FileReference, slices: dict, target: memoryview, targets: list[TensorMeta]
    ) -> None:
        """Cut a view straight from the files (a TP rank reads only its shard's pages): each
        file is mapped read-only and only the sliced elements are touched."""
        from tensorcast.worker.slicing import copy_slices

        _check_unchanged(ref)
        by_name = dict(zip((t.name for t in ref.layout.tensors), targets))
        for e in ref.layout.extents:
            inside = [
                t
                for t in ref.layout.tensors
                if t.size_bytes and e.region_offset <= t.offset_bytes < e.region_offset + e.length
            ]
            if not inside:
                continue
            in_file = tuple(
                replace(t, offset_bytes=e.file_offset + t.offset_bytes - e.region_offset)
                for t in inside
            )
            with open(e.path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
                view = memoryview(mm)
                try:
                    copy_slices(view, in_file, target, [by_name[t.name] for t in inside], slices)
                finally:
                    view.release()
        with self._lock:
            self.bytes_read_total += sum(t.size_bytes for t in targets)

    def learned(self, content_id: str, tensors: tuple[TensorMeta, ...]) -> None:
        """Record the hashes of the first read."""
        with self._lock:
            ref = self._refs.get(content_id)
            if ref is not None and not ref.hashes:
                by_name = {t.name: t.hash_hex for t in tensors}
                hashes = tuple(by_name[t.name] for t in ref.layout.tensors)
                self._refs[content_id] = replace(ref, hashes=hashes)
