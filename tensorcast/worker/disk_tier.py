"""The worker's optional disk tier (`--disk DIR`): where the last copy of a content goes when the
pool is full, instead of being dropped. One file per content: a JSON line with its layout, then
its bytes; written to a temporary name, fsynced and renamed, so a crash leaves no partial file."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
from pathlib import Path

from tensorcast.errors import NotFound, ResourceExhausted
from tensorcast.transport import native
from tensorcast.types import TensorMeta

SUFFIX = ".tcd"


class DiskTier:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob("*.tmp"):
            stale.unlink()

    def _path(self, content_id: str) -> Path:
        return self.directory / f"{content_id}{SUFFIX}"

    def save(self, content_id: str, tensors: tuple[TensorMeta, ...], data: memoryview) -> None:
        header = json.dumps({"size_bytes": len(data), "tensors": [t.to_json() for t in tensors]})
        # A name of its own: two threads spilling one content (a spill and a persist) each
        # write a whole file and the second rename wins, instead of sharing one temporary.
        tmp = self.directory / f"{content_id}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(header.encode() + b"\n")
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path(content_id))
        except OSError as e:
            tmp.unlink(missing_ok=True)  # a partial file would only take more of the disk
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise ResourceExhausted(
                    f"disk tier {self.directory} is full ({e.strerror}): free space there or "
                    "give the worker more memory"
                ) from None
            raise

    def layout(self, content_id: str) -> tuple[int, int, tuple[TensorMeta, ...]]:
        """(data offset in the file, size, tensors) of a spilled content."""
        try:
            with open(self._path(content_id), "rb") as f:
                line = f.readline()
        except FileNotFoundError:
            raise NotFound(f"content {content_id} is not on this worker's disk tier") from None
        header = json.loads(line)
        tensors = tuple(TensorMeta.from_json(t) for t in header["tensors"])
        return len(line), header["size_bytes"], tensors

    def read_into(self, content_id: str, dest: memoryview, dest_offset: int) -> None:
        data_offset, size, _ = self.layout(content_id)
        native.read_file_into(self._path(content_id), data_offset, size, dest, dest_offset)

    def delete(self, content_id: str) -> None:
        self._path(content_id).unlink(missing_ok=True)

    def used_bytes(self) -> int:
        total = 0
        for path in self.directory.glob(f"*{SUFFIX}"):
            # A load back into memory deletes its file: it may go between glob and stat.
            with contextlib.suppress(FileNotFoundError):
                total += path.stat().st_size
        return total

    def content_ids(self) -> list[str]:
        return sorted(p.name[: -len(SUFFIX)] for p in self.directory.glob(f"*{SUFFIX}"))
