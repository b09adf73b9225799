"""The native core through its Python face: hashing and parallel reads."""

from __future__ import annotations

import os

import pytest

from tensorcast.errors import InvalidArgument
from tensorcast.transport import native

CHUNK = native.TREE_HASH_CHUNK_BYTES


@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5])
def test_hash_is_independent_of_threads(size):
    data = os.urandom(size)
    digests = {native.hash_buffer(data, threads) for threads in (1, 2, 7)}
    assert len(digests) == 1
    assert len(digests.pop()) == 32


def test_hash_detects_a_flipped_bit_in_any_chunk():
    data = bytearray(os.urandom(2 * CHUNK + 100))
    original = native.hash_buffer(data)
    for position in (0, CHUNK - 1, CHUNK, 2 * CHUNK + 99):
        data[position] ^= 1
        assert native.hash_buffer(data) != original
        data[position] ^= 1
    assert native.hash_buffer(data) == original


def test_hash_buffers_equals_one_by_one():
    bufs = [os.urandom(n) for n in (0, 7, 4096, CHUNK + 3)] * 3
    assert native.hash_buffers(bufs) == [native.hash_buffer(b) for b in bufs]


def test_known_answer():
    # Pins the format (tree hash v1 over XXH3-128): stored content ids depend on it.
    assert native.hash_buffer(b"hello") == "1e143c32d23cf07083259d8c354d7881"


def test_read_file_into(tmp_path):
    data = os.urandom(3 * 1024 * 1024 + 17)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    dest = bytearray(len(data) + 10)
    native.read_file_into(path, 5, len(data) - 5, dest, 10, threads=2)
    assert bytes(dest[10 : 10 + len(data) - 5]) == data[5:]
    with pytest.raises(InvalidArgument, match="shorter"):
        native.read_file_into(path, 0, len(data) + 1, bytearray(len(data) + 1), 0)
