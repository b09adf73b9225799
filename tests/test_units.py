"""Pure logic: sizes, the arena allocator, content identity, header encoding, view slicing."""

from __future__ import annotations

import itertools
import random
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorcast.config import parse_size
from tensorcast.errors import InvalidArgument, ResourceExhausted
from tensorcast.identity import content_id
from tensorcast.transport.native import ArenaAllocator
from tensorcast.types import TensorMeta
from tensorcast.worker.pool import PAGE_BYTES
from tensorcast.worker.slicing import DimSlice, sliced_shape


@pytest.mark.parametrize(
    "text,expected",
    [
        ("4096", 4096),
        ("512MiB", 512 << 20),
        ("2GiB", 2 << 30),
        ("1.5G", 1_500_000_000),
        ("10kb", 10_000),
        (" 3 TiB ", 3 << 40),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "12XB", "-5MiB", "0", "1..2G", "GiB"])
def test_parse_size_rejects(text):
    with pytest.raises(InvalidArgument, match="bad size"):
        parse_size(text)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), st.integers(0, 5 * PAGE_BYTES)), max_size=60), st.randoms()
)
def test_arena_never_overlaps_and_coalesces(ops, rnd):
    capacity = 64 * PAGE_BYTES
    arena = ArenaAllocator(capacity)
    live: dict[int, int] = {}
    for do_alloc, size in ops:
        if do_alloc or not live:
            try:
                offset = arena.allocate(size)
            except ResourceExhausted:
                assert arena.largest_free_bytes() < max(size, 1)
                continue
            assert offset % PAGE_BYTES == 0
            live[offset] = arena.size_of(offset)
        else:
            offset = rnd.choice(sorted(live))
            arena.free(offset)
            del live[offset]
        spans = sorted(live.items())
        for (a, sa), (b, _) in itertools.pairwise(spans):
            assert a + sa <= b, "regions overlap"
        assert arena.used_bytes == sum(live.values())
    for offset in list(live):
        arena.free(offset)
    assert arena.free_blocks() == [(0, capacity)]


def test_content_id_ignores_order_and_offsets_but_not_content():
    a = TensorMeta("a", "F32", (2,), 8, 0, "h1")
    b = TensorMeta("b", "I8", (3,), 3, 64, "h2")
    moved = TensorMeta("b", "I8", (3,), 3, 128, "h2")
    assert content_id([a, b]) == content_id([moved, a])
    assert content_id([a, b]) != content_id([a, TensorMeta("b", "I8", (3,), 3, 64, "h3")])
    assert content_id([a, b]) != content_id([a, TensorMeta("b", "U8", (3,), 3, 64, "h2")])
    assert content_id([a, b]) != content_id([a, TensorMeta("c", "I8", (3,), 3, 64, "h2")])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 6), min_size=1, max_size=4), st.data())
def test_sliced_shape_matches_torch(shape, data):
    """The worker's shape arithmetic equals what torch's own slicing produces."""
    dims = []
    for size in shape[: data.draw(st.integers(0, len(shape)))]:
        start = data.draw(st.integers(0, size))
        stop = data.draw(st.integers(start, size))
        dims.append(DimSlice(start, stop, data.draw(st.integers(1, 3))))
    meta = TensorMeta("t", "F32", tuple(shape), 4 * int(torch.tensor(shape).prod()))
    expected = torch.empty(shape)[tuple(slice(d.start, d.stop, d.step) for d in dims)].shape
    assert sliced_shape(meta, dims) == tuple(expected)


def test_sliced_shape_rejects_out_of_range():
    meta = TensorMeta("t", "F32", (4, 4), 64)
    with pytest.raises(InvalidArgument, match="bad slice"):
        sliced_shape(meta, [DimSlice(0, 5, 1)])
    with pytest.raises(InvalidArgument, match="bad slice"):
        sliced_shape(meta, [DimSlice(0, 2, 0)])
    with pytest.raises(InvalidArgument, match="dimensions"):
        sliced_shape(meta, [DimSlice(0, 1, 1)] * 3)


def test_random_layout_is_aligned():
    from tensorcast.types import pack_layout

    rnd = random.Random(0)
    specs = [
        (f"t{i}", rnd.choice(["F32", "I8", "BF16", "F64"]), (rnd.randint(0, 9),)) for i in range(50)
    ]
    metas, size = pack_layout(specs)
    for m in metas:
        assert m.offset_bytes % 64 == 0
    assert size >= sum(m.size_bytes for m in metas)


def test_pool_eviction_candidates_are_lru_unpinned_unheld_registered():
    from tensorcast.worker.pool import Pool

    pool = Pool(16 * PAGE_BYTES, name="tc-unit-pool")
    ids = []
    for i in range(4):
        res = pool.reserve(PAGE_BYTES)
        pool.region(res.offset, 4)[:] = bytes([i]) * 4
        meta = TensorMeta(f"t{i}", "U8", (4,), 4)
        ids.append(pool.commit(res.reservation_id, [meta]).content.content_id)
    # Being registered: neither evicted nor dropped until the registration ends.
    assert pool.eviction_candidates() == [] and not pool.drop(ids[3])
    for cid in ids:
        pool.end_registration(cid, registered=True)
    pool.hold(ids[0])  # most recently used, and held: not a candidate while held
    pool.set_pinned(ids[1], True)
    assert pool.eviction_candidates() == [ids[2], ids[3]]
    pool.release(pool.get(ids[0]))
    assert pool.eviction_candidates() == [ids[2], ids[3], ids[0]]
    used = pool.stats().used_bytes
    assert pool.drop(ids[2]) and pool.stats().used_bytes == used - PAGE_BYTES
    pool.close()


def test_a_failed_commit_does_not_drop_content_another_commit_registered():
    """Batch A writes content C; batch B deduplicates onto it and names it; then A fails. A
    frees what it wrote only if nobody registered it: here B did, so C stays."""
    from tensorcast.worker.pool import Pool

    pool = Pool(16 * PAGE_BYTES, name="tc-unit-pool-dedup")
    meta = TensorMeta("w", "U8", (4,), 4)
    first = pool.reserve(PAGE_BYTES)
    pool.region(first.offset, 4)[:] = b"same"
    cid = pool.commit(first.reservation_id, [meta]).content.content_id  # batch A
    second = pool.reserve(PAGE_BYTES)
    pool.region(second.offset, 4)[:] = b"same"
    assert pool.commit(second.reservation_id, [meta]).deduplicated  # batch B, onto A's
    pool.end_registration(cid, registered=True)  # B's batch is recorded
    pool.end_registration(cid, registered=False)  # A's failed
    assert not pool.drop(cid, unless_registered=True)
    assert bytes(pool.region(pool.get(cid).offset, 4)) == b"same"
    # Nobody registered it: A's failure frees it.
    other = pool.reserve(PAGE_BYTES)
    pool.region(other.offset, 4)[:] = b"solo"
    solo = pool.commit(other.reservation_id, [meta]).content.content_id
    pool.end_registration(solo, registered=False)
    assert pool.drop(solo, unless_registered=True)
    pool.close()


def test_order_sources_same_host_then_least_loaded():
    from tensorcast.placement import order_sources
    from tensorcast.types import ReplicaInfo, WorkerInfo

    def w(wid, host, transfers=0, used=0, alive=True):
        return WorkerInfo(
            wid, wid, "a:1", host, "", (), 100, used, 1, 0.0, 0.0, alive, "a:2", transfers
        )

    workers = [
        w("far-idle", "h2"),
        w("near-busy", "h1", 3),
        w("near-idle", "h1", 0, 50),
        w("near-emptier", "h1", 0, 10),
        w("dead", "h1", alive=False),
        w("me", "h1"),
    ]
    replicas = [ReplicaInfo(x.worker_id) for x in workers]
    order = [x.worker_id for x in order_sources(replicas, workers, "h1", exclude_worker_id="me")]
    assert order == ["near-emptier", "near-idle", "near-busy", "far-idle"]


def test_schema_migrates_a_v1_database_keeping_its_rows(tmp_path):
    import sqlite3

    import sqlite_utils

    from tensorcast.store import schema
    from tensorcast.store.sqlite_store import SqliteStore

    db = sqlite_utils.Database(sqlite3.connect(str(tmp_path / "old.db")))
    schema.MIGRATIONS[0](db)
    db.execute("PRAGMA user_version = 1")
    db.table("contents").insert(
        {"content_id": "c", "size_bytes": 1, "tensors": "[]", "created_at": 0.0}
    )
    db.table("artifacts").insert(
        {
            "art_id": "a",
            "content_id": "c",
            "owner": "system",
            "created_at": 0.0,
            "expires_at": None,
            "parent": "",
        }
    )
    db.conn.commit()
    db.conn.close()
    store = SqliteStore(tmp_path / "old.db", heartbeat_ttl_s=5)
    assert store.schema_version == schema.SCHEMA_VERSION >= 2
    assert store.get_artifact("a", now=1.0).content_id == "c"
    assert "pinned" in store.db.table("replicas").columns_dict
    store.close()


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_selected_span_covers_exactly_the_selected_elements(data):
    """The byte span a view of a by-reference tensor reads: from the first to the last
    selected element, checked against torch on the element indexes."""
    from tensorcast.worker.file_refs import _selected_span

    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    dims = []
    for size in shape[: data.draw(st.integers(0, len(shape)))]:
        start = data.draw(st.integers(0, size - 1))
        stop = data.draw(st.integers(start + 1, size))
        dims.append(DimSlice(start, stop, data.draw(st.integers(1, 3))))
    meta = TensorMeta("t", "F16", shape, 2 * int(torch.tensor(shape).prod()), 0)
    index = tuple(slice(d.start, d.stop, d.step) for d in dims)
    picked = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)[index].flatten()
    assert _selected_span(meta, dims) == (2 * int(picked.min()), 2 * int(picked.max()) + 2)


def test_store_fills_reference_hashes_once_then_refuses_different_ones(tmp_path):
    from tensorcast.errors import IntegrityError
    from tensorcast.store.base import WorkerRegistration
    from tensorcast.store.sqlite_store import SqliteStore

    store = SqliteStore(tmp_path / "s.db", 3.0)
    store.register_worker(
        WorkerRegistration("w", "w", "127.0.0.1:1", "h", "s", ("basic",), 1 << 20, 1), 100.0
    )
    bare = (TensorMeta("a", "U8", (4,), 4, 0), TensorMeta("b", "U8", (4,), 4, 64))
    store.add_replica("w", "r1-x", 68, bare, 100.0, tier="file")
    hashed = tuple(
        TensorMeta(t.name, t.dtype, t.shape, 4, t.offset_bytes, "h" + t.name) for t in bare
    )
    store.add_replica("w", "r1-x", 68, hashed, 100.0)
    assert store.find_content("r1-x", 100.0).tensors == hashed
    other = (hashed[0], TensorMeta("b", "U8", (4,), 4, 64, "changed"))
    with pytest.raises(IntegrityError):
        store.add_replica("w", "r1-x", 68, other, 100.0)
    info = store.find_content("r1-x", 100.0)
    assert info.tensors == hashed and {r.tier for r in info.replicas} == {"file", "cpu"}
    with pytest.raises(InvalidArgument, match="tier"):
        store.add_replica("w", "r1-x", 68, hashed, 100.0, tier="gpu")
    store.close()


def test_if_absent_keeps_only_a_live_home_page():
    from tensorcast.transport import native
    from tensorcast.worker.pages import PageStore, PageWrite
    from tensorcast.worker.pool import Pool

    pool = Pool(1 << 20)
    pages = PageStore(pool)

    def put(data: bytes, home: bool, if_absent: bool) -> None:
        w = PageWrite("k", 0, 1, "U8", (len(data),), 0, len(data), native.hash_buffer(data))
        pages.put([(w, data)], 60.0, home=home, if_absent=if_absent)

    def held() -> bytes:
        (page,) = pages.lookup([("k", 0, 0)])
        return pages.read(page)

    put(b"cached", home=False, if_absent=False)
    put(b"copied", home=True, if_absent=True)  # a cached copy does not win over a hand-off copy
    assert held() == b"copied"
    put(b"newer!", home=True, if_absent=False)
    put(b"copied", home=True, if_absent=True)  # a live home page does
    assert held() == b"newer!" and pages.stats()["pages"] == 1
    pages.close()
    pool.close()


def test_store_addresses_are_a_list_of_host_ports():
    from tensorcast.config import parse_store_addrs

    assert parse_store_addrs("h1:7400, h2:7401,") == ["h1:7400", "h2:7401"]
    for bad in ("", " , ", "h1:7400,h2", "h1:x", "h1:70000"):
        with pytest.raises(InvalidArgument):
            parse_store_addrs(bad)


_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(_json_values)
@settings(max_examples=200, deadline=None)
def test_cli_json_text_is_the_same_json(value):
    import json

    from tensorcast.cli.common import json_text

    assert json.loads(json_text(value)) == value


def test_cli_json_text_refuses_what_json_cannot_say():
    from tensorcast.cli.common import json_text

    for bad in (float("inf"), {"expires_at": float("-inf")}, [1, float("nan")]):
        with pytest.raises(ValueError):
            json_text(bad)


def test_cli_json_text_puts_each_listed_item_on_its_own_line():
    import json

    from tensorcast.cli.common import json_text

    data = {"b": [{"x": 1, "y": [1, 2]}, {"x": 2}], "a": {"k": "v"}, "c": []}
    lines = json_text(data).splitlines()
    assert lines == [
        "{",
        '  "a": {"k": "v"},',
        '  "b": [',
        '    {"x": 1, "y": [1, 2]},',
        '    {"x": 2}',
        "  ],",
        '  "c": []',
        "}",
    ]
    assert json_text([1, "two"]).splitlines() == ["[", "  1,", '  "two"', "]"]
    assert json.loads(json_text(data)) == data


def test_a_cluster_record_from_a_newer_tc_loads_without_its_unknown_fields(tmp_path):
    import json

    from tensorcast.sdk.cluster_file import CLUSTER_FILE, ClusterRecord

    store = {"role": "store", "name": "store", "pid": 1, "addr": "127.0.0.1:5", "log": "l"}
    data = {"store_addr": "127.0.0.1:5", "started_at": 1.0, "processes": [store]}
    data["processes"][0] = {**store, "frame_port": 7, "field_of_the_future": "x"}
    (tmp_path / CLUSTER_FILE).write_text(json.dumps(data))
    record = ClusterRecord.load(tmp_path)
    assert record is not None and record.processes[0].addr == "127.0.0.1:5"
    assert record.store_frame_ports() == {"127.0.0.1:5": 7}


def test_buffer_pool_reuses_by_size_and_keeps_at_most_its_bound():
    from tensorcast.buffer_pool import BufferPool

    pool = BufferPool(max_idle_bytes=3 * 1024)
    a, b = pool.take([1024, 2048])
    assert (len(a), len(b)) == (1024, 2048)
    pool.give([a, b])
    assert pool.idle_bytes == 3072
    again = pool.take([2048, 1024, 1024])
    assert again[0] is b and again[1] is a  # the same memory, found by size
    assert again[2] is not a and len(again[2]) == 1024  # none idle left: a new one
    assert pool.idle_bytes == 0
    pool.give([*again, bytearray(512)])  # 4.5 KiB offered: what passes the bound is dropped
    assert pool.idle_bytes == 3072


def test_a_lease_table_older_than_a_hand_off_never_brings_the_lease_back():
    """A hand-off's reply and a refresh's may land in any order, and a refresh sent later may
    still describe the store before the hand-off: a shard's entry is taken only when newer
    (fencing token first, then when its request was sent)."""
    from tensorcast.errors import FencingError
    from tensorcast.types import ShardLease, ShardTable
    from tensorcast.worker.leases import LeaseCache

    def table(token: int, holder: str) -> ShardTable:
        return ShardTable(1, 10.0, (ShardLease(0, holder, token, 10.0),))

    t0 = time.monotonic()  # requests "sent" just now: their leases run 10 s from then

    for order in ("hand-off first", "refresh first"):
        cache = LeaseCache("me")
        assert cache.update(table(5, "me"), sent_at=t0 + 1.0) == {}
        cache.check(0, 5)
        # The hand-off's reply, and a refresh sent after it that saw the store before it.
        replies = [(table(6, "other"), t0 + 2.0), (table(5, "me"), t0 + 3.0)]
        if order == "refresh first":
            replies.reverse()
        lost: dict = {}
        for reply, sent_at in replies:
            lost |= cache.update(reply, sent_at)
        assert lost == {0: None}, order
        with pytest.raises(FencingError):
            cache.check(0, 5)
        assert cache.held() == {}
    # A renewal under the same token extends the lease; the newer one wins.
    cache = LeaseCache("me")
    cache.update(table(7, "me"), sent_at=t0 + 1.0)
    cache.update(table(7, "me"), sent_at=t0 + 2.0)
    cache.update(table(7, "other"), sent_at=t0 + 1.5)  # older, same token: ignored
    assert cache.held() == {0: 7}


def test_a_lapsed_lease_keeps_its_pages_unless_another_home_held_the_shard_meanwhile():
    """The store unreachable for longer than the lease TTL: the lease lapses still naming this
    worker, which stops serving the shard but keeps its pages (nobody else wrote it) and takes
    it back under the next token. Taken back under a later token, another home held it
    meanwhile (its table never reached this worker): the pages written before are stale."""
    from tensorcast.errors import FencingError
    from tensorcast.types import ShardLease, ShardTable
    from tensorcast.worker.leases import LeaseCache

    def table(token: int, holder: str, expires_in_s: float = 10.0) -> ShardTable:
        return ShardTable(1, 10.0, (ShardLease(0, holder, token, expires_in_s),))

    t0 = time.monotonic()
    cache = LeaseCache("me")
    assert cache.update(table(5, "me"), t0 + 1.0) == {}
    assert cache.update(table(5, "me", -1.0), t0 + 2.0) == {}  # lapsed, nobody else: kept
    with pytest.raises(FencingError):
        cache.check(0, 5)  # but not served
    assert cache.update(table(6, "me"), t0 + 3.0) == {}  # taken back next: the pages hold
    assert cache.held() == {0: 6}
    assert cache.update(table(8, "me"), t0 + 4.0) == {0: 6}  # token 7 was another home's
    assert cache.update(table(9, "other"), t0 + 5.0) == {0: None}  # another home: all go
    assert cache.update(table(9, "other", -1.0), t0 + 6.0) == {}  # nothing of ours left


def test_a_shard_being_handed_off_is_not_served_and_keeps_its_pages_for_the_copy():
    """A hand-off stops serving the shard before the store moves the lease (never two homes
    taking writes): no table from before the move serves it again, a table naming the new
    home drops nothing (the copy needs the pages), and a refused hand-off serves it again."""
    from tensorcast.errors import FencingError
    from tensorcast.types import ShardLease, ShardTable
    from tensorcast.worker.leases import LeaseCache

    def table(token: int, holder: str) -> ShardTable:
        return ShardTable(1, 10.0, (ShardLease(0, holder, token, 10.0),))

    t0 = time.monotonic()
    published: list[dict] = []
    cache = LeaseCache("me", publish=lambda held: published.append(dict(held)))
    cache.update(table(5, "me"), t0 + 1.0)
    assert cache.begin_hand_off(0, 5)
    assert not cache.begin_hand_off(0, 5)  # one hand-off at a time
    assert published[-1] == {}  # the native page index stops serving it too
    with pytest.raises(FencingError):
        cache.check(0, 5)
    assert cache.update(table(5, "me"), t0 + 2.0) == {}  # a refresh from before the move
    assert cache.held() == {}
    assert cache.update(table(6, "other"), t0 + 3.0) == {}  # moved: the pages stay for now
    cache.end_hand_off(0, moved=True)
    assert cache.held() == {} and cache.update(table(6, "other"), t0 + 4.0) == {}

    refused = LeaseCache("me")
    refused.update(table(5, "me"), t0 + 1.0)
    assert refused.begin_hand_off(0, 5) and refused.held() == {}
    refused.end_hand_off(0, moved=False)
    assert refused.held() == {0: 5}
    refused.check(0, 5)
    assert not refused.begin_hand_off(0, 4)  # not held under that token


def test_after_a_store_outage_a_home_bids_for_its_own_shards_not_for_the_others():
    """Every lease lapsed during an outage: a home bids at once for the shards it held (their
    pages are there), never for a shard another live home held (that home takes it back),
    and for a gone home's shard only once it has reached the store for a lease TTL (the
    other homes come back within it)."""
    from tensorcast.sharding import hrw_rank
    from tensorcast.types import ShardLease, ShardTable
    from tensorcast.worker.leases import LeaseCache

    homes = ("me", "peer", "gone")
    lapsed = {0: "me", 1: "peer", 2: "gone", 3: ""}  # shard -> who held it before the outage
    both = tuple(h for h in homes if h != "gone")
    table = ShardTable(
        4, 5.0, tuple(ShardLease(s, h, 3, -20.0) for s, h in lapsed.items()), ("me", "peer")
    )
    cache = LeaseCache("me")
    cache.update(table, time.monotonic())
    assert set(cache.to_acquire(1.0, store_reached_for_s=0.5)) == {0} | {
        s for s in (3,) if hrw_rank(s, both).index("me") < 3
    }
    assert set(cache.to_acquire(1.0, store_reached_for_s=6.0)) == {0, 2, 3}
    alone = ShardTable(4, 5.0, table.leases, ("me",))  # the first to beat after the outage
    cache.update(alone, time.monotonic())
    assert set(cache.to_acquire(1.0, store_reached_for_s=0.5)) == {0, 3}


def test_two_threads_spilling_one_content_both_finish_and_the_file_is_whole(tmp_path):
    """A spill and a persist of the same content at once each write a file of their own and
    rename it into place: neither fails on the other's temporary, and the result is whole."""
    import threading

    from tensorcast.worker.disk_tier import DiskTier

    tier = DiskTier(tmp_path / "disk")
    meta = TensorMeta("w", "U8", (1 << 20,), 1 << 20)
    data = memoryview(bytes(range(256)) * 4096)
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def spill() -> None:
        start.wait()
        try:
            for _ in range(20):
                tier.save("c1-same", (meta,), data)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=spill) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    dest = bytearray(len(data))
    tier.read_into("c1-same", memoryview(dest), 0)
    assert dest == data
    assert not list((tmp_path / "disk").glob("*.tmp"))


def test_tc_up_waits_for_new_workers_long_enough_to_prefault_their_pools():
    """Workers fault their whole pool in before they report ready (a fresh 2 GiB pool took
    3.7 s on the 2-core CI VM, ~0.55 GiB/s, all workers sharing that bandwidth): `tc up` must
    not kill a big worker as it would a hung one."""
    from tensorcast.sdk.local_cluster import START_TIMEOUT_S, start_timeout_s

    measured_rate = (2 << 30) / 3.7
    assert start_timeout_s(1, "64MiB") < START_TIMEOUT_S + 1  # small pools: the usual wait
    for workers, mem in ((1, "256GiB"), (4, "64GiB"), (8, "8GiB")):
        prefault_s = workers * parse_size(mem) / measured_rate
        assert start_timeout_s(workers, mem) >= START_TIMEOUT_S + 2 * prefault_s


def test_the_disk_tier_sums_files_that_may_go_while_it_looks(tmp_path):
    """A load back into memory deletes its file, on another thread: one gone between glob and
    stat raised FileNotFoundError, out of the heartbeat (which then stopped for good)."""
    from tensorcast.worker.disk_tier import SUFFIX, DiskTier

    tier = DiskTier(tmp_path / "disk")
    (tier.directory / f"kept{SUFFIX}").write_bytes(b"x" * 10)

    class Listing:  # lists a file that is gone by the time it is looked at
        def glob(self, pattern: str):
            return [tier_dir / f"kept{SUFFIX}", tier_dir / f"gone{SUFFIX}"]

    tier_dir = tier.directory
    tier.directory = Listing()  # type: ignore[assignment]
    assert tier.used_bytes() == 10


def test_a_bug_in_one_heartbeat_does_not_end_the_heartbeats():
    """Only `stop` ends the heartbeat loop: an exception that is no TensorcastError (a bug, an
    OSError) is logged and the next beat runs (the thread died, and the store counted the
    worker dead and all it held lost while the process went on serving)."""
    import threading
    import types

    from tensorcast.worker.node import WorkerNode

    stop = threading.Event()
    beats = []

    def beat() -> None:
        beats.append(time.monotonic())
        if len(beats) == 1:
            raise FileNotFoundError("a file that went")
        if len(beats) == 3:
            stop.set()

    node = types.SimpleNamespace(
        _stop=stop,
        pages=types.SimpleNamespace(expire=lambda: 0),
        heartbeat_once=beat,
        store=types.SimpleNamespace(current_addr="store"),
    )
    loop = threading.Thread(target=WorkerNode.heartbeat_loop, args=(node, 0.01, lambda: None))
    loop.start()
    loop.join(30)
    assert not loop.is_alive() and len(beats) == 3
