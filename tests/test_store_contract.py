"""One contract, two backends: every Global Store backend (sqlite file, etcd cluster) passes the
same tests for its records: workers and heartbeats, contents and replicas, artifacts and leases,
garbage collection, shard leases with fencing tokens, instances, plan results. Real sqlite files
and a real etcd process; times are passed in, so nothing sleeps."""

from __future__ import annotations

import itertools
import subprocess
from collections.abc import Callable, Iterator

import pytest

from tensorcast.errors import AlreadyExists, FencingError, IntegrityError, InvalidArgument, NotFound
from tensorcast.sharding import hrw_rank, shard_of
from tensorcast.store.base import RECONCILE_GRACE_S, WorkerRegistration
from tensorcast.store.server import open_backend
from tensorcast.types import InstanceInfo, PlanRecord, TensorMeta

TTL = 3.0
GRACE = 60.0
_prefixes = itertools.count()


@pytest.fixture(scope="session")
def etcd_endpoint(tmp_path_factory) -> Iterator[str]:
    """One real etcd member for the session; every test takes its own key prefix."""
    from tensorcast.sdk import local_etcd

    root = tmp_path_factory.mktemp("etcd")
    (member,) = local_etcd.plan_members(1, "127.0.0.1", root)
    log = root / "etcd.log"
    proc = local_etcd.spawn(member, [member], local_etcd.cluster_token(), log, root)
    try:
        local_etcd.wait_healthy([member], [proc], log)
        yield member.client_addr
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


Opener = Callable[..., tuple]


@pytest.fixture(params=["sqlite", "etcd"])
def opener(request, tmp_path) -> Iterator[Opener]:
    """Opens the backend on the same records each time it is called (a restarted store)."""
    opened: list = []
    if request.param == "sqlite":

        def open_(num_shards: int | None = 4) -> tuple:
            records = open_backend(tmp_path / "store.db", [], TTL, num_shards, GRACE)
            opened.append(records[0])
            return records
    else:
        endpoint = request.getfixturevalue("etcd_endpoint")
        prefix = f"/contract-{next(_prefixes)}/"

        def open_(num_shards: int | None = 4) -> tuple:
            records = open_backend(None, [endpoint], TTL, num_shards, GRACE, etcd_prefix=prefix)
            opened.append(records[0])
            return records

    yield open_
    for store in opened:
        store.close()


@pytest.fixture
def records(opener):
    return opener()


def _worker(store, worker_id: str, now: float, roles=("basic", "shard-home"), name: str = ""):
    store.register_worker(
        WorkerRegistration(
            worker_id, name or worker_id, "127.0.0.1:1", "h", "s", roles, 1 << 20, 1
        ),
        now,
    )


def _tensors(tag: str, hashed: bool = True) -> tuple[TensorMeta, ...]:
    return (
        TensorMeta("a", "U8", (4,), 4, 0, f"ha{tag}" if hashed else ""),
        TensorMeta("b", "U8", (4,), 4, 64, f"hb{tag}" if hashed else ""),
    )


def _content(store, worker_id: str, content_id: str, now: float, tier: str = "cpu") -> None:
    store.add_replica(worker_id, content_id, 68, _tensors(content_id), now, tier)


# -- workers, contents, replicas ----------------------------------------------------------------


def test_workers_register_beat_and_die_by_ttl(records):
    store, _ = records
    _worker(store, "w1", 100.0)
    _worker(store, "w2", 100.0, name="other")
    assert store.heartbeat("w1", 123, [], 101.0) == []
    w1 = min(store.list_workers(102.0), key=lambda w: w.worker_id)
    assert (w1.alive, w1.mem_used_bytes, w1.heartbeat_age_s) == (True, 123, pytest.approx(1.0))
    assert [w.name for w in store.list_workers(102.0)] == ["other", "w1"]  # by name
    alive = {w.worker_id: w.alive for w in store.list_workers(103.5)}
    assert alive == {"w1": True, "w2": False}  # w2 last beat at 100, a TTL ago
    with pytest.raises(NotFound):
        store.heartbeat("nobody", 0, [], 101.0)
    # A name belongs to one live worker; a dead one's name can be taken.
    with pytest.raises(AlreadyExists, match="w1"):
        _worker(store, "w3", 103.0, name="w1")
    _worker(store, "w4", 200.0, name="w1")
    store.deregister_worker("w4")
    assert "w4" not in {w.worker_id for w in store.list_workers(200.0)}


def test_replicas_are_listed_while_their_worker_lives(records):
    store, _ = records
    _worker(store, "w1", 100.0)
    _worker(store, "w2", 100.0)
    with pytest.raises(NotFound):
        _content(store, "nobody", "c1", 100.0)
    _content(store, "w1", "c1", 100.0)
    _content(store, "w2", "c1", 100.5)
    _content(store, "w2", "c1", 100.6)  # idempotent
    info = store.find_content("c1", 101.0)
    assert info.size_bytes == 68 and info.tensors == _tensors("c1")
    assert [r.worker_id for r in info.replicas] == ["w1", "w2"]  # oldest first
    store.heartbeat("w2", 0, ["c1"], 102.0)
    assert [r.worker_id for r in store.find_content("c1", 103.5).replicas] == ["w2"]
    store.remove_replica("w2", "c1")
    assert store.find_content("c1", 103.5).replicas == ()
    assert store.find_content("nope", 100.0) is None
    with pytest.raises(InvalidArgument, match="tier"):
        store.add_replica("w1", "c1", 68, _tensors("c1"), 100.0, tier="gpu")
    with pytest.raises(InvalidArgument, match="tensor name"):
        store.add_replica("w1", "c2", 4, (TensorMeta("a\x00", "U8", (4,), 4, 0),), 100.0)


def test_heartbeats_reconcile_the_inventory(records):
    store, _ = records
    _worker(store, "w1", 100.0)
    _content(store, "w1", "c1", 100.0)
    _content(store, "w1", "c2", 100.0)
    # Held but unknown: to drop. Known and held: listed (pinned as reported). Listed but no
    # longer held: forgotten once older than the grace.
    assert store.heartbeat("w1", 0, ["c1", "zz"], 100.5, frozenset({"c1"})) == ["zz"]
    assert store.find_content("c1", 100.5).replicas[0].pinned
    assert store.find_content("c2", 100.5).replicas  # younger than the grace: kept
    later = 100.0 + RECONCILE_GRACE_S + 1
    store.heartbeat("w1", 0, ["c1"], later, disk_content_ids=frozenset({"c2"}))
    assert [(r.tier) for r in store.find_content("c2", later).replicas] == ["disk"]
    assert [w.num_replicas for w in store.list_workers(later)] == [2]


def test_reference_hashes_are_filled_once_then_checked(records):
    store, _ = records
    _worker(store, "w", 100.0)
    store.add_replica(
        "w", "r1-x", 68, _tensors("x", hashed=False), 100.0, tier="file", reference="{}"
    )
    store.add_replica("w", "r1-x", 68, _tensors("x"), 100.0)
    assert store.find_content("r1-x", 100.0).tensors == _tensors("x")
    with pytest.raises(IntegrityError):
        store.add_replica("w", "r1-x", 68, _tensors("changed"), 100.0)
    info = store.find_content("r1-x", 100.0)
    assert info.tensors == _tensors("x") and {r.tier for r in info.replicas} == {"file", "cpu"}
    store.create_artifact("by-ref", "r1-x", "system", 0, "", 100.0)
    assert store.list_references("h") == [("r1-x", "{}")]
    assert store.list_references("other-host") == []


# -- artifacts, leases, garbage --------------------------------------------------------------------


def test_artifacts_are_immutable_names_of_contents(records):
    store, _ = records
    _worker(store, "w1", 100.0)
    _content(store, "w1", "c1", 100.0)
    _content(store, "w1", "c2", 100.0)
    info, existed = store.create_artifact("m@v1", "c1", "system", 0, "", 100.0)
    assert not existed and info.content_id == "c1" and info.size_bytes == 68
    assert [r.worker_id for r in info.replicas] == ["w1"]
    assert store.create_artifact("m@v1", "c1", "system", 0, "", 100.1)[1]  # same: idempotent
    with pytest.raises(AlreadyExists):
        store.create_artifact("m@v1", "c2", "system", 0, "", 100.1)
    with pytest.raises(NotFound, match="not held"):
        store.create_artifact("m@v2", "missing", "system", 0, "", 100.1)
    for bad in ("", " x", "a\nb", "x" * 513):
        with pytest.raises(InvalidArgument):
            store.create_artifact(bad, "c1", "system", 0, "", 100.1)
    with pytest.raises(InvalidArgument):
        store.create_artifact("leased", "c1", "lease", 0, "", 100.1)
    store.create_artifact("m@v1/tp0", "c2", "system", 0, "m@v1", 100.2)
    assert [a.art_id for a in store.list_artifacts("m@", 100.3)] == ["m@v1", "m@v1/tp0"]
    assert store.get_artifact("m@v1/tp0", 100.3).parent == "m@v1"
    assert store.counts() == (2, 2)


def test_the_last_artifact_naming_a_content_frees_it(records):
    store, _ = records
    _worker(store, "w1", 100.0)
    _content(store, "w1", "c1", 100.0)
    store.create_artifact("a", "c1", "system", 0, "", 100.0)
    store.create_artifact("b", "c1", "system", 0, "", 100.0)
    store.delete_artifact("a", 100.1)
    assert store.find_content("c1", 100.1) is not None  # b still names it
    with pytest.raises(NotFound):
        store.delete_artifact("a", 100.1)
    store.delete_artifact("b", 100.2)
    assert store.find_content("c1", 100.2) is None
    assert store.heartbeat("w1", 0, ["c1"], 100.3) == ["c1"]  # the worker is told to drop it
    assert store.counts() == (0, 0)


def test_leases_expire_renew_and_free_their_content(records):
    store, _ = records
    _worker(store, "w1", 100.0)
    _content(store, "w1", "c1", 100.0)
    _content(store, "w1", "c2", 100.0)
    info, _ = store.create_artifact("kv-a", "c1", "lease", 5.0, "", 100.0)
    assert info.expires_at == pytest.approx(105.0)
    store.create_artifact("kv-b", "c2", "lease", 5.0, "", 100.0)
    assert store.renew_lease("kv-a", 10.0, 104.0).expires_at == pytest.approx(114.0)
    with pytest.raises(NotFound):
        store.get_artifact("kv-b", 105.0)  # expired: gone at once, swept or not
    assert [a.art_id for a in store.list_artifacts("kv-", 105.0)] == ["kv-a"]
    with pytest.raises(NotFound):
        store.renew_lease("kv-b", 10.0, 105.0)
    store.create_artifact("sys", "c1", "system", 0, "", 100.0)
    with pytest.raises(InvalidArgument, match="system-owned"):
        store.renew_lease("sys", 10.0, 105.0)
    store.sweep(106.0)
    assert store.find_content("c2", 106.0) is None  # kv-b's content went with it
    store.create_artifact("kv-b", "c1", "lease", 1.0, "", 106.0)  # the name is free again
    store.sweep(120.0)
    assert [a.art_id for a in store.list_artifacts("", 120.0)] == ["sys"]


def test_sweep_collects_unnamed_contents_and_dead_workers_replicas(records):
    store, _ = records
    _worker(store, "w1", 100.0)
    _worker(store, "w2", 100.0)
    _content(store, "w1", "named", 100.0)
    _content(store, "w2", "named", 100.0)
    _content(store, "w1", "orphan", 100.0)
    store.create_artifact("n", "named", "system", 0, "", 100.0)
    store.heartbeat("w1", 0, ["named", "orphan"], 100.0 + GRACE)
    store.sweep(100.0 + GRACE - 1)
    assert store.find_content("orphan", 100.0 + GRACE) is not None  # within the grace
    store.sweep(100.0 + GRACE + 1)
    assert store.find_content("orphan", 100.0 + GRACE + 1) is None
    info = store.find_content("named", 100.0 + GRACE + 1)
    assert [r.worker_id for r in info.replicas] == ["w1"]  # w2 is dead: its row is gone
    assert store.heartbeat("w2", 0, ["named"], 100.0 + GRACE + 2) == []  # back: listed again
    assert {r.worker_id for r in store.find_content("named", 100.0 + GRACE + 2).replicas} == {
        "w1",
        "w2",
    }


# -- shard leases, instances, plans ----------------------------------------------------------------


def test_first_bidder_gets_the_lease_and_tokens_grow_on_every_new_holder(records):
    store, coord = records
    _worker(store, "a", 100.0)
    _worker(store, "b", 100.0)
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


def test_only_the_holder_hands_a_shard_off_and_the_token_grows(records):
    store, coord = records
    _worker(store, "a", 100.0)
    _worker(store, "b", 100.0)
    _worker(store, "basic-only", 100.0, roles=("basic",))
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


def test_only_shard_homes_bid_and_the_shard_count_is_fixed(opener):
    store, coord = opener(4)
    _worker(store, "basic-only", 100.0, roles=("basic",))
    with pytest.raises(InvalidArgument, match="shard-home"):
        coord.acquire_shards("basic-only", [0], 100.0)
    with pytest.raises(NotFound):
        coord.acquire_shards("nobody", [0], 100.0)
    _worker(store, "a", 100.0)
    with pytest.raises(InvalidArgument, match="no shard 4"):
        coord.acquire_shards("a", [4], 100.0)
    assert opener(None)[1].num_shards == 4
    with pytest.raises(InvalidArgument, match="created with 4 shards"):
        opener(8)
    with pytest.raises(InvalidArgument, match="--shards"):
        opener(0)


def test_records_and_tokens_survive_a_store_restart(opener):
    store, coord = opener(2)
    _worker(store, "a", 100.0)
    _content(store, "a", "c1", 100.0)
    store.create_artifact("kept", "c1", "system", 0, "", 100.0)
    coord.acquire_shards("a", [0], 100.0)
    coord.release_shards("a")
    coord.acquire_shards("a", [0], 100.1)
    store.close()
    store, coord = opener(None)
    assert coord.shard_table(100.2).leases[0].token == 2
    assert store.get_artifact("kept", 100.2).replicas[0].worker_id == "a"


def test_instances_follow_their_worker(records):
    store, coord = records
    _worker(store, "a", 100.0)
    inst = InstanceInfo("i1", "a", "hf", "127.0.0.1:9", waiting=2, running=1, cached_tokens=30)
    coord.report_instances("a", [inst], 100.0)
    (got,) = coord.list_instances(100.5)
    assert (got.waiting, got.running, got.cached_tokens, got.alive) == (2, 1, 30, True)
    assert got.heartbeat_age_s == pytest.approx(0.5) and got.worker_name == "a"
    assert not coord.list_instances(100.0 + TTL + 1)[0].alive  # worker stopped heartbeating
    coord.report_instances("a", [], 101.0)  # detached
    assert coord.list_instances(101.0) == []
    coord.report_instances("a", [inst], 101.5)
    coord.release_shards("a")  # a worker leaving takes its instances along
    assert coord.list_instances(101.6) == []


def test_plan_keys_run_once(records):
    _, coord = records
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
    with pytest.raises(NotFound):
        coord.get_plan("never")
    # An abandoned run (gateway died) past its deadline may be claimed again.
    coord.begin_plan(PlanRecord("j", "t1", "running", {}, 0.0, deadline_at=110.0), 100.0)
    assert coord.begin_plan(PlanRecord("j", "t2", "running", {}, 0.0), 111.0)[0]
    assert [p.idempotency_key for p in coord.list_plans(10)] == ["j", "k"]


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
