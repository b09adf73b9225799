"""`tc top`: pilot tests against a real cluster, snapshot tests of the main screens."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import torch

import tensorcast as tc
from tensorcast.tui.snapshot import ClusterSnapshot, RateHistory
from tensorcast.tui.top import SdkSource, TopApp
from tensorcast.types import (
    ArtifactInfo,
    InstanceInfo,
    PlanRecord,
    ReplicaInfo,
    ShardLease,
    ShardTable,
    TensorMeta,
    WorkerInfo,
)


async def _until(pilot, predicate, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if predicate():
            return
        await pilot.pause(0.05)
    raise AssertionError("condition not met in the TUI")


def _rows(app: TopApp, view: str) -> list[list[str]]:
    table = app.query_one(f"#{view}-table")
    return [[str(c) for c in table.get_row_at(i)] for i in range(table.row_count)]


def test_top_shows_the_cluster_and_pins_with_confirmation(fresh_cluster):
    with fresh_cluster.connect() as rt:
        rt.put({"w": torch.ones(4096)}, "top-model")
        plan = tc.Plan(tc.CallContext(deadline_ms=10_000, idempotency_key="top-plan"))
        plan.on_worker("worker-1").pin("top-model")
        trace_id = plan.run(rt)["trace_id"]
        plan = tc.Plan(tc.CallContext(deadline_ms=10_000, idempotency_key="top-plan-2"))
        plan.on_worker("worker-1").unpin("top-model")
        plan.run(rt)
        num_shards = rt.shards().num_shards

    async def scenario():
        app = TopApp(SdkSource(fresh_cluster.connect), interval_s=0.2)
        async with app.run_test(size=(120, 30)) as pilot:
            await _until(pilot, lambda: len(_rows(app, "workers")) == 1)
            assert _rows(app, "workers")[0][0] == "worker-1"
            assert _rows(app, "workers")[0][-1] == "healthy"
            await pilot.press("2")
            await _until(pilot, lambda: [r[0] for r in _rows(app, "artifacts")] == ["top-model"])
            await pilot.press("p")  # asks for the worker, prefilled with the first live one
            await pilot.pause(0.2)
            await pilot.press("enter")
            await _until(pilot, lambda: _rows(app, "artifacts")[0][-1] == "worker-1")
            await pilot.press("u")
            await pilot.pause(0.2)
            await pilot.press("escape")  # cancelled: still pinned
            await pilot.pause(0.5)
            assert _rows(app, "artifacts")[0][-1] == "worker-1"
            await pilot.press("4")  # every shard homed by the only shard-home worker
            await _until(pilot, lambda: len(_rows(app, "shards")) == num_shards)
            assert {(r[1], r[4]) for r in _rows(app, "shards")} == {("worker-1", "held")}
            await pilot.press("5")  # most recent plan first
            await _until(pilot, lambda: len(_rows(app, "plans")) == 2)
            plans = _rows(app, "plans")
            assert [r[1] for r in plans] == ["top-plan-2", "top-plan"]
            assert plans[1][0] == trace_id and plans[1][2] == "ok" and plans[1][5] == "1"
            await pilot.press("3")
            assert _rows(app, "instances") == []  # no engine attached
            await pilot.press("2")
            await pilot.press("slash")
            await pilot.press(*"nomatch", "enter")
            await _until(pilot, lambda: _rows(app, "artifacts") == [])

    asyncio.run(scenario())
    with fresh_cluster.connect() as rt:
        assert [r.pinned for r in rt.info("top-model").replicas] == [True]


def test_top_survives_the_store_restarting(fresh_cluster):
    c = fresh_cluster

    async def scenario():
        app = TopApp(SdkSource(c.connect), interval_s=0.2)
        async with app.run_test(size=(120, 30)) as pilot:
            banner = app.query_one("#banner")
            await _until(pilot, lambda: len(_rows(app, "workers")) == 1)
            assert not banner.has_class("visible")
            os.kill(c.pid("store"), signal.SIGKILL)
            await _until(pilot, lambda: banner.has_class("visible"))
            assert "unreachable" in str(banner.render())
            restarted = c.start_store_again()
            try:
                await _until(pilot, lambda: not banner.has_class("visible"), 30)
                assert _rows(app, "workers")[0][0] == "worker-1"
            finally:
                restarted.terminate()
                restarted.wait(10)

    asyncio.run(scenario())


def test_rate_history_and_sparkline():
    def snap(t, total):
        w = WorkerInfo("w", "w", "", "", "", (), 1, 0, 1, 0.0, 0.0, True, "", 0, total)
        return ClusterSnapshot(taken_at=t, workers=(w,))

    history = RateHistory(keep=3)
    for t, total in [(0, 0), (1, 100), (2, 300), (3, 300), (4, 700)]:
        history.add(snap(t, total))
    assert history.rates["w"] == [200.0, 0.0, 400.0]
    assert history.latest("w") == 400.0
    assert history.sparkline("w") == "▄▁█"


class FixedSource:
    """Deterministic data for snapshots."""

    def fetch(self) -> ClusterSnapshot:
        workers = tuple(
            WorkerInfo(
                f"id{i}",
                f"worker-{i}",
                f"10.0.0.{i}:7000",
                "h",
                "",
                ("basic", "gateway"),
                8 << 30,
                used << 30,
                100 + i,
                0.0,
                age,
                alive,
                "",
                0,
                0,
            )
            for i, used, age, alive in [(1, 3, 0.4, True), (2, 6, 0.8, True), (3, 0, 9.5, False)]
        )
        artifacts = (
            ArtifactInfo(
                "llama-8b@v1",
                "c1-aaa",
                "system",
                16 << 30,
                (TensorMeta("w", "BF16", (4096, 4096), 32 << 20),),
                0.0,
                None,
                "",
                (ReplicaInfo("id1", "cpu", True), ReplicaInfo("id2")),
            ),
            ArtifactInfo(
                "kv/req-42",
                "c1-bbb",
                "lease",
                2 << 20,
                (TensorMeta("k", "F16", (16, 128), 4096),),
                0.0,
                1060.0,
                "",
                (ReplicaInfo("id2"),),
            ),
        )
        instances = (
            InstanceInfo("engine-a", "id1", "hf", "http://10.0.0.1:8001", 2, 4, 1536, ("r1",)),
            InstanceInfo("engine-b", "id2", "hf", "", 0, 1, 96, (), 7.5, False, "worker-2"),
        )
        shards = ShardTable(
            4,
            3.0,
            tuple(
                ShardLease(i, holder, token, left)
                for i, holder, token, left in [
                    (0, "id1", 3, 2.5),
                    (1, "id2", 1, 2.9),
                    (2, "id1", 7, 1.2),
                    (3, "", 2, 0.0),
                ]
            ),
        )
        plans = (
            PlanRecord("move-r1", "t-0002", "ok", {"steps": [{}, {}, {}]}, 990.0, 990.4),
            PlanRecord(
                "warm-up",
                "t-0001",
                "failed",
                {"steps": [{}], "error": {"kind": "DeadlineExceeded"}},
                900.0,
                905.0,
            ),
        )
        return ClusterSnapshot(
            1000.0, "10.0.0.1:7400", workers, artifacts, instances, shards, plans
        )


def _fixed_app() -> TopApp:
    return TopApp(FixedSource(), interval_s=3600, clock=lambda: 1000.0)


@pytest.mark.parametrize(
    "keys",
    [[], ["2"], ["2", "enter"], ["3"], ["4"], ["5"]],
    ids=["workers", "artifacts", "detail", "instances", "shards", "plans"],
)
def test_top_screens_snapshot(snap_compare, keys):
    assert snap_compare(_fixed_app(), press=keys, terminal_size=(120, 24))
