"""The safetensors file format: a strict header parser and a streaming writer.

Stricter than "can it be parsed": every tensor's byte range must match its dtype and shape, the
ranges must tile the data section exactly, and the file must be as long as the header claims.
A malformed file raises `InvalidArgument` naming the file and the problem, before any byte of
tensor data is read.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tensorcast.errors import InvalidArgument
from tensorcast.types import DTYPE_ITEMSIZE, tensor_nbytes

# safetensors' own limit on the JSON header.
MAX_HEADER_BYTES = 100 * 1024 * 1024
METADATA_KEY = "__metadata__"


@dataclass(frozen=True)
class FileTensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # relative to the data section
    end: int


# What tells a file replaced or rewritten since it was read: path, size, mtime_ns, inode.
FileFacts = tuple[str, int, int, int]


def facts_of(path: Path, st: os.stat_result) -> FileFacts:
    return (str(path), st.st_size, st.st_mtime_ns, st.st_ino)


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    data_offset: int  # where the data section starts in the file
    data_size: int
    tensors: tuple[FileTensor, ...]  # in data-section order
    metadata: dict[str, str]
    # The file the header was read from, as it was then (taken from the open handle): a file
    # replaced afterwards is told apart by these, never read with this header's offsets.
    facts: FileFacts


def duplicate_keys(pairs: list[tuple[str, object]]) -> list[str]:
    """Keys named more than once, sorted (linear: an index may name 100,000 tensors)."""
    seen: set[str] = set()
    dupes: set[str] = set()
    for key, _ in pairs:
        (dupes if key in seen else seen).add(key)
    return sorted(dupes)


def _reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict:
    dupes = duplicate_keys(pairs)
    if dupes:
        raise ValueError(f"duplicate keys in header: {dupes[:5]}")
    return dict(pairs)


def read_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    path = Path(path)

    def bad(problem: str) -> InvalidArgument:
        return InvalidArgument(f"{path}: not a valid safetensors file: {problem}")

    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            file_size = st.st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise bad(f"file is {file_size} bytes, shorter than the 8-byte header length")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise bad(f"header length {header_len} exceeds the {MAX_HEADER_BYTES} byte limit")
            if 8 + header_len > file_size:
                raise bad(
                    f"header claims {header_len} bytes but the file has only {file_size - 8} "
                    "after the length (truncated?)"
                )
            raw = f.read(header_len)
    except OSError as e:
        raise InvalidArgument(f"{path}: cannot read: {e.strerror}") from None
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as e:
        raise bad(f"header is not valid JSON: {e}") from None
    except RecursionError:  # nested deeper than the parser's stack: no header is
        raise bad("header nests too deeply") from None
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")

    metadata = header.pop(METADATA_KEY, None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise bad("__metadata__ must map strings to strings")

    data_offset = 8 + header_len
    data_size = file_size - data_offset
    tensors = [_parse_entry(name, entry, bad) for name, entry in header.items()]
    tensors.sort(key=lambda t: (t.begin, t.end))
    position = 0
    for t in tensors:
        if t.begin != position:
            kind = "overlaps the previous tensor" if t.begin < position else "leaves a gap"
            raise bad(f"tensor {t.name!r} at byte {t.begin} {kind} (expected {position})")
        position = t.end
    if position > data_size:
        raise bad(f"tensors need {position} data bytes but the file has {data_size} (truncated?)")
    if position < data_size:
        raise bad(f"{data_size - position} trailing bytes after the last tensor")
    return SafetensorsHeader(
        path, data_offset, data_size, tuple(tensors), metadata, facts_of(path, st)
    )


def _parse_entry(name: str, entry: object, bad) -> FileTensor:
    if not isinstance(entry, dict):
        raise bad(f"entry {name!r} is not an object")
    dtype = entry.get("dtype")
    shape = entry.get("shape")
    offsets = entry.get("data_offsets")
    if dtype not in DTYPE_ITEMSIZE:
        raise bad(f"tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise bad(f"tensor {name!r} has a bad shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise bad(f"tensor {name!r} has bad data_offsets {offsets!r}")
    begin, end = offsets
    expected = tensor_nbytes(dtype, tuple(shape))
    if end - begin != expected:
        raise bad(
            f"tensor {name!r} ({dtype}, shape {shape}) needs {expected} bytes "
            f"but its data_offsets span {end - begin}"
        )
    return FileTensor(name, dtype, tuple(shape), begin, end)


def encode_header(
    entries: Iterable[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str] | None = None
) -> bytes:
    """Header bytes (length prefix included) for tensors written back to back in this order.

    `entries` are (name, dtype, shape, size_bytes). Padded with spaces to 8-byte alignment, as
    safetensors does, so the data section is aligned.
    """
    header: dict[str, object] = {}
    if metadata:
        header[METADATA_KEY] = metadata
    position = 0
    for name, dtype, shape, size_bytes in entries:
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [position, position + size_bytes],
        }
        position += size_bytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw
