"""The Global Store's coordination records on a real sqlite file: shard leases with fencing
tokens, instances, plan results by idempotency key. Times are passed in, so no sleeping."""

from __future__ import annotations

import pytest

from tensorcast.errors import FencingError, InvalidArgument, NotFound
from tensorcast.sharding import hrw_rank, shard_of
from tensorcast.store.base import WorkerRegistration
from tensorcast.store.coordination import SqliteCoordination
from tensorcast.store.sqlite_store import SqliteStore
from tensorcast.types import InstanceInfo, PlanRecord

TTL = 3.0


def _worker(store: SqliteStore, worker_id: str, now: float, roles=("basic", "shard-home")):
    store.register_worker(
        WorkerRegistration(worker_id, worker_id, "127.0.0.1:1", "h", "s", roles, 1 << 20, 1), now
    )


@pytest.fixture
def coord(tmp_path):
    store = SqliteStore(tmp_path / "store.db", TTL)
    yield SqliteCoordination(store, num_shards=4)
    store.close()


def test_first_bidder_gets_the_lease_and_tokens_grow_on_every_new_holder(coord):
    _worker(coord.store, "a", 100.0)
    _worker(coord.store, "b", 100.0)
    table = coord.acquire_shards("a", [0, 1], 100.0)
    assert [(lease.holder_worker_id, lease.token) for lease in table.leases[:2]] == [
        ("a", 1),
        ("a", 1),
    ]
    assert not table.leases[2].held and table.live_homes == ("a", "b")
    # b cannot take a held shard; renewing keeps a's token.
    table = coord.acquire_shards("b", [0], 101.0)
    assert table.leases[0].holder_worker_id == "a"
    coord.renew_shards("a", [(0, 1), (1, 7)], 102.0)  # a wrong token renews nothing
    table = coord.shard_table(104.5)
    assert table.leases[0].held and not table.leases[1].held
    # a's lease on 1 lapsed: b takes it with a higher token; a taking it back goes higher still.
    assert coord.acquire_shards("b", [1], 104.5).leases[1].token == 2
    coord.release_shards("b")
    assert coord.acquire_shards("a", [1], 104.6).leases[1].token == 3


def test_only_the_holder_hands_a_shard_off_and_the_token_grows(coord):
    _worker(coord.store, "a", 100.0)
    _worker(coord.store, "b", 100.0)
    _worker(coord.store, "basic-only", 100.0, roles=("basic",))
    coord.acquire_shards("a", [0, 1], 100.0)
    with pytest.raises(FencingError):  # not the holder
        coord.hand_off_shard("b", 0, 1, "b", 100.5)
    with pytest.raises(FencingError):  # stale token
        coord.hand_off_shard("a", 0, 7, "b", 100.5)
    with pytest.raises(InvalidArgument, match="not a live shard-home"):
        coord.hand_off_shard("a", 0, 1, "basic-only", 100.5)
    with pytest.raises(InvalidArgument, match="not a live shard-home"):
        coord.hand_off_shard("a", 0, 1, "nobody", 100.5)
    assert coord.shard_table(100.5).leases[0].holder_worker_id == "a"  # refusals change nothing
    table = coord.hand_off_shard("a", 0, 1, "b", 100.5)
    assert (table.leases[0].holder_worker_id, table.leases[0].token) == ("b", 2)
    assert table.leases[0].expires_in_s == pytest.approx(TTL)
    assert (table.leases[1].holder_worker_id, table.leases[1].token) == ("a", 1)
    coord.renew_shards("a", [(0, 1)], 101.0)  # the old holder's renewal is ignored
    assert coord.shard_table(101.0).leases[0].holder_worker_id == "b"
    with pytest.raises(FencingError):  # a lapsed lease cannot be handed off
        coord.hand_off_shard("a", 1, 1, "b", 104.0)
    with pytest.raises(InvalidArgument, match="not a live shard-home"):  # a stopped beating
        coord.hand_off_shard("b", 0, 2, "a", 103.4)


def test_only_shard_homes_bid_and_shard_count_is_fixed(coord, tmp_path):
    _worker(coord.store, "basic-only", 100.0, roles=("basic",))
    with pytest.raises(InvalidArgument, match="shard-home"):
        coord.acquire_shards("basic-only", [0], 100.0)
    with pytest.raises(NotFound):
        coord.acquire_shards("nobody", [0], 100.0)
    _worker(coord.store, "a", 100.0)
    with pytest.raises(InvalidArgument, match="no shard 4"):
        coord.acquire_shards("a", [4], 100.0)
    assert SqliteCoordination(coord.store, None).num_shards == 4
    with pytest.raises(InvalidArgument, match="created with 4 shards"):
        SqliteCoordination(coord.store, 8)


def test_tokens_survive_a_store_restart(tmp_path):
    store = SqliteStore(tmp_path / "s.db", TTL)
    coord = SqliteCoordination(store, 2)
    _worker(store, "a", 100.0)
    coord.acquire_shards("a", [0], 100.0)
    coord.release_shards("a")
    coord.acquire_shards("a", [0], 100.1)
    store.close()
    store = SqliteStore(tmp_path / "s.db", TTL)
    assert SqliteCoordination(store, None).shard_table(100.2).leases[0].token == 2
    store.close()


def test_instances_follow_their_worker(coord):
    _worker(coord.store, "a", 100.0)
    inst = InstanceInfo("i1", "a", "hf", "127.0.0.1:9", waiting=2, running=1, cached_tokens=30)
    coord.report_instances("a", [inst], 100.0)
    (got,) = coord.list_instances(100.5)
    assert (got.waiting, got.running, got.cached_tokens, got.alive) == (2, 1, 30, True)
    assert got.heartbeat_age_s == pytest.approx(0.5)
    assert not coord.list_instances(100.0 + TTL + 1)[0].alive  # worker stopped heartbeating
    coord.report_instances("a", [], 101.0)  # detached
    assert coord.list_instances(101.0) == []


def test_plan_keys_run_once(coord):
    rec = PlanRecord("k", "t1", "running", {}, 0.0, deadline_at=110.0)
    assert coord.begin_plan(rec, 100.0) == (True, None)
    started, previous = coord.begin_plan(PlanRecord("k", "t2", "running", {}, 0.0), 101.0)
    assert not started and previous.trace_id == "t1"  # still running: not twice
    coord.finish_plan(PlanRecord("k", "t1", "failed", {"steps": [1]}, 0.0), 102.0)
    started, previous = coord.begin_plan(PlanRecord("k", "t3", "running", {}, 0.0, 0, 120.0), 103.0)
    assert started and previous.status == "failed" and previous.result == {"steps": [1]}
    coord.finish_plan(PlanRecord("k", "t3", "ok", {"x": 1}, 0.0), 104.0)
    started, previous = coord.begin_plan(PlanRecord("k", "t4", "running", {}, 0.0), 105.0)
    assert not started and previous.result == {"x": 1}
    assert coord.get_plan("k").status == "ok"
    with pytest.raises(NotFound):
        coord.finish_plan(PlanRecord("k", "other-trace", "ok", {}, 0.0), 106.0)
    # An abandoned run (gateway died) past its deadline may be claimed again.
    coord.begin_plan(PlanRecord("j", "t1", "running", {}, 0.0, deadline_at=110.0), 100.0)
    assert coord.begin_plan(PlanRecord("j", "t2", "running", {}, 0.0), 111.0)[0]


def test_hrw_ranking_is_stable_and_spreads_shards():
    homes = [f"w{i}" for i in range(4)]
    firsts = [hrw_rank(s, homes)[0] for s in range(64)]
    assert firsts == [hrw_rank(s, list(reversed(homes)))[0] for s in range(64)]
    assert all(firsts.count(w) >= 6 for w in homes)
    # Removing a non-first home never changes a shard's first choice.
    assert all(
        hrw_rank(s, [w for w in homes if w == firsts[s] or w != "w3"])[0] == firsts[s]
        for s in range(64)
    )
    assert {shard_of(f"kv/r/{i}", 16) for i in range(200)} == set(range(16))
