"""Transfers' own bookkeeping (tickets, per-content prefetch gates), in process: a real data
server over a small pool, and a stand-in node that holds whatever content it is asked for. And
the worker node's commit of a pulled replica while the Global Store is unreachable."""

from __future__ import annotations

import mmap
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import wait_until

from tensorcast.config import send_token
from tensorcast.transport import native
from tensorcast.types import TensorMeta
from tensorcast.worker.node import WorkerNode
from tensorcast.worker.pool import Content, Pool
from tensorcast.worker.transfers import Transfers

POOL_BYTES = 1 << 20


class _Node:
    """What Transfers asks of a WorkerNode for tickets and already-present prefetches."""

    name = "stand-in"
    worker_id = "w-stand-in"

    def __init__(self) -> None:
        self.released: list[str] = []
        self.loading = threading.Event()  # set: load() blocks until `proceed` is set
        self.proceed = threading.Event()

    def load_and_hold(self, content_id: str) -> Content:
        return Content(content_id, 0, 4096, (), time.time(), holds=1)

    def load(self, content_id: str) -> Content:
        if self.loading.is_set():
            self.proceed.wait(30)
        return self.load_and_hold(content_id)

    @property
    def pool(self) -> Any:
        node = self

        class _Pool:
            def release(self, content: Content) -> None:
                node.released.append(content.content_id)

        return _Pool()


@pytest.fixture
def transfers() -> Iterator[Transfers]:
    memory = mmap.mmap(-1, POOL_BYTES)
    server = native.data_server("127.0.0.1", memory, send_token("secret"))
    try:
        yield Transfers(_Node(), server)  # type: ignore[arg-type]
    finally:
        server.stop()


def test_a_ticket_lasts_as_long_as_its_puller_asks(transfers: Transfers) -> None:
    # A transfer longer than 20 minutes used to lose its ticket at 20 minutes, from every source.
    ttl_ms = 90 * 60 * 1000
    opened = transfers.open("c1", ttl_ms)
    left_s = transfers._tickets[opened.ticket].expires_at - time.monotonic()
    assert left_s > 89 * 60
    transfers.expire()
    assert opened.ticket in transfers._tickets


def test_prefetch_gates_are_removed_when_the_last_caller_leaves(transfers: Transfers) -> None:
    for i in range(50):
        assert transfers.prefetch(f"c{i}", timeout_s=5, streams=1).already_present
    assert transfers._inflight == {}

    # Callers of the same content share one gate while any of them is in it.
    node: _Node = transfers.node  # type: ignore[assignment]
    node.loading.set()
    callers = [
        threading.Thread(target=transfers.prefetch, args=("shared", 30, 1)) for _ in range(3)
    ]
    for t in callers:
        t.start()
    wait_until(
        lambda: "shared" in transfers._inflight and transfers._inflight["shared"].users == 3,
        timeout_s=10,
    )
    node.proceed.set()
    for t in callers:
        t.join(30)
    assert transfers._inflight == {}


def test_a_verified_replica_outlives_a_store_outage_at_commit() -> None:
    # Nothing listens on port 1: every store call fails as during an outage.
    node = WorkerNode(Pool(POOL_BYTES), "127.0.0.1:1", "secret", "w", (), rpc_timeout_s=2.0)
    data = bytes(range(256)) * 16
    res = node.reserve(len(data))
    node.pool.view[res.offset : res.offset + len(data)] = data
    meta = TensorMeta("w", "U8", (len(data),), len(data), 0, native.hash_buffer(data))
    committed = node.commit(
        res.reservation_id, [meta], verify_hashes=True, replica=True, content_id="c-pulled"
    )
    # Kept, for the next heartbeat to report, instead of dropped and pulled again.
    assert node.pool.stats().content_ids == [committed.content_id]
