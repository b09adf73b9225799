"""One contract, two backends: every Global Store backend (sqlite file, etcd cluster) passes the
same tests for its records: workers and heartbeats, contents and replicas, artifacts and leases,
garbage collection, shard leases with fencing tokens, instances, plan results. Real sqlite files
and a real etcd process; times are passed in, so nothing sleeps."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from conftest import wait_until

from tensorcast.errors import (
    AlreadyExists,
    FencingError,
    IntegrityError,
    InvalidArgument,
    NotFound,
    Unavailable,
)
from tensorcast.sharding import hrw_rank, shard_of
from tensorcast.store.base import (
    DEAD_WORKER_RETENTION_S,
    PLAN_RETENTION_S,
    RECONCILE_GRACE_S,
    DeleteOp,
    GetOp,
    Inventory,
    NewArtifact,
    NewReplica,
    PutOp,
    WorkerRegistration,
)
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


def _beat(store, worker_id: str, now: float, cpu=(), pinned=(), disk=(), mem: int = 0) -> list:
    """A heartbeat with a full inventory; returns the contents the worker is told to drop."""
    result = store.heartbeat(worker_id, mem, Inventory.of(cpu, pinned, disk), now)
    assert not result.resync  # a full inventory is always applied
    return result.drop_content_ids


# -- workers, contents, replicas ----------------------------------------------------------------


def test_workers_register_beat_and_die_by_ttl(records):
    store, _ = records
    _worker(store, "w1", 100.0)
    _worker(store, "w2", 100.0, name="other")
    assert _beat(store, "w1", 101.0, mem=123) == []
    w1 = min(store.list_workers(102.0), key=lambda w: w.worker_id)
    assert (w1.alive, w1.mem_used_bytes, w1.heartbeat_age_s) == (True, 123, pytest.approx(1.0))
    assert [w.name for w in store.list_workers(102.0)] == ["other", "w1"]  # by name
    alive = {w.worker_id: w.alive for w in store.list_workers(103.5)}
    assert alive == {"w1": True, "w2": False}  # w2 last beat at 100, a TTL ago
    with pytest.raises(NotFound):
        _beat(store, "nobody", 101.0)
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
    _beat(store, "w2", 102.0, ["c1"])
    assert [r.worker_id for r in store.find_content("c1", 103.5).replicas] == ["w2"]
    store.remove_replica("w2", "c1")
    assert store.find_content("c1", 103.5).replicas == ()
    assert store.find_content("nope", 100.0) is None
    with pytest.raises(InvalidArgument, match="tier"):
        store.add_replica("w1", "c1", 68, _tensors("c1"), 100.0, tier="gpu")
    with pytest.raises(InvalidArgument, match="tensor name"):
        store.add_replica("w1", "c2", 4, (TensorMeta("a\x00", "U8", (4,), 4, 0),), 100.0)


def test_an_evicted_copy_is_removed_only_while_another_live_worker_holds_one(records):
    """Two workers evicting the same content at once each ask the store to remove their copy
    `unless_last`: the store lets one go and keeps the other (the decision is one transaction
    each, against the replicas as they are then), so the content is never left with none."""
    store, _ = records
    for w in ("w1", "w2", "w3"):
        _worker(store, w, 100.0)
    _content(store, "w1", "c1", 100.0)
    _content(store, "w2", "c1", 100.0)
    assert store.remove_replica("w1", "c1", "cpu", unless_last=True, now=101.0)
    assert not store.remove_replica("w2", "c1", "cpu", unless_last=True, now=101.0)
    assert [r.worker_id for r in store.find_content("c1", 101.0).replicas] == ["w2"]
    # A copy on a dead worker does not count: w3's is the last live one.
    _content(store, "w3", "c1", 100.0)
    _beat(store, "w3", 102.5, ["c1"])
    assert not store.remove_replica("w3", "c1", "cpu", unless_last=True, now=103.5)
    assert [r.worker_id for r in store.find_content("c1", 103.5).replicas] == ["w3"]
    # Unconditional removal (a worker that dropped its copy anyway) still goes.
    assert store.remove_replica("w3", "c1")
    assert store.find_content("c1", 103.5).replicas == ()


def test_heartbeats_reconcile_the_inventory(records):
    store, _ = records
    _worker(store, "w1", 100.0)
    _content(store, "w1", "c1", 100.0)
    _content(store, "w1", "c2", 100.0)
    # Held but unknown: to drop. Known and held: listed (pinned as reported). Listed but no
    # longer held: forgotten once older than the grace.
    assert _beat(store, "w1", 100.5, ["c1", "zz"], pinned=["c1"]) == ["zz"]
    assert store.find_content("c1", 100.5).replicas[0].pinned
    assert store.find_content("c2", 100.5).replicas  # younger than the grace: kept
    later = 100.0 + RECONCILE_GRACE_S + 1
    _beat(store, "w1", later, ["c1"], disk=["c2"])
    assert [(r.tier) for r in store.find_content("c2", later).replicas] == ["disk"]
    assert not store.find_content("c1", later).replicas[0].pinned  # unpinned as reported
    assert [w.num_replicas for w in store.list_workers(later)] == [2]


def _rows(store, worker_id: str, contents: list[str], now: float) -> dict[str, bool]:
    """content -> pinned, for `worker_id`'s cpu replicas of `contents`."""
    rows = {}
    for content_id in contents:
        info = store.find_content(content_id, now)
        for r in info.replicas if info else ():
            if r.worker_id == worker_id and r.tier == "cpu":
                rows[content_id] = r.pinned
    return rows


def test_delta_inventories_apply_only_on_the_acknowledged_epoch(records):
    store, _ = records
    _worker(store, "w1", 100.0)
    for c in ("c1", "c2", "c3"):
        _content(store, "w1", c, 100.0)
    # Full, epoch 1: c3 is not held, but its row is younger than the grace: kept, and said so.
    full = store.heartbeat("w1", 0, Inventory.of(["c1", "c2"], epoch=1), 100.5)
    assert (full.resync, full.kept) == (False, {("c3", "cpu")})
    t = 100.0 + RECONCILE_GRACE_S + 1
    # A delta against epoch 1: c1 pinned, c2 removed, c3's removal sent again, an unknown new one.
    delta = Inventory(
        epoch=2,
        held={("c1", "cpu"): True, ("zz", "cpu"): False},
        removed=frozenset({("c2", "cpu"), ("c3", "cpu")}),
        base_epoch=1,
    )
    result = store.heartbeat("w1", 0, delta, t)
    assert (result.drop_content_ids, result.resync, result.kept) == (["zz"], False, frozenset())
    assert _rows(store, "w1", ["c1", "c2", "c3", "zz"], t) == {"c1": True}
    # A delta against an epoch the store did not record (a lost answer): nothing applied.
    stale = Inventory(epoch=3, removed=frozenset({("c1", "cpu")}), base_epoch=1)
    result = store.heartbeat("w1", 0, stale, t + 1)
    assert (result.resync, result.drop_content_ids) == (True, [])
    assert _rows(store, "w1", ["c1"], t + 1) == {"c1": True}
    assert store.list_workers(t + 1.5)[0].heartbeat_age_s == pytest.approx(0.5)  # still alive
    # The full inventory that follows is applied, and deltas against it again.
    assert _beat(store, "w1", t + 2, ["c1"], pinned=["c1"]) == []
    store.heartbeat("w1", 0, Inventory.of(["c1"], pinned=["c1"], epoch=4), t + 2)
    unpin = Inventory(epoch=5, held={("c1", "cpu"): False}, base_epoch=4)
    assert not store.heartbeat("w1", 0, unpin, t + 3).resync
    assert _rows(store, "w1", ["c1"], t + 3) == {"c1": False}
    # Declared dead by a sweep, its rows go; back, its next delta is refused until a full beat.
    dead_at = t + 3 + TTL + 1
    store.sweep(dead_at)
    back = Inventory(epoch=6, base_epoch=5)
    assert store.heartbeat("w1", 0, back, dead_at + 0.5).resync
    assert _rows(store, "w1", ["c1"], dead_at + 0.5) == {}
    assert _beat(store, "w1", dead_at + 1, ["c1"]) == []
    assert _rows(store, "w1", ["c1"], dead_at + 1) == {"c1": False}


def test_a_worker_is_told_once_to_drop_what_lost_its_last_artifact(records):
    store, _ = records
    _worker(store, "w1", 100.0)
    _worker(store, "w2", 100.0)
    for c in ("c1", "c2", "c3"):
        _content(store, "w1", c, 100.0)
        store.create_artifact(f"a-{c}", c, "system", 0, "", 100.0)
    _content(store, "w2", "c1", 100.0)
    store.heartbeat("w1", 0, Inventory.of(["c1", "c2", "c3"], epoch=1), 100.1)
    store.heartbeat("w2", 0, Inventory.of(["c1"], epoch=1), 100.1)
    store.delete_artifacts(["a-c1", "a-c2"], 100.2)
    # c2 comes back (put again) before the beat: it is not dropped.
    _content(store, "w1", "c2", 100.3)
    store.create_artifact("a-c2", "c2", "system", 0, "", 100.3)
    nothing_changed = Inventory(epoch=2, base_epoch=1)
    assert store.heartbeat("w1", 0, nothing_changed, 100.4).drop_content_ids == ["c1"]
    assert store.heartbeat("w1", 0, Inventory(epoch=3, base_epoch=2), 100.5).drop_content_ids == []
    # Every worker that held it is told.
    assert store.heartbeat("w2", 0, nothing_changed, 100.6).drop_content_ids == ["c1"]
    assert _rows(store, "w1", ["c2", "c3"], 100.6) == {"c2": False, "c3": False}


def _etcd_store(endpoint: str):
    store, _ = open_backend(
        None, [endpoint], TTL, 4, GRACE, etcd_prefix=f"/contract-{next(_prefixes)}/"
    )
    return store


def test_etcd_history_is_compacted_by_the_sweep(etcd_endpoint, monkeypatch):
    """etcd keeps every revision until compacted and stops taking writes at its quota: the
    store's sweep compacts all but the last revisions (a read at an older one then fails)."""
    from tensorcast.store import etcd_store

    store = _etcd_store(etcd_endpoint)
    kv = store.kv

    def read_at(revision: int) -> dict:
        key = kv.put("history", 0)["request_put"]["key"]
        return kv._post("/kv/range", {"key": key, "revision": revision})

    try:
        for i in range(20):
            kv.apply([kv.put("history", {"i": i})])
        old = kv.get("history").mod_revision - 10
        assert read_at(old)["kvs"]  # the history is there
        assert kv.compact(keep_revisions=5) > old
        with pytest.raises(Unavailable, match="compacted"):
            read_at(old)
        assert kv.compact(keep_revisions=10**9) == 0  # nothing that old
        for i in range(5):
            kv.apply([kv.put("history", {"i": 20 + i})])
        newer = kv.get("history").mod_revision - 3
        assert read_at(newer)["kvs"]
        monkeypatch.setattr(etcd_store, "COMPACT_KEEP_REVISIONS", 1)
        store.sweep(time.time())  # the first sweep compacts
        with pytest.raises(Unavailable, match="compacted"):
            read_at(newer)
    finally:
        store.close()


def test_a_silent_etcd_member_costs_the_store_status_one_short_wait(etcd_endpoint):
    """Every new client asks the store's Status, which reports each etcd member's health: a
    member that accepts connections and never answers is reported within the health timeout
    (all are asked at once), not after etcd's 5 s client timeout per silent member."""
    import socket

    from tensorcast.store import etcd_kv

    silent = socket.create_server(("127.0.0.1", 0))  # listens, never answers
    try:
        addr = f"127.0.0.1:{silent.getsockname()[1]}"
        kv = etcd_kv.EtcdKV([etcd_endpoint, addr, addr], prefix="/health/")
        started = time.monotonic()
        health = kv.member_health()
        took = time.monotonic() - started
        assert [h[:2] for h in health] == [(etcd_endpoint, True), (addr, False), (addr, False)]
        assert "no answer" in health[1][2]
        assert took < 4.0, took  # 10 s when asked in turn; ~1 s now
        assert kv.member_health() is health  # remembered for a moment
    finally:
        silent.close()


def test_etcd_out_of_space_is_resource_exhausted_and_reads_still_work(tmp_path):
    """A member at its space quota refuses every write alike: ResourceExhausted saying what
    to do, at once (not Unavailable after trying every member), and reads still answer."""
    from tensorcast.errors import ResourceExhausted
    from tensorcast.sdk import local_etcd
    from tensorcast.store.etcd_kv import EtcdKV

    (member,) = local_etcd.plan_members(1, "127.0.0.1", tmp_path)
    log = tmp_path / "etcd.log"
    args = ["--quota-backend-bytes", str(2 << 20)]
    proc = local_etcd.spawn(member, [member], local_etcd.cluster_token(), log, tmp_path, args)
    try:
        local_etcd.wait_healthy([member], [proc], log)
        kv = EtcdKV([member.client_addr], prefix="/quota/")
        blob = "x" * (200 << 10)
        with pytest.raises(ResourceExhausted, match="out of space"):
            for i in range(64):  # 12.8 MiB against a 2 MiB quota
                kv.apply([kv.put(f"big/{i}", blob)])
        assert kv.get("big/0") is not None
    finally:
        proc.terminate()
        proc.wait(10)


def test_etcd_a_put_racing_the_delete_of_the_same_content_keeps_its_replica(etcd_endpoint):
    """Two store processes: one deletes the last name of a content while the other puts the
    same bytes under a new name between the delete's commit and its dropping of the replica
    rows. The new artifact keeps its replica (it had none until the worker re-reported all
    it holds, counted as lost meanwhile)."""
    prefix = f"/contract-{next(_prefixes)}/"
    first, _ = open_backend(None, [etcd_endpoint], TTL, 4, GRACE, etcd_prefix=prefix)
    second, _ = open_backend(None, [etcd_endpoint], TTL, 4, GRACE, etcd_prefix=prefix)
    try:
        _worker(first, "w1", 100.0)
        replica = NewReplica("c1", 68, _tensors("race"))
        first.put_artifacts("w1", [replica], [NewArtifact("x", "c1", "system")], 100.0)
        drop = first._drop_replicas

        def put_meanwhile(content_id: str) -> None:
            second.put_artifacts("w1", [replica], [NewArtifact("y", "c1", "system")], 100.5)
            drop(content_id)

        first._drop_replicas = put_meanwhile  # type: ignore[method-assign]
        first.delete_artifact("x", 101.0)
        assert [r.worker_id for r in first.get_artifact("y", 101.0).replicas] == ["w1"]
    finally:
        first.close()
        second.close()


def _many_tensors(tag: str, n: int) -> tuple[TensorMeta, ...]:
    return tuple(
        TensorMeta(
            f"model.layers.{i // 256}.mlp.experts.{i % 256}.down_proj.weight.{tag}",
            "BF16",
            (2048, 7168),
            2048 * 7168 * 2,
            i * 2048 * 7168 * 2,
            f"{i:064x}",
        )
        for i in range(n)
    )


def test_etcd_stores_a_content_of_many_tensors(etcd_endpoint):
    """A model directory is one content, its layout one record: 12,000 tensors (an MoE
    checkpoint's experts; ~3 MiB of layout) passed etcd's default request limit (1.5 MiB:
    a retryable Unavailable). The members `tc up --ha` starts take 32 MiB."""
    store = _etcd_store(etcd_endpoint)
    try:
        _worker(store, "w1", 100.0)
        moe = NewReplica("moe", 12_000 * 2048 * 7168 * 2, _many_tensors("moe", 12_000))
        store.put_artifacts("w1", [moe], [NewArtifact("moe@v1", "moe", "system")], 100.0)
        assert store.get_artifact("moe@v1", 100.0).tensors == moe.tensors
    finally:
        store.close()


def test_etcd_batches_go_in_transactions_bounded_in_bytes(tmp_path):
    """Against an etcd with its default request limit (1.5 MiB): three contents of ~0.8 MiB
    of layout each in one batch are stored (in transactions bounded in bytes as well as in
    operations: together they were one request etcd refused), and one content over the
    limit is InvalidArgument saying so, nothing stored."""
    from tensorcast.sdk import local_etcd

    (member,) = local_etcd.plan_members(1, "127.0.0.1", tmp_path)
    log = tmp_path / "etcd.log"
    args = ["--max-request-bytes", str(3 << 19)]  # etcd's default (the last flag counts)
    proc = local_etcd.spawn(member, [member], local_etcd.cluster_token(), log, tmp_path, args)
    try:
        local_etcd.wait_healthy([member], [proc], log)
        store = _etcd_store(member.client_addr)
        _worker(store, "w1", 100.0)
        parts = [NewReplica(f"p{k}", 1, _many_tensors(f"p{k}", 3_000)) for k in range(3)]
        names = [NewArtifact(f"p{k}@v1", f"p{k}", "system") for k in range(3)]
        store.put_artifacts("w1", parts, names, 100.0)
        assert [len(store.get_artifact(f"p{k}@v1", 100.0).tensors) for k in range(3)] == [3000] * 3
        big = NewReplica("big", 1, _many_tensors("big", 12_000))
        with pytest.raises(InvalidArgument, match="max-request-bytes"):
            store.put_artifacts("w1", [big], [NewArtifact("big@v1", "big", "system")], 100.0)
        with pytest.raises(NotFound):
            store.get_artifact("big@v1", 100.0)
        store.close()
    finally:
        proc.terminate()
        proc.wait(10)


def test_etcd_a_full_inventory_removes_rows_of_contents_gone_meanwhile(etcd_endpoint):
    """etcd has no one writer: a replica row can land after its content's last artifact went
    and its drop notes were written (AddReplica racing the delete). Deltas never mention it;
    the next full inventory removes the row and tells the worker to drop the bytes."""
    from tensorcast.store.etcd_store import _replica_keys

    store = _etcd_store(etcd_endpoint)
    try:
        _worker(store, "w1", 100.0)
        _content(store, "w1", "c1", 100.0)
        store.create_artifact("a-c1", "c1", "system", 0, "", 100.0)
        store.heartbeat("w1", 0, Inventory.of(["c1"], epoch=1), 100.1)
        store.delete_artifacts(["a-c1"], 100.2)
        assert store.heartbeat("w1", 0, Inventory(epoch=2, base_epoch=1), 100.3).drop_content_ids
        row = {"created_at": 100.25, "pinned": False}  # the racing AddReplica's row
        store.kv.apply([store.kv.put(k, row) for k in _replica_keys("c1", "w1", "cpu")])
        assert (
            store.heartbeat("w1", 0, Inventory(epoch=3, base_epoch=2), 100.4).drop_content_ids == []
        )
        full = store.heartbeat("w1", 0, Inventory.of(["c1"], epoch=4), 100.5)
        assert (full.drop_content_ids, full.resync) == (["c1"], False)
        assert store.kv.range("rw/w1/") == {} and store.kv.range("r/c1/") == {}
    finally:
        store.close()


def test_etcd_a_delta_that_lost_a_race_for_the_epoch_asks_for_everything(etcd_endpoint):
    """Two beats of one worker in flight at once (a retried one): the delta whose epoch was
    moved under it is applied, maybe out of order, so the answer is resync and the worker's
    next beat is its whole inventory."""
    store = _etcd_store(etcd_endpoint)
    try:
        _worker(store, "w1", 100.0)
        for c in ("c1", "c2"):
            _content(store, "w1", c, 100.0)
            store.create_artifact(f"a-{c}", c, "system", 0, "", 100.0)
        store.heartbeat("w1", 0, Inventory.of(["c1", "c2"], epoch=1), 100.1)
        store.delete_artifacts(["a-c2"], 100.2)
        reconcile = store._reconcile

        def racing(worker_id, inventory, now):
            out = reconcile(worker_id, inventory, now)
            if inventory.epoch == 2:  # another beat lands between this one's read and write
                store.heartbeat("w1", 0, Inventory.of(["c1", "c2"], epoch=3), now)
            return out

        store._reconcile = racing
        result = store.heartbeat("w1", 0, Inventory(epoch=2, base_epoch=1), 100.3)
        assert result.resync and result.drop_content_ids == ["c2"]
        assert store.kv.get("w/w1").value["inventory_epoch"] == 3  # the other beat's
        assert not store.kv.range("d/w1/")  # the notes went once the beat was recorded
    finally:
        store.close()


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
    assert _beat(store, "w1", 100.3, ["c1"]) == ["c1"]  # the worker is told to drop it
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
    _beat(store, "w1", 100.0 + GRACE, ["named", "orphan"])
    store.sweep(100.0 + GRACE - 1)
    assert store.find_content("orphan", 100.0 + GRACE) is not None  # within the grace
    store.sweep(100.0 + GRACE + 1)
    assert store.find_content("orphan", 100.0 + GRACE + 1) is None
    info = store.find_content("named", 100.0 + GRACE + 1)
    assert [r.worker_id for r in info.replicas] == ["w1"]  # w2 is dead: its row is gone
    assert _beat(store, "w2", 100.0 + GRACE + 2, ["named"]) == []  # back: listed again
    assert {r.worker_id for r in store.find_content("named", 100.0 + GRACE + 2).replicas} == {
        "w1",
        "w2",
    }


def test_touched_contents_wait_another_grace_to_be_named(records):
    store, _ = records
    _worker(store, "w1", 100.0)
    _content(store, "w1", "kept", 100.0)
    _content(store, "w1", "left", 100.0)
    beat = 100.0 + GRACE - 1  # the worker lives on; a long batch keeps "kept" new
    _beat(store, "w1", beat, ["kept", "left"])
    assert store.held_contents(["kept", "gone"], beat, touch=True) == {"kept"}
    store.sweep(100.0 + GRACE + 1)
    assert store.find_content("left", 100.0 + GRACE + 1) is None
    assert store.find_content("kept", 100.0 + GRACE + 1) is not None
    store.create_artifact("named", "kept", "system", 0, "", 100.0 + GRACE + 1)  # named at last
    assert store.held_contents(["left"], beat, touch=True) == set()  # nothing to keep
    _beat(store, "w1", beat + GRACE, ["kept"])
    store.sweep(beat + GRACE + 1)
    assert store.find_content("kept", beat + GRACE + 1) is not None


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
    again = coord.hand_off_shard("a", 0, 1, "b", 100.6)  # a re-sent request: the same outcome
    assert (again.leases[0].holder_worker_id, again.leases[0].token) == ("b", 2)
    with pytest.raises(FencingError):  # but not a hand-off to anyone else
        coord.hand_off_shard("a", 0, 1, "a", 100.6)
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
    _worker(store, "b", 102.0)
    coord.report_instances("b", [dataclasses.replace(inst, worker_id="b")], 102.0)
    store.sweep(102.0 + TTL + 1)  # a dead worker's instances stay listed, as dead
    assert [i.alive for i in coord.list_instances(102.0 + TTL + 1)] == [False]
    store.sweep(102.0 + DEAD_WORKER_RETENTION_S + 1)  # and go when the worker is forgotten
    assert coord.list_instances(102.0 + DEAD_WORKER_RETENTION_S + 1) == []


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
    # A claim re-sent (its reply was lost) is the claim, not a run to wait for; another is.
    claim = PlanRecord("r", "t1", "running", {}, 0.0, deadline_at=130.0, run_id="run-1")
    assert coord.begin_plan(claim, 120.0) == (True, None)
    assert coord.begin_plan(claim, 120.5) == (True, None)
    other = PlanRecord("r", "t1", "running", {}, 0.0, deadline_at=130.0, run_id="run-2")
    started, previous = coord.begin_plan(other, 121.0)
    assert not started and previous.run_id == "run-1"
    coord.finish_plan(PlanRecord("r", "t1", "ok", {"x": 2}, 0.0), 122.0)
    started, previous = coord.begin_plan(claim, 123.0)  # finished: a late re-send replays
    assert not started and previous.result == {"x": 2}


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


# -- batches, pages, group commit ------------------------------------------------------------------


def _batch(store, worker_id: str, tag: str, n: int, now: float, **overrides):
    """Put n new contents on `worker_id`, each named `{tag}/{i}`; returns the PutResult."""
    replicas = [NewReplica(f"{tag}-c{i}", 68, _tensors(f"{tag}{i}")) for i in range(n)]
    artifacts = [NewArtifact(f"{tag}/{i:04d}", f"{tag}-c{i}", "system") for i in range(n)]
    for index, art in overrides.items():
        artifacts[int(index[1:])] = art
    return store.put_artifacts(worker_id, replicas, artifacts, now)


def _ids(store, prefix: str, now: float) -> list[str]:
    return [a.art_id for a in store.list_artifacts(prefix, now)]


def test_a_batch_creates_every_artifact_or_none(records):
    store, _ = records
    _worker(store, "w1", 100.0)
    _content(store, "w1", "old", 100.0)
    store.create_artifact("taken", "old", "system", 0, "", 100.0)
    replicas = [NewReplica(f"c{i}", 68, _tensors(f"c{i}")) for i in range(3)]
    artifacts = [
        NewArtifact("b/0", "c0", "system"),
        NewArtifact("b/1", "c1", "lease", ttl_s=5.0),
        NewArtifact("b/2", "c2", "system", parent="b/0"),
        NewArtifact("b/old", "old", "system"),  # a content the store knew already
        NewArtifact("taken", "old", "system"),  # exists with this content: unchanged
        NewArtifact("b/0", "c0", "system"),  # twice in one batch, same content
    ]
    before = store.counts()
    result = store.put_artifacts("w1", replicas, artifacts, 100.5)
    assert [(a.art_id, existed) for a, existed in result.artifacts] == [
        ("b/0", False),
        ("b/1", False),
        ("b/2", False),
        ("b/old", False),
        ("taken", True),
        ("b/0", True),
    ]
    assert result.redundant == ()
    first = result.artifacts[0][0]
    assert first.tensors == _tensors("c0") and [r.worker_id for r in first.replicas] == ["w1"]
    assert result.artifacts[1][0].expires_at == pytest.approx(105.5)
    assert result.artifacts[2][0].parent == "b/0"
    assert store.counts() == (before[0] + 4, before[1] + 3)
    assert _ids(store, "b/", 101.0) == ["b/0", "b/1", "b/2", "b/old"]
    # The same batch again changes nothing: every member exists with its content.
    again = store.put_artifacts("w1", replicas, artifacts[:4], 101.0)
    assert all(existed for _, existed in again.artifacts)
    assert store.counts() == (before[0] + 4, before[1] + 3)


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        (NewArtifact("bad id ", "n1", "system"), InvalidArgument, "batch member 1"),
        (NewArtifact("taken", "n1", "system"), AlreadyExists, r"batch member 1 \('taken'\)"),
        (NewArtifact("x/1", "nowhere", "system"), NotFound, "batch member 1.*nowhere"),
        (NewArtifact("x/1", "n1", "lease"), InvalidArgument, "batch member 1.*ttl_s"),
        (NewArtifact("x/0", "n1", "system"), InvalidArgument, "batch member 1.*twice"),
    ],
)
def test_a_batch_with_one_bad_member_changes_nothing(records, bad, error, match):
    store, _ = records
    _worker(store, "w1", 100.0)
    _content(store, "w1", "old", 100.0)
    store.create_artifact("taken", "old", "system", 0, "", 100.0)
    before = (store.counts(), _ids(store, "", 100.0))
    replicas = [NewReplica(f"n{i}", 68, _tensors(f"n{i}")) for i in range(3)]
    artifacts = [NewArtifact("x/0", "n0", "system"), bad, NewArtifact("x/2", "n2", "system")]
    with pytest.raises(error, match=match):
        store.put_artifacts("w1", replicas, artifacts, 100.5)
    assert (store.counts(), _ids(store, "", 100.5)) == before
    assert store.find_content("n0", 100.5) is None  # not even the good members' contents
    with pytest.raises(InvalidArgument, match="tensor name"):
        bad_name = NewReplica("n9", 4, (TensorMeta("a\x00", "U8", (4,), 4, 0, "h"),))
        store.put_artifacts("w1", [bad_name], [NewArtifact("y", "n9", "system")], 100.5)
    with pytest.raises(NotFound, match="worker"):
        store.put_artifacts("nobody", replicas[:1], [NewArtifact("y", "n0", "system")], 100.5)
    assert (store.counts(), _ids(store, "", 100.5)) == before


def test_a_replica_held_by_another_live_worker_is_not_recorded_twice(records):
    store, _ = records
    _worker(store, "w1", 100.0)
    _worker(store, "w2", 100.0)
    _content(store, "w1", "c1", 100.0)
    rep = NewReplica("c1", 68, _tensors("c1"))
    result = store.put_artifacts("w2", [rep], [NewArtifact("a", "c1", "system")], 100.5)
    assert result.redundant == ("c1",)  # w2 frees its copy
    assert [r.worker_id for r in result.artifacts[0][0].replicas] == ["w1"]
    # A worker that holds a replica already keeps it; once w1 is dead, w2's copy is needed.
    assert store.put_artifacts("w1", [rep], [], 100.6).redundant == ()
    _beat(store, "w2", 103.0)
    result = store.put_artifacts("w2", [rep], [NewArtifact("b", "c1", "system")], 103.5)
    assert result.redundant == ()
    assert [r.worker_id for r in store.find_content("c1", 103.5).replicas] == ["w2"]
    assert store.held_contents(["c1", "nope"], 103.5) == {"c1"}
    assert store.held_contents(["c1"], 110.0) == set()  # nobody alive holds it


def test_large_batches_are_atomic_too(records):
    """250 artifacts: more than one etcd transaction holds (see decision 68)."""
    store, _ = records
    _worker(store, "w1", 100.0)
    _content(store, "w1", "old", 100.0)
    store.create_artifact("big/0249", "old", "system", 0, "", 100.0)  # the last member clashes
    with pytest.raises(AlreadyExists, match="batch member 249"):
        _batch(store, "w1", "big", 250, 100.5)
    assert _ids(store, "big/", 100.5) == ["big/0249"]
    store.delete_artifact("big/0249", 100.6)
    result = _batch(store, "w1", "big", 250, 100.7)
    assert [existed for _, existed in result.artifacts] == [False] * 250
    ids = _ids(store, "big/", 100.8)
    assert ids == [f"big/{i:04d}" for i in range(250)]
    assert store.get_artifact("big/0123", 100.8).tensors == _tensors("big123")
    assert store.counts()[0] == 250


def test_listings_come_in_pages_of_summaries(records):
    store, _ = records
    _worker(store, "w1", 100.0)
    _batch(store, "w1", "p", 25, 100.0)
    _batch(store, "w1", "q", 3, 100.0)
    _content(store, "w1", "leased", 100.0)
    store.create_artifact("p/0005x", "leased", "lease", 1.0, "", 100.0)  # expired at 101
    pages, after = [], ""
    while True:
        page, after = store.list_artifact_page("p/", after, 10, 102.0)
        pages.append([a.art_id for a in page])
        if not after:
            break
    assert [len(p) for p in pages] == [10, 10, 5]
    assert [a for p in pages for a in p] == [f"p/{i:04d}" for i in range(25)]
    summary = store.list_artifact_page("p/", "", 1, 102.0)[0][0]
    assert (summary.tensors, summary.num_tensors, summary.size_bytes) == ((), 2, 68)
    assert [r.worker_id for r in summary.replicas] == ["w1"]
    full = store.list_artifact_page("p/", "p/0003", 1, 102.0, with_tensors=True)[0][0]
    assert (full.art_id, full.tensors, full.num_tensors) == ("p/0004", _tensors("p4"), 2)
    assert store.list_artifact_page("p/", "p/0024", 10, 102.0) == ([], "")
    assert store.list_artifact_page("", "", 0, 102.0)[1] == ""  # 28 < one page
    everything = [a.art_id for a in store.list_artifact_page("", "p/0023", 3, 102.0)[0]]
    assert everything == ["p/0024", "q/0000", "q/0001"]


def test_delete_batches_check_every_member_first(records):
    store, _ = records
    _worker(store, "w1", 100.0)
    _batch(store, "w1", "d", 3, 100.0)
    with pytest.raises(NotFound, match="batch member 1"):
        store.delete_artifacts(["d/0000", "d/missing", "d/0001"], 100.5)
    assert _ids(store, "d/", 100.5) == ["d/0000", "d/0001", "d/0002"]
    assert store.delete_artifacts(["d/0000", "d/missing", "d/0001"], 100.5, missing_ok=True) == 2
    assert _ids(store, "d/", 100.5) == ["d/0002"]
    assert store.find_content("d-c0", 100.5) is None  # dropped with its last name
    assert _beat(store, "w1", 100.6, ["d-c0", "d-c2"]) == ["d-c0"]


def test_concurrent_writers_all_land(records):
    store, _ = records
    _worker(store, "w1", 100.0)
    errors: list[BaseException] = []

    def writer(k: int) -> None:
        try:
            for i in range(10):
                _batch(store, "w1", f"t{k}-{i}", 1, 100.0)
                store.delete_artifact(f"t{k}-{i}/0000", 100.0) if i % 3 == 0 else None
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert len(_ids(store, "t", 100.0)) == 6 * 6


def test_sqlite_commits_queued_writes_together(tmp_path):
    from tensorcast.store.sqlite_store import SqliteStore

    store = SqliteStore(tmp_path / "s.db", TTL, GRACE)
    _worker(store, "w1", 100.0)
    commits = store.commits
    threads = [
        threading.Thread(target=_batch, args=(store, "w1", f"g{k}", 2, 100.0)) for k in range(8)
    ]
    with store._lock:  # a commit in progress: writers queue up behind it
        for t in threads:
            t.start()
        wait_until(lambda: len(store._queue) == 8, 30)
    for t in threads:
        t.join(30)
    assert store.commits == commits + 1  # one transaction, one fsync for all eight
    assert len(_ids(store, "g", 100.0)) == 16
    store.close()


# -- etcd: staged batches -------------------------------------------------------------------------


@pytest.fixture
def etcd_records(etcd_endpoint):
    prefix = f"/contract-{next(_prefixes)}/"
    opened = []

    def open_() -> tuple:
        records = open_backend(None, [etcd_endpoint], TTL, 4, GRACE, etcd_prefix=prefix)
        opened.append(records[0])
        return records

    yield open_
    for store in opened:
        store.close()


def test_etcd_listings_never_show_part_of_a_staged_batch(etcd_records, monkeypatch):
    store, _ = etcd_records()
    _worker(store, "w1", 100.0)
    seen = []
    stage = store._stage

    def stage_then_look(*args):
        result = stage(*args)
        seen.append(len(_ids(store, "big/", 100.0)))
        with pytest.raises(NotFound):
            store.get_artifact("big/0000", 100.0)
        return result

    monkeypatch.setattr(store, "_stage", stage_then_look)
    _batch(store, "w1", "big", 120, 100.0)
    assert len(seen) > 2 and set(seen) == {0}  # several transactions, none of them visible
    assert len(_ids(store, "big/", 100.0)) == 120


def test_etcd_a_store_dying_mid_batch_leaves_none_of_it(etcd_records, monkeypatch):
    store, _ = etcd_records()
    _worker(store, "w1", 100.0)
    calls = []
    stage = store._stage

    def dies_on_the_third(*args):
        calls.append(1)
        if len(calls) == 3:
            raise SystemExit("killed")  # the process dies: no rollback runs
        return stage(*args)

    monkeypatch.setattr(store, "_stage", dies_on_the_third)
    monkeypatch.setattr(store, "_roll_back", lambda bid: None)
    with pytest.raises(SystemExit):
        _batch(store, "w1", "big", 120, 100.0)
    other, _ = etcd_records()  # another store on the same records
    assert _ids(other, "big/", 100.0) == [] and other.counts()[0] == 0
    with pytest.raises(NotFound):
        other.delete_artifact("big/0000", 100.0)
    # Past its deadline the batch is rolled back by any sweep: the names are free again.
    other.sweep(100.0 + other.batch_timeout_s + 1)
    assert other.kv.range("batch/") == {} and other.kv.range("bm/") == {}
    assert [e for _, e in _batch(other, "w1", "big", 120, 100.0).artifacts] == [False] * 120


def test_etcd_a_batch_rolled_back_while_staging_stages_nothing_more(etcd_records, monkeypatch):
    store, _ = etcd_records()
    other, _ = etcd_records()
    _worker(store, "w1", 100.0)
    calls = []
    stage = store._stage

    def swept_before_the_second(*args):
        calls.append(1)
        if len(calls) == 2:  # another store's sweep gives up on the batch meanwhile
            (key,) = other.kv.range("batch/", keys_only=True)
            other._roll_back(key.split("/", 1)[1])
        return stage(*args)

    monkeypatch.setattr(store, "_stage", swept_before_the_second)
    with pytest.raises(Unavailable, match="rolled back"):
        _batch(store, "w1", "big", 120, 100.0)
    assert len(calls) == 2  # the rest of the batch was not staged
    # No record of the batch is left behind to block its names for ever.
    assert store.kv.range("a/big/") == {} and store.kv.range("bm/") == {}
    assert store.kv.range("batch/") == {}
    assert [e for _, e in _batch(other, "w1", "big", 120, 100.0).artifacts] == [False] * 120


def test_etcd_sweeps_finished_plans_by_their_index(etcd_records, monkeypatch):
    store, coord = etcd_records()
    for key, finished in (("old", 100.0), ("new", 200.0), ("again", 100.0)):
        coord.begin_plan(PlanRecord(key, "t", "running", {}, 0.0, deadline_at=1e9), finished)
        coord.finish_plan(PlanRecord(key, "t", "failed", {}, 0.0), finished)
    # "again" is claimed anew: its old index entry must not drop the running claim.
    coord.begin_plan(PlanRecord("again", "t2", "running", {}, 0.0, deadline_at=1e9), 150.0)
    ranged: list[str] = []
    range_ = store.kv.range
    monkeypatch.setattr(
        store.kv, "range", lambda prefix, **kw: ranged.append(prefix) or range_(prefix, **kw)
    )
    coord._full_plan_sweep_at = float("inf")  # only the index (the hourly full pass is off)
    coord.sweep(150.0 + PLAN_RETENTION_S)
    assert "p/" not in ranged  # no plan record read but the due ones
    assert sorted(p.idempotency_key for p in coord.list_plans(10)) == ["again", "new"]
    assert coord.get_plan("again").status == "running"
    assert [k.split("/")[-1] for k in range_("pdone/", keys_only=True)] == ["new"]


def test_etcd_records_a_plan_result_too_large_for_one_request_without_step_results(
    etcd_records,
):
    _, coord = etcd_records()
    coord.begin_plan(PlanRecord("big", "t", "running", {}, 0.0, deadline_at=1e9), 100.0)
    steps = [
        {"id": i, "op": "publish", "status": "ok", "result": {"pages": ["p" * 64] * 400}}
        for i in range(100)
    ]  # ~2.6 MB: over etcd's 1.5 MiB request limit
    coord.finish_plan(
        PlanRecord("big", "t", "failed", {"status": "failed", "steps": steps}, 0.0), 101.0
    )
    got = coord.get_plan("big")
    assert got.status == "failed" and got.result["step_results_dropped"]
    assert [(s["id"], s["status"]) for s in got.result["steps"]] == [(i, "ok") for i in range(100)]
    assert not any("result" in s for s in got.result["steps"])  # a rerun runs them again


def test_etcd_a_store_dying_after_the_commit_leaves_all_of_it(etcd_records, monkeypatch):
    store, _ = etcd_records()
    _worker(store, "w1", 100.0)
    monkeypatch.setattr(store, "_finalize", lambda bid: None)  # died right after committing
    _batch(store, "w1", "big", 120, 100.0)
    other, _ = etcd_records()
    assert len(_ids(other, "big/", 100.0)) == 120
    assert "batch" in other.kv.get("a/big/0007").value
    other.sweep(100.5)  # finalizes: records lose their batch id, batch records go
    assert "batch" not in other.kv.get("a/big/0007").value
    assert other.kv.range("batch/") == {} and other.kv.range("bm/") == {}
    assert len(_ids(other, "big/", 100.5)) == 120


def test_run_batch_runs_independent_operations(records):
    store, _ = records
    _worker(store, "w1", 100.0)
    _batch(store, "w1", "old", 1, 100.0)
    good = PutOp(
        "w1", (NewReplica("n1", 68, _tensors("n1")),), (NewArtifact("new", "n1", "system"),)
    )
    bad = PutOp(
        "w1", (NewReplica("n2", 68, _tensors("n2")),), (NewArtifact("old/0000", "n2", "system"),)
    )
    results = store.run_batch(
        [
            good,
            GetOp("old/0000"),
            GetOp("missing"),
            bad,  # fails alone: the others are unaffected
            DeleteOp(("old/0000",)),
            DeleteOp(("missing",)),
            DeleteOp(("missing",), missing_ok=True),
        ],
        100.5,
    )
    assert results[0].artifacts[0][0].art_id == "new" and not results[0].artifacts[0][1]
    assert results[1].art_id == "old/0000" and results[1].tensors == _tensors("old0")
    assert isinstance(results[2], NotFound)
    assert isinstance(results[3], AlreadyExists)
    assert results[4:] == [1, results[5], 0] and isinstance(results[5], NotFound)
    assert _ids(store, "", 100.5) == ["new"]
    assert store.find_content("n2", 100.5) is None  # the failed put recorded nothing


def test_sqlite_runs_a_batch_in_one_transaction(tmp_path):
    from tensorcast.store.sqlite_store import SqliteStore

    store = SqliteStore(tmp_path / "s.db", TTL, GRACE)
    _worker(store, "w1", 100.0)
    commits = store.commits
    ops = [
        PutOp(
            "w1",
            (NewReplica(f"c{i}", 68, _tensors(f"c{i}")),),
            (NewArtifact(f"a{i}", f"c{i}", "system"),),
        )
        for i in range(8)
    ]
    assert all(not isinstance(r, Exception) for r in store.run_batch(ops, 100.0))
    assert store.commits == commits + 1
    store.close()


def test_listings_can_stop_at_a_delimiter(records):
    store, _ = records
    _worker(store, "w1", 100.0)
    replicas = [NewReplica(f"c{i}", 68, _tensors(f"c{i}")) for i in range(5)]
    ids = ["m@v1", "m@v1/a", "m@v1/b", "m@v2", "m@v2/a"]
    store.put_artifacts(
        "w1", replicas, [NewArtifact(a, f"c{i}", "system") for i, a in enumerate(ids)], 100.0
    )
    page, after = store.list_artifact_page("m@", "", 0, 100.0, delimiter="/")
    assert ([a.art_id for a in page], after) == (["m@v1", "m@v2"], "")
    page, after = store.list_artifact_page("m@", "", 1, 100.0, delimiter="/")
    assert ([a.art_id for a in page], after) == (["m@v1"], "m@v1")
    page, _ = store.list_artifact_page("m@", after, 1, 100.0, delimiter="/")
    assert [a.art_id for a in page] == ["m@v2"]


def test_sqlite_a_file_that_is_no_store_database_is_refused_clearly(tmp_path):
    """A garbage --db: a clear error naming the file (the CLI printed a raw traceback)."""
    import subprocess
    import sys

    bad = tmp_path / "store.db"
    bad.write_bytes(b"not a database at all " * 1000)
    with pytest.raises(InvalidArgument, match="not a Global Store database"):
        open_backend(bad, [], TTL, 4, GRACE)
    args = ["store", "start", "--db", str(bad), "--listen", "127.0.0.1:0", "--token", "t"]
    proc = subprocess.run(
        [sys.executable, "-m", "tensorcast.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == InvalidArgument.exit_code, proc.stderr
    assert "not a Global Store database" in proc.stderr and "Traceback" not in proc.stderr


def test_sqlite_damaged_pages_are_an_integrity_error_not_a_crash(tmp_path):
    """A store file damaged in the middle opens (its schema page is whole) but its reads
    hit the damage: IntegrityError saying what to do, never sqlite's raw DatabaseError."""
    from tensorcast.store.sqlite_store import SqliteStore

    path = tmp_path / "store.db"
    store = SqliteStore(path, TTL, GRACE)
    _worker(store, "w1", 100.0)
    _batch(store, "w1", "many", 2000, 100.0)
    store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    size = path.stat().st_size
    with open(path, "r+b") as f:  # every page between a quarter and three quarters in
        f.seek(size // 4)
        f.write(b"\xa5" * (size // 2))
    with pytest.raises((InvalidArgument, IntegrityError), match="damaged"):
        store = SqliteStore(path, TTL, GRACE)
        try:
            store.list_artifacts("many/", 100.0)
        finally:
            store.close()


def test_a_put_and_a_register_of_one_id_do_not_mix_and_a_register_again_extends(records):
    """An existing id with the same content answered any owner as "existed": a put over a
    lease got an artifact that vanished with the lease, a register over a put a permanent
    one. Now AlreadyExists naming what it is; a register again of a lease extends it."""
    store, _ = records
    _worker(store, "w1", 100.0)
    store.put_artifacts("w1", [NewReplica("c1", 68, _tensors("own"))], [], 100.0)
    store.put_artifacts("w1", [], [NewArtifact("sys", "c1", "system")], 100.0)
    store.put_artifacts("w1", [], [NewArtifact("les", "c1", "lease", ttl_s=5.0)], 100.0)
    with pytest.raises(AlreadyExists, match="as a system artifact"):
        store.put_artifacts("w1", [], [NewArtifact("sys", "c1", "lease", ttl_s=60.0)], 101.0)
    with pytest.raises(AlreadyExists, match="as a lease"):
        store.put_artifacts("w1", [], [NewArtifact("les", "c1", "system")], 101.0)
    result = store.put_artifacts("w1", [], [NewArtifact("les", "c1", "lease", ttl_s=60.0)], 101.0)
    assert result.artifacts[0][1]  # it existed
    assert store.get_artifact("les", 150.0).expires_at == pytest.approx(161.0)
    assert store.get_artifact("sys", 150.0).expires_at is None


def test_sqlite_a_renewal_is_judged_when_its_write_runs(tmp_path, monkeypatch):
    """Group commit: a renewal queued behind other writes past its artifact's expiry must not
    bring it back (readers had seen it gone); expiry is judged when the write runs."""
    from tensorcast.store import sqlite_store

    store = sqlite_store.SqliteStore(tmp_path / "s.db", TTL, GRACE)
    _worker(store, "w1", 100.0)
    store.put_artifacts(
        "w1",
        [NewReplica("c1", 68, _tensors("rn"))],
        [NewArtifact("l", "c1", "lease", ttl_s=1.0)],
        100.0,
    )

    class Clock:  # the write runs 1 s after the call arrived
        calls = iter([0.0, 1.0])

        @staticmethod
        def monotonic() -> float:
            return next(Clock.calls)

    monkeypatch.setattr(sqlite_store, "time", Clock)
    with pytest.raises(NotFound):
        store.renew_lease("l", 30.0, 100.5)  # arrived before its expiry (101), ran after
    store.close()
