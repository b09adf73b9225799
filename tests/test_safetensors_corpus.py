"""Malformed safetensors files: every one rejected by `tc put` with the store unchanged."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from tensorcast.errors import InvalidArgument
from tensorcast.safetensors_file import encode_header, read_header


def _file(path, header: dict | bytes, data: bytes, declared_len: int | None = None):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    n = len(raw) if declared_len is None else declared_len
    path.write_bytes(struct.pack("<Q", n) + raw + data)
    return path


def _entry(dtype="F32", shape=(2,), begin=0, end=8):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


def _raw(path, data: bytes):
    path.write_bytes(data)
    return path


CORPUS = {
    "empty": lambda p: _raw(p, b""),
    "short_length_prefix": lambda p: _raw(p, b"\x01\x02"),
    "header_longer_than_file": lambda p: _file(p, {"a": _entry()}, b"\0" * 8, declared_len=10_000),
    "header_length_absurd": lambda p: _file(p, b"{}", b"", declared_len=1 << 40),
    "header_not_json": lambda p: _file(p, b"{not json", b""),
    "header_not_utf8": lambda p: _file(p, b"\xff\xfe\xfd", b""),
    "header_is_list": lambda p: _file(p, b"[1,2]", b""),
    "unknown_dtype": lambda p: _file(p, {"a": _entry(dtype="F7")}, b"\0" * 8),
    "negative_dim": lambda p: _file(p, {"a": _entry(shape=(-2,))}, b"\0" * 8),
    "float_dim": lambda p: _file(
        p, {"a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}, b"\0" * 8
    ),
    "size_mismatch": lambda p: _file(p, {"a": _entry(shape=(3,))}, b"\0" * 8),
    "offsets_reversed": lambda p: _file(p, {"a": _entry(begin=8, end=0)}, b"\0" * 8),
    "offsets_overlap": lambda p: _file(
        p, {"a": _entry(), "b": _entry(begin=4, end=12)}, b"\0" * 12
    ),
    "offsets_gap": lambda p: _file(p, {"a": _entry(), "b": _entry(begin=12, end=20)}, b"\0" * 20),
    "truncated_data": lambda p: _file(p, {"a": _entry(shape=(4,), end=16)}, b"\0" * 9),
    "trailing_bytes": lambda p: _file(p, {"a": _entry()}, b"\0" * 12),
    "duplicate_key": lambda p: _file(
        p,
        b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
        b'"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
        b"\0" * 8,
    ),
    "metadata_not_strings": lambda p: _file(
        p, {"__metadata__": {"k": 1}, "a": _entry()}, b"\0" * 8
    ),
    "missing_offsets": lambda p: _file(p, {"a": {"dtype": "F32", "shape": [2]}}, b"\0" * 8),
}


@pytest.mark.parametrize("case", sorted(CORPUS))
def test_parser_rejects(tmp_path, case):
    path = CORPUS[case](tmp_path / f"{case}.safetensors")
    with pytest.raises(InvalidArgument, match=r"safetensors|shorter|read"):
        read_header(path)


def test_parser_accepts_what_safetensors_writes(tmp_path):
    tensors = {"w": torch.randn(3, 4), "b": torch.zeros(0), "s": torch.tensor(1, dtype=torch.int8)}
    save_file(tensors, tmp_path / "ok.safetensors", metadata={"format": "pt"})
    header = read_header(tmp_path / "ok.safetensors")
    assert {t.name: t.shape for t in header.tensors} == {"w": (3, 4), "b": (0,), "s": ()}
    assert header.metadata == {"format": "pt"}


def test_encode_header_round_trips(tmp_path):
    entries = [("x", "F16", (2, 3), 12), ("y", "I64", (), 8)]
    raw = encode_header(entries, {"k": "v"})
    (tmp_path / "e.safetensors").write_bytes(raw + b"\0" * 20)
    header = read_header(tmp_path / "e.safetensors")
    assert header.data_offset % 8 == 0
    assert [(t.name, t.dtype, t.shape, t.end - t.begin) for t in header.tensors] == entries


def test_tc_put_rejects_corpus_and_changes_nothing(cluster, rt, tmp_path):
    from conftest import pool_used

    save_file({"ok": torch.ones(4)}, tmp_path / "good.safetensors")
    cluster.tc("put", "corpus-good", str(tmp_path / "good.safetensors"), check=True)
    before_ls = cluster.tc("ls", "--json", check=True).stdout
    before_used = pool_used(rt)
    for case, make in sorted(CORPUS.items()):
        path = make(tmp_path / f"{case}.safetensors")
        proc = cluster.tc("put", f"corpus-{case}", str(path))
        assert proc.returncode == InvalidArgument.exit_code, (case, proc.stderr)
        assert "error:" in proc.stderr and path.name in proc.stderr, (case, proc.stderr)
    # A directory mixing a good file with a bad one stores nothing either.
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    save_file({"x": torch.ones(2)}, mixed / "a.safetensors")
    CORPUS["truncated_data"](mixed / "b.safetensors")
    assert cluster.tc("put", "corpus-mixed", str(mixed)).returncode == InvalidArgument.exit_code
    # The same tensor name in two files of one directory is ambiguous.
    twice = tmp_path / "twice"
    twice.mkdir()
    save_file({"x": torch.ones(2)}, twice / "a.safetensors")
    save_file({"x": torch.zeros(2)}, twice / "b.safetensors")
    proc = cluster.tc("put", "corpus-twice", str(twice))
    assert proc.returncode == InvalidArgument.exit_code and "appears in both" in proc.stderr
    assert cluster.tc("ls", "--json", check=True).stdout == before_ls
    assert pool_used(rt) == before_used
