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


def test_a_planned_stop_saves_what_fits_when_the_disk_fills(tmp_path, monkeypatch):
    node = WorkerNode(
        Pool(1 << 20), "127.0.0.1:1", "secret", "w", (), rpc_timeout_s=2.0, disk=DiskTier(tmp_path)
    )
    for content_id, fill in (("c-big", 1), ("c-small", 2)):
        data = bytes([fill]) * (64 << 10 if content_id == "c-big" else 4 << 10)
        res = node.reserve(len(data))
        node.pool.view[res.offset : res.offset + len(data)] = data
        meta = TensorMeta("w", "U8", (len(data),), len(data), 0, native.hash_buffer(data))
        node.commit(
            res.reservation_id, [meta], verify_hashes=True, replica=True, content_id=content_id
        )
    save = node.disk.save  # type: ignore[union-attr]

    def no_room_for_big(content_id, tensors, region):
        if region.nbytes > 32 << 10:
            raise ResourceExhausted("disk tier is full")
        return save(content_id, tensors, region)

    monkeypatch.setattr(node.disk, "save", no_room_for_big)
    assert node.persist() == 1  # the big one did not fit; the small one was still saved
    assert node.disk.content_ids() == ["c-small"]  # type: ignore[union-attr]


def test_a_spill_the_disk_has_no_room_for_keeps_the_content_and_lets_eviction_go_on(
    tmp_path, monkeypatch
):
    node = WorkerNode(
        Pool(1 << 20), "127.0.0.1:1", "secret", "w", (), rpc_timeout_s=2.0, disk=DiskTier(tmp_path)
    )
    res = node.reserve(len(DATA))
    node.pool.view[res.offset : res.offset + len(DATA)] = DATA
    node.commit(res.reservation_id, [META], verify_hashes=True, replica=True, content_id="c-1")

    def full(*args):
        raise ResourceExhausted("disk tier is full")

    monkeypatch.setattr(node.disk, "save", full)
    assert node._spill("c-1") is False  # reserve() moves on to its next candidate
    assert node.pool.stats().content_ids == ["c-1"]


def test_a_full_disk_is_resource_exhausted_and_leaves_no_partial_file(tmp_path, monkeypatch):
    disk = DiskTier(tmp_path)

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(ResourceExhausted, match="full"):
        disk.save("c-spilled", (META,), memoryview(DATA))
    assert list(tmp_path.iterdir()) == []
