"""The disk tier's failures, in process: a worker node over a small pool and a disk directory,
its Global Store unreachable (the failures must not need it)."""

from __future__ import annotations

import errno
import os

import pytest

from tensorcast.errors import NotFound, ResourceExhausted
from tensorcast.transport import native
from tensorcast.types import TensorMeta
from tensorcast.worker.disk_tier import DiskTier
from tensorcast.worker.node import WorkerNode
from tensorcast.worker.pool import Pool

DATA = bytes(range(256)) * 16
META = TensorMeta("w", "U8", (len(DATA),), len(DATA), 0, native.hash_buffer(DATA))


def test_a_corrupt_spill_file_is_deleted_and_the_content_is_missing_here(tmp_path):
    node = WorkerNode(
        Pool(1 << 20), "127.0.0.1:1", "secret", "w", (), rpc_timeout_s=2.0, disk=DiskTier(tmp_path)
    )
    bad = bytearray(DATA)
    bad[100] ^= 0xFF
    node.disk.save("c-spilled", (META,), memoryview(bytes(bad)))  # type: ignore[union-attr]
    # NotFound, not IntegrityError: a prefetch here pulls it from a peer instead.
    with pytest.raises(NotFound):
        node.load("c-spilled")
    assert node.disk.content_ids() == []  # type: ignore[union-attr]
    assert node.pool.stats().num_contents == 0 and node.pool.stats().used_bytes == 0


def test_a_spilled_content_loads_back_while_the_store_is_out_of_reach(tmp_path):
    node = WorkerNode(
        Pool(1 << 20), "127.0.0.1:1", "secret", "w", (), rpc_timeout_s=2.0, disk=DiskTier(tmp_path)
    )
    node.disk.save("c-spilled", (META,), memoryview(DATA))  # type: ignore[union-attr]
    node.load("c-spilled")  # the heartbeats tell the store of the move later
    content = node.pool.get("c-spilled")
    assert bytes(node.pool.view[content.offset : content.offset + len(DATA)]) == DATA
    assert node.disk.content_ids() == []  # type: ignore[union-attr]


def test_a_full_disk_is_resource_exhausted_and_leaves_no_partial_file(tmp_path, monkeypatch):
    disk = DiskTier(tmp_path)

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(ResourceExhausted, match="full"):
        disk.save("c-spilled", (META,), memoryview(DATA))
    assert list(tmp_path.iterdir()) == []
