"""What `tc put` reads from a path: one safetensors file, or a Hugging Face style model directory
(safetensors shards, optionally named by `model.safetensors.index.json`, plus small files such as
config.json and the tokenizer, kept as byte blobs of the artifact).

Everything is validated before any tensor byte is read; a bad directory raises InvalidArgument.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from tensorcast.errors import InvalidArgument
from tensorcast.safetensors_file import (
    FileFacts,
    SafetensorsHeader,
    duplicate_keys,
    facts_of,
    read_header,
)
from tensorcast.types import TENSOR_ALIGN_BYTES, TensorMeta, align_up

INDEX_FILE = "model.safetensors.index.json"
FILE_PREFIX = "__file__/"  # artifact tensors holding a directory's other files, as U8 bytes
MAX_BLOB_BYTES = 64 * 1024 * 1024
# Weights in other formats are not copied along (they would duplicate the safetensors).
SKIPPED_SUFFIXES = {".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx"}


def file_facts(path: Path) -> FileFacts:
    return facts_of(path, os.stat(path))


@dataclass(frozen=True)
class ModelFiles:
    headers: tuple[SafetensorsHeader, ...]
    blobs: tuple[Path, ...]
    blob_facts: tuple[FileFacts, ...]  # as scanned (their sizes are what is laid out)

    def facts(self) -> list[FileFacts]:
        """Every file as it was when scanned: the layout holds for exactly these files (a file
        changed since fails the read, and keys the put cache)."""
        return [h.facts for h in self.headers] + list(self.blob_facts)


@dataclass(frozen=True)
class Extent:
    """`length` bytes at `file_offset` of `path` land at `region_offset` of the content."""

    path: Path
    file_offset: int
    length: int
    region_offset: int


@dataclass(frozen=True)
class FileLayout:
    tensors: tuple[TensorMeta, ...]  # without hashes: nothing has been read yet
    size_bytes: int
    extents: tuple[Extent, ...]


def layout(files: ModelFiles) -> FileLayout:
    """The content a model directory becomes: the shards' data sections back to back, then the
    small files, each aligned; one extent per file."""
    metas: list[TensorMeta] = []
    extents: list[Extent] = []
    size = 0
    for h in files.headers:
        for t in h.tensors:
            metas.append(TensorMeta(t.name, t.dtype, t.shape, t.end - t.begin, size + t.begin))
        extents.append(Extent(h.path, h.data_offset, h.data_size, size))
        size = align_up(size + h.data_size, TENSOR_ALIGN_BYTES)
    for blob, facts in zip(files.blobs, files.blob_facts):
        length = facts[1]
        metas.append(TensorMeta(FILE_PREFIX + blob.name, "U8", (length,), length, size))
        extents.append(Extent(blob, 0, length, size))
        size = align_up(size + length, TENSOR_ALIGN_BYTES)
    return FileLayout(tuple(metas), size, tuple(extents))


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    dupes = duplicate_keys(pairs)
    if dupes:
        raise InvalidArgument(f"{INDEX_FILE} names tensors twice: {dupes[:5]}")
    return dict(pairs)


def scan(path: str | os.PathLike[str]) -> ModelFiles:
    path = Path(path)
    if path.is_file():
        return ModelFiles((read_header(path),), (), ())
    if not path.is_dir():
        raise InvalidArgument(f"{path}: no such file or directory")
    index_path = path / INDEX_FILE
    if index_path.exists():
        headers = _indexed(path, index_path)
    else:
        files = sorted(p for p in path.iterdir() if p.suffix == ".safetensors" and p.is_file())
        if not files:
            raise InvalidArgument(f"{path}: directory holds no .safetensors files")
        headers = [read_header(f) for f in files]
    seen: dict[str, str] = {}
    for h in headers:
        for t in h.tensors:
            if t.name in seen:
                raise InvalidArgument(
                    f"tensor {t.name!r} appears in both {seen[t.name]} and {h.path.name}"
                )
            seen[t.name] = h.path.name
    blobs, blob_facts = [], []
    for p in sorted(path.iterdir()):
        if not p.is_file() or p.name.startswith(".") or p.suffix == ".safetensors":
            continue
        if p.suffix in SKIPPED_SUFFIXES:
            continue
        try:
            facts = file_facts(p)
        except OSError as e:
            raise InvalidArgument(f"{p}: cannot read: {e.strerror or e}") from None
        if facts[1] > MAX_BLOB_BYTES:
            raise InvalidArgument(
                f"{p}: {facts[1]} bytes is too large to keep alongside the weights "
                f"(limit {MAX_BLOB_BYTES}); move it out of the directory"
            )
        blobs.append(p)
        blob_facts.append(facts)
    # A tensor named like a file's entry would make an artifact with one name twice.
    clash = sorted(FILE_PREFIX + p.name for p in blobs if FILE_PREFIX + p.name in seen)
    if clash:
        raise InvalidArgument(
            f"tensor {clash[0]!r} in {seen[clash[0]]} has the name the file "
            f"{clash[0][len(FILE_PREFIX) :]!r} is kept under: rename the tensor or move the file"
        )
    return ModelFiles(tuple(headers), tuple(blobs), tuple(blob_facts))


def _indexed(directory: Path, index_path: Path) -> list[SafetensorsHeader]:
    try:
        index = json.loads(index_path.read_text(), object_pairs_hook=_no_duplicates)
        weight_map = index["weight_map"]
        assert isinstance(weight_map, dict)
    except InvalidArgument:
        raise
    except OSError as e:  # e.g. a directory of that name
        raise InvalidArgument(f"{index_path}: cannot read: {e.strerror or e}") from None
    except (ValueError, KeyError, AssertionError, TypeError, RecursionError):
        raise InvalidArgument(
            f"{index_path}: not a valid index (needs a weight_map object)"
        ) from None
    by_file: dict[str, set[str]] = {}
    for tensor, file in weight_map.items():
        by_file.setdefault(str(file), set()).add(tensor)
    headers = []
    for file, tensors in sorted(by_file.items()):
        shard = directory / file
        if Path(file).name != file or not shard.is_file():
            raise InvalidArgument(f"{INDEX_FILE} names {file!r}, which is not in {directory}")
        header = read_header(shard)
        actual = {t.name for t in header.tensors}
        if actual != tensors:
            missing, extra = sorted(tensors - actual), sorted(actual - tensors)
            raise InvalidArgument(
                f"{file} does not match {INDEX_FILE}: index-only {missing[:5]}, "
                f"file-only {extra[:5]}"
            )
        headers.append(header)
    return headers
