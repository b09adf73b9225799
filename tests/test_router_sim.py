"""The emulated engine (tensorcast/engine/sim.py): prefix cache, LRU, scheduling lower bounds,
KV export/import with real bytes, SGLang's HTTP API, shared prefixes through TensorCast pages,
and `tc instance start --engine sim` instances migrated with `tc migrate` on a real cluster."""

from __future__ import annotations

import dataclasses
import http.client
import json
import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch
from conftest import wait_until

from tensorcast.adaptors import KVExport
from tensorcast.engine.server import engine_request
from tensorcast.engine.sglang_api import SimHTTPServer
from tensorcast.engine.sim import (
    CostModel,
    PrefixCache,
    SimConfig,
    SimEngine,
    block_data,
    block_keys,
    tokenize,
)
from tensorcast.errors import (
    AlreadyExists,
    IntegrityError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)

FAST = SimConfig(page_tokens=8, cache_tokens=4096, time_scale=1000.0, kv_bytes_per_token=64)
# Blocks of 256 KiB: one block per exported page, so an export in parts has pages in each.
PAGED = SimConfig(page_tokens=8, cache_tokens=2048, time_scale=1000.0, kv_bytes_per_token=32768)
SYSTEM = list(range(100, 164))  # 64 tokens every session shares (8 blocks)


def context(session: int, length: int) -> list[int]:
    return SYSTEM + [(session * 7919 + i) % 30000 for i in range(length)]


@pytest.fixture
def engine():
    e = SimEngine(FAST).start()
    yield e
    e.close()


@contextmanager
def two_engines(config: SimConfig):
    a, b = SimEngine(config).start(), SimEngine(config).start()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def run(engine: SimEngine, tokens, n=4, session="s"):
    job = engine.submit(tokens, n, session=session)
    job.wait_done(30)
    return job


def test_second_turn_hits_the_prefix_cache(engine):
    first = run(engine, context(1, 100), session="a")
    assert first.cached_tokens == 0 and len(first.outputs) == 4
    # The next turn: previous context + its output + new tokens. Every full block of the
    # previous context (164 + 4 tokens -> 21 blocks of 8) is a hit.
    second = run(engine, first.tokens + first.outputs + [5] * 40, session="a")
    assert second.cached_tokens == 21 * 8
    # Same prompt, another session: the shared system prompt and the rest are hits too.
    other = run(engine, context(2, 100), session="b")
    assert other.cached_tokens == 64  # only the 8 system blocks
    assert engine.counters["requests"] == 3


def test_lru_evicts_tails_first_and_keeps_the_shared_prefix():
    config = SimConfig(page_tokens=8, cache_tokens=512, time_scale=1000.0, kv_bytes_per_token=8)
    e = SimEngine(config).start()
    try:
        a = run(e, context(1, 200), session="a")  # 264 + 4 tokens = 33 blocks of 64
        for s in range(2, 6):  # 4 more sessions of 25 own blocks each: over the 64 blocks
            run(e, context(s, 200), session=f"s{s}")
        assert len(e.cache) <= 64 and e.cache.evictions > 0
        again = run(e, a.tokens + a.outputs, session="a")
        # Its tail went first: what is left is a prefix (the system prompt at least).
        assert 64 <= again.cached_tokens < 264
        keys = block_keys(context(1, 200), 8)
        assert keys[0] in e.cache and keys[7] in e.cache  # the shared system prompt stayed
    finally:
        e.close()


def test_the_cache_reuses_the_buffers_of_evicted_blocks_and_never_serves_stale_bytes():
    cache = PrefixCache(capacity_blocks=4, block_bytes=16)
    keys = [bytes([i]) * 16 for i in range(8)]
    for key in keys[:4]:
        cache.insert(key, block_data(key, 16))
    first = {k: cache.get(k) for k in keys[:4]}
    for key in keys[4:]:  # each insert evicts the oldest block and takes over its buffer
        cache.insert(key, block_data(key, 16))
    assert len(cache) == 4 and cache.evictions == 4
    reused = {id(cache.get(k)) for k in keys[4:]}
    assert reused == {id(b) for b in first.values()}  # no new memory
    for key in keys[4:]:
        assert cache.get(key) == block_data(key, 16)  # its own bytes, not the evicted block's
    # Buffers taken for an import that fails go back; spares never exceed the capacity.
    taken = cache.take_buffers(6)
    assert len(taken) == 6
    for buffer in taken:
        cache.release(buffer)
    assert len(cache.take_buffers(4)) == 4 and len(cache) == 4


def test_an_export_is_a_copy_that_outlives_the_blocks_it_came_from():
    a = SimEngine(FAST).start()
    try:
        run(a, context(6, 100), session="old")
        export = a.export_kv("old")
        before = {name: bytes(page.numpy()) for name, page in export.pages.items()}
        a.evict("old")
        a.flush()
        for s in range(7, 10):  # new blocks land in the evicted blocks' buffers
            run(a, context(s, 100), session=f"s{s}")
        assert {name: bytes(page.numpy()) for name, page in export.pages.items()} == before
        b = SimEngine(FAST).start()
        try:
            b.import_kv("old", export)
            assert b.load().requests == ("old",)
        finally:
            b.close()
    finally:
        a.close()


def test_a_released_export_lends_its_memory_to_the_next_export():
    with two_engines(FAST) as (a, b):  # pages of many blocks: copies
        run(a, context(11, 100), session="one")
        run(a, context(12, 100), session="two")
        first = a.export_kv("one")
        memory = {p.data_ptr() for p in first.pages.values()}
        b.import_kv("one", first)
        assert first.release is not None
        first.release()
        second = a.export_kv("two")  # into the buffers `first` gave back, holding its own bytes
        assert {p.data_ptr() for p in second.pages.values()} <= memory
        b.import_kv("two", second)  # every block checked against its tokens: no stale bytes
        assert sorted(b.load().requests) == ["one", "two"]


def test_an_export_of_one_block_pages_lends_the_blocks_until_released():
    with two_engines(PAGED) as (a, b):
        run(a, context(13, 100), session="one")
        export = a.export_kv("one")
        blocks = export.meta["blocks"]
        keys = a._sessions["one"].keys[:blocks]
        # No copy: each page is the engine's own block buffer.
        assert [p.data_ptr() for p in export.pages.values()] == [
            torch.frombuffer(a.cache.get(k), dtype=torch.uint8).data_ptr() for k in keys
        ]
        before = {name: bytes(page.numpy()) for name, page in export.pages.items()}
        a.evict("one")
        assert a.flush() == 0 and len(a.cache) == blocks  # lent blocks are locked: kept
        run(a, context(14, 100), session="two")  # new blocks go elsewhere
        assert {name: bytes(page.numpy()) for name, page in export.pages.items()} == before
        b.import_kv("one", export)
        assert export.release is not None
        export.release()
        export.release()  # once is what counts
        assert a.cache.locked_blocks == 0
        a.evict("two")
        a.flush()
        assert len(a.cache) == 0  # released: evictable again
        assert b.load().requests == ("one",)


def test_an_import_keeps_the_block_buffers_it_lent_without_a_copy():
    with two_engines(PAGED) as (a, b):
        run(a, context(15, 100), session="s")
        export = a.export_kv_part("s", 0, 2)
        lent = b.import_buffers("s", 0, 2, export.meta)
        assert lent is not None and sorted(lent.pages) == sorted(export.pages)
        for name, page in export.pages.items():
            lent.pages[name].copy_(page)  # what hydrate's read does
        pages = dict(lent.pages)
        page = next(iter(pages))
        pages[page] = export.pages[page].clone()  # one page not lent: copied as before
        assert b.import_kv_part("s", 0, 2, KVExport(pages, export.meta)) is False
        assert lent.release is not None
        lent.release()  # the kept buffers stay kept; the one the import did not use goes back
        kept = b.counters["imported_in_place_bytes"]
        assert kept == (len(pages) - 1) * PAGED.block_bytes
        assert b.counters["imported_bytes"] == len(pages) * PAGED.block_bytes
        rest = a.export_kv_part("s", 1, 2)
        assert b.import_kv_part("s", 1, 2, rest) is True
        assert b.load().requests == ("s",)
        # Lent and never imported (a read that failed): all of them go back to the cache.
        spare = len(b.cache._spare)
        unused = b.import_buffers("x", 0, 1, export.meta)
        assert unused is not None and unused.release is not None
        unused.release()
        assert len(b.cache._spare) == spare + len(unused.pages) and b._lent == {}
        # A corrupt lent page is refused like any other, and its buffer goes back.
        whole = a.export_kv("s")
        bad = b.import_buffers("y", 0, 1, whole.meta)
        assert bad is not None
        for name, p in whole.pages.items():
            bad.pages[name].copy_(p)
        bad.pages["p3"][7] ^= 0xFF
        with pytest.raises(IntegrityError):
            b.import_kv_part("y", 0, 1, KVExport(dict(bad.pages), bad.meta))
        assert bad.release is not None
        bad.release()
        assert b._lent == {} and "y" not in b.load().requests


def test_time_to_first_token_is_at_least_the_modelled_prefill():
    """Lower bounds only: the emulator waits the modelled time (more when the host is busy)."""
    cost = CostModel(prefill_base_s=0.0, prefill_per_token_s=0.0005, prefill_per_context_token_s=0)
    config = SimConfig(cost=cost, page_tokens=8, cache_tokens=8192, time_scale=1.0)
    e = SimEngine(config).start()
    try:
        miss = run(e, context(1, 600), n=1, session="a")  # 664 uncached tokens: >= 0.332 s
        assert miss.first_token_at - miss.arrived_at >= 664 * 0.0005
        hit = run(e, miss.tokens + miss.outputs + [1] * 15, n=1, session="a")
        uncached = len(hit.tokens) - hit.cached_tokens
        assert uncached < 30
        assert hit.first_token_at - hit.arrived_at >= uncached * 0.0005
    finally:
        e.close()


def test_export_import_moves_real_bytes_and_the_next_turn_hits():
    with two_engines(FAST) as (a, b):
        first = run(a, context(3, 150), session="sess")
        export = a.export_kv("sess")
        blocks = export.meta["blocks"]
        assert blocks == (214 + 4) // 8
        size = sum(p.numel() for p in export.pages.values())
        assert size == blocks * 8 * 64  # page_tokens x kv_bytes_per_token per block
        b.import_kv("sess", export)
        assert b.load().requests == ("sess",)
        (stat,) = b.request_stats()
        assert stat.req_id == "sess" and stat.migrations == 1 and stat.tokens == blocks * 8
        nxt = run(b, first.tokens + first.outputs + [9] * 20, session="sess")
        assert nxt.cached_tokens == blocks * 8
        with pytest.raises(AlreadyExists):
            b.import_kv("sess", export)
        # Evicting drops the session's own blocks; the system prompt another session holds stays.
        run(a, context(4, 30), session="other")
        before = len(a.cache)
        assert a.evict("sess") is True
        assert len(a.cache) == before - (blocks - 8)
        assert "sess" not in a.load().requests
        assert a.evict("sess") is False
        with pytest.raises(NotFound):
            a.export_kv("sess")


def test_import_rejects_bad_exports(engine):
    run(engine, context(5, 60), session="x")
    good = engine.export_kv("x")
    other = SimEngine(FAST).start()
    try:
        bad_meta = dict(good.meta, page_tokens=16)
        with pytest.raises(InvalidArgument, match="page_tokens"):
            other.import_kv("x", KVExport(good.pages, bad_meta))
        with pytest.raises(InvalidArgument, match="pages must be exactly"):
            other.import_kv("x", KVExport({}, good.meta))
        page = good.pages["p0"].clone()
        page[100] ^= 0xFF
        with pytest.raises(IntegrityError):
            other.import_kv("x", KVExport({"p0": page}, good.meta))
        with pytest.raises(InvalidArgument, match="tokens"):
            other.import_kv("x", KVExport(good.pages, dict(good.meta, tokens=[-1])))
        assert other.load().requests == () and len(other.cache) == 0  # nothing half-imported
    finally:
        other.close()


def test_an_export_in_parts_imports_in_any_order_and_is_resident_only_when_complete():
    with two_engines(PAGED) as (a, b):
        first = run(a, context(8, 150), session="sess")
        whole = a.export_kv("sess")
        parts = [a.export_kv_part("sess", k, 3) for k in range(3)]
        assert all(p.meta == whole.meta for p in parts)
        names = [n for p in parts for n in p.pages]
        assert sorted(names) == sorted(whole.pages) and len(names) == len(set(names))
        assert [len(p.pages) for p in parts] == [9, 9, 9]  # 27 blocks, one per page
        assert b.import_kv_part("sess", 2, 3, parts[2]) is False
        assert b.import_kv_part("sess", 0, 3, parts[0]) is False
        assert b.import_kv_part("sess", 0, 3, parts[0]) is False  # sent again: replaces, no dup
        assert b.load().requests == ()  # not resident while a part is missing
        assert b.import_kv_part("sess", 1, 3, parts[1]) is True
        assert b.load().requests == ("sess",)
        blocks = whole.meta["blocks"]
        assert len(b.cache) == blocks
        # A part of this attempt arriving once it is resident (a retry raced the parts parked
        # by a cut-off one): nothing to add, no error.
        assert b.import_kv_part("sess", 0, 3, parts[0]) is True
        assert len(b.cache) == blocks and b.load().requests == ("sess",)
        nxt = run(b, first.tokens + first.outputs + [9] * 20, session="sess")
        assert nxt.cached_tokens == blocks * 8
        with pytest.raises(AlreadyExists):  # resident: a new attempt's first part is refused
            b.import_kv_part("sess", 0, 3, parts[0])
        with pytest.raises(InvalidArgument, match="part"):
            a.export_kv_part("sess", 3, 3)
        with pytest.raises(InvalidArgument, match="part 1 of 3 must be exactly"):
            b.import_kv_part("other", 1, 3, parts[0])  # part 0's pages sent as part 1


def test_parts_of_an_unfinished_import_never_hold_buffers_for_ever(monkeypatch):
    import tensorcast.engine.sim as sim

    with two_engines(PAGED) as (a, b):
        run(a, context(9, 150), session="s")
        parts = [a.export_kv_part("s", k, 2) for k in range(2)]
        assert b.import_kv_part("s", 0, 2, parts[0]) is False
        assert b.evict("s") is False  # not resident, but its staged part is dropped
        assert b.import_kv_part("s", 1, 2, parts[1]) is False  # so part 1 alone completes nothing
        # A part of the same request cut differently (another attempt) starts over.
        thirds = [a.export_kv_part("s", k, 3) for k in range(3)]
        assert b.import_kv_part("s", 0, 3, thirds[0]) is False
        assert b.import_kv_part("s", 1, 3, thirds[1]) is False
        assert b.import_kv_part("s", 1, 2, parts[1]) is False  # dropped the thirds
        assert b.import_kv_part("s", 2, 3, thirds[2]) is False  # ... and restarted again
        assert b.load().requests == ()
        # Expired staging goes at the next import; the number waiting at once is bounded.
        monkeypatch.setattr(sim, "STAGED_TTL_S", -1.0)
        assert b.import_kv_part("s", 0, 2, parts[0]) is False
        assert b.import_kv_part("s", 1, 2, parts[1]) is False  # part 0 had expired
        monkeypatch.setattr(sim, "STAGED_TTL_S", 60.0)
        monkeypatch.setattr(sim, "MAX_STAGED", 2)
        for i in range(2):
            run(a, context(20 + i, 40), session=f"x{i}")
            assert b.import_kv_part(f"x{i}", 0, 2, a.export_kv_part(f"x{i}", 0, 2)) is False
        with pytest.raises(ResourceExhausted):
            b.import_kv_part("s", 0, 2, parts[0])
        assert b.load().requests == ()


def test_bad_requests_and_config():
    with pytest.raises(InvalidArgument):
        SimConfig(page_tokens=0)
    with pytest.raises(InvalidArgument):
        SimConfig(time_scale=0)
    with pytest.raises(InvalidArgument):
        SimConfig(cost=CostModel(decode_base_s=-1))
    e = SimEngine(FAST)
    with pytest.raises(InvalidArgument):
        e.submit([], 4)
    with pytest.raises(InvalidArgument):
        e.submit([1, 2, 10**9], 4)
    with pytest.raises(InvalidArgument):
        e.submit([1, 2], 0)
    # Past the context: refused (one huge prompt's prefill held every other request).
    small = SimEngine(dataclasses.replace(FAST, max_context_tokens=64))
    try:
        with pytest.raises(InvalidArgument, match="context of 64 tokens"):
            small.submit([1] * 60, 5)
        assert small.submit([1] * 60, 4).rid
    finally:
        small.close()


def test_tokenizer_round_trips_its_own_words():
    assert tokenize("t5 t17 t31999", 32000) == [5, 17, 31999]
    assert tokenize("hello world", 32000) == tokenize("hello  world", 32000)
    data = block_data(b"k" * 16, 40)
    assert len(data) == 40 and data[:16] == b"k" * 16


def _post(addr: str, path: str, body, headers=None):
    conn = http.client.HTTPConnection(*addr.split(":"), timeout=30)
    conn.request(
        "POST", path, json.dumps(body), {"Content-Type": "application/json", **(headers or {})}
    )
    response = conn.getresponse()
    return response.status, response.read()


def test_sglang_http_api(engine):
    with SimHTTPServer(engine) as server:
        addr = server.addr
        assert engine_request(addr, "GET", "/health") == {}
        load = engine_request(addr, "GET", "/get_load")
        assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
        info = engine_request(addr, "GET", "/server_info")
        assert info["engine"] == "sim" and info["config"]["page_tokens"] == 8
        assert engine_request(addr, "GET", "/get_model_info")["is_generation"] is True

        body = {
            "input_ids": context(6, 40),
            "rid": "r1",
            "sampling_params": {"max_new_tokens": 5},
            "session_params": {"id": "sess-6"},
        }
        status, raw = _post(addr, "/generate", body)
        reply = json.loads(raw)
        assert status == 200 and len(reply["output_ids"]) == 5
        assert reply["meta_info"]["id"] == "r1" and reply["meta_info"]["prompt_tokens"] == 104
        assert reply["text"] == " ".join(f"t{i}" for i in reply["output_ids"])

        # Streaming: chunked server-sent events, first token first, [DONE] last.
        nxt = dict(body, rid="r2", stream=True, input_ids=body["input_ids"] + reply["output_ids"])
        status, raw = _post(addr, "/generate", nxt)
        events = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
        assert status == 200 and events[-1] == b"[DONE]"
        first, last = json.loads(events[0]), json.loads(events[-2])
        assert len(first["output_ids"]) == 1 and len(last["output_ids"]) == 5
        assert last["output_ids"][0] == first["output_ids"][0]
        assert last["meta_info"]["cached_tokens"] == 104  # the whole first turn, 13 blocks

        # The session is what /requests and our own API see.
        stats = engine_request(addr, "GET", "/requests")["requests"]
        assert [s["req_id"] for s in stats] == ["sess-6"]
        assert stats[0]["tokens"] == 14 * 8  # 109 + 5 tokens
        own = engine_request(
            addr, "POST", "/generate", {"req_id": "sess-6", "prompt_ids": None, "max_new_tokens": 2}
        )
        assert len(own["tokens"]) == 2

        for bad in (
            {"sampling_params": {"max_new_tokens": 3}},  # neither text nor input_ids
            {"text": "a", "input_ids": [1]},
            {"input_ids": [[1, 2], [3]]},  # batches
            {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "x"}},
            {"input_ids": [1, 2], "sampling_params": []},
        ):
            status, raw = _post(addr, "/generate", bad)
            assert status == 400 and json.loads(raw)["error"] == "InvalidArgument", bad
        status, raw = _post(addr, "/nowhere", {})
        assert status == 404
        conn = http.client.HTTPConnection(*addr.split(":"), timeout=30)
        conn.request("POST", "/generate", b"{not json", {"Content-Type": "application/json"})
        assert conn.getresponse().status == 400


def test_sglang_http_api_never_reads_a_body_as_a_request_nor_waits_for_ever(engine, monkeypatch):
    import socket

    from tensorcast.engine import server as own_api
    from tensorcast.engine import sglang_api

    for handler in (sglang_api._Handler, own_api._Handler):  # both servers bound every read
        assert handler.timeout is not None and 0 < handler.timeout <= 300
    monkeypatch.setattr(sglang_api._Handler, "timeout", 1.0)
    with SimHTTPServer(engine) as server:
        host, port = server.addr.split(":")
        smuggled = b"POST /flush_cache HTTP/1.1\r\nContent-Length: 0\r\n\r\n"
        head = f"POST /nope HTTP/1.1\r\nHost: x\r\nContent-Length: {len(smuggled)}\r\n\r\n"
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(head.encode() + smuggled)  # an unknown route's body: a request in it
            replies = b""
            while chunk := s.recv(65536):  # until the server closes the connection
                replies += chunk
        assert replies.startswith(b"HTTP/1.1 404") and replies.count(b"HTTP/1.1") == 1
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            replies = b""
            while chunk := s.recv(65536):  # the rest never comes: an error, then closed
                replies += chunk
        assert replies.startswith(b"HTTP/1.1 5")


def test_full_queue_is_resource_exhausted(monkeypatch):
    import tensorcast.engine.sim as sim

    monkeypatch.setattr(sim, "MAX_WAITING", 2)
    e = SimEngine(FAST)  # not started: nothing leaves the queue
    e.submit([1, 2, 3], 1)
    e.submit([1, 2, 3], 1)
    with pytest.raises(ResourceExhausted):
        e.submit([1, 2, 3], 1)


# -- with a cluster ------------------------------------------------------------------------------


def test_shared_prefixes_through_tensorcast_pages(cluster):
    from tensorcast.engine.kv_share import TensorCastKVStore, open_store

    rt = cluster.connect()
    writer_store, reader_store = TensorCastKVStore(rt), TensorCastKVStore(rt)
    a = SimEngine(FAST, writer_store).start()
    b = SimEngine(FAST, reader_store).start()
    try:
        tokens = context(11, 300)
        run(a, tokens, session="w")
        keys = [f"sim/{k.hex()}" for k in block_keys(tokens, 8)]
        wait_until(lambda: all(writer_store.exists(keys)), 30)  # written behind the scheduler
        job = run(b, tokens + [7] * 9, session="r")
        assert job.fetched_tokens == len(keys) * 8
        assert job.cached_tokens == len(keys) * 8
        assert b.counters["fetched_tokens"] == len(keys) * 8
        # Under another prefix (another benchmark run) none of it is there; under the same, all.
        other, same = open_store("tensorcast?prefix=run-2/", rt), open_store("tensorcast", rt)
        assert not any(other.exists(keys)) and all(same.exists(keys))
        other.close()
        same.close()
    finally:
        a.close()
        b.close()
        writer_store.close()
        reader_store.close()
        rt.close()


def start_sim_instance(
    cluster, iid: str, worker: str, *extra: str, kv_bytes_per_token: int = 64
) -> tuple[subprocess.Popen, str]:
    ready = cluster.state_dir / f"{iid}.ready"
    ready.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorcast.cli.main",
            "instance",
            "start",
            "--engine",
            "sim",
            "--worker",
            worker,
            "--id",
            iid,
            "--page-tokens",
            "8",
            "--kv-bytes-per-token",
            str(kv_bytes_per_token),
            "--time-scale",
            "1000",
            "--load-interval",
            "0.1",
            "--ready-file",
            str(ready),
            "--state-dir",
            str(cluster.state_dir),
            *extra,
        ],
        stdout=open(cluster.state_dir / f"{iid}.log", "w"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
    )
    wait_until(lambda: ready.exists() or proc.poll() is not None, 60)
    assert proc.poll() is None, (cluster.state_dir / f"{iid}.log").read_text()[-3000:]
    return proc, json.loads(ready.read_text())["endpoint"]


@pytest.fixture(scope="module")
def sims(cluster):
    procs, endpoints = [], {}
    try:
        for iid, worker in (("sim-a", "worker-1"), ("sim-b", "worker-2")):
            # 256 KiB blocks: one per exported page, so a migration in parts has pages in each
            proc, endpoint = start_sim_instance(cluster, iid, worker, kv_bytes_per_token=32768)
            procs.append(proc)
            endpoints[iid] = endpoint
        with cluster.connect() as rt:
            wait_until(
                lambda: {i.instance_id for i in rt.instances() if i.alive} >= set(endpoints), 20
            )
        yield endpoints
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


def sglang_generate(endpoint: str, session: str, ids: list[int], n: int = 4) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": n},
        "session_params": {"id": session},
    }
    return engine_request(endpoint, "POST", "/generate", body)


@pytest.mark.parametrize("parts", [1, 3])
def test_migrate_a_sim_session_moves_its_kv_bytes(cluster, sims, parts):
    a, b = sims["sim-a"], sims["sim-b"]
    session = f"mig-{parts}"
    first = sglang_generate(a, session, context(21 + parts, 200))
    in_place = engine_request(b, "GET", "/server_info")["counters"]["imported_in_place_bytes"]
    proc = cluster.tc(
        "migrate", session, "--from", "sim-a", "--to", "sim-b", "--parts", str(parts), "--json"
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    ops = [s["op"] for s in result["steps"]]
    assert ops == ["publish", "prefetch_many", "hydrate"] * parts + ["evict"]
    blocks = (264 + 4) // 8
    published = [s["result"] for s in result["steps"] if s["op"] == "publish"]
    hydrated = [s["result"] for s in result["steps"] if s["op"] == "hydrate"]
    # Each part carries its own pages (plus its manifest): together every block, once.
    keys = [p["key"] for r in published for p in r["pages"] if "manifest" not in p["key"]]
    assert len(keys) == len(set(keys)) == blocks
    assert all(r["pages"] > 1 for r in hydrated)  # a third of the blocks each
    assert sum(r["bytes"] for r in hydrated) == blocks * 8 * 32768
    assert [r["resident"] for r in hydrated].count(True) == 1  # resident once, when complete
    # Hydrate read every page straight into the target's block buffers: no copy on import.
    counters = engine_request(b, "GET", "/server_info")["counters"]
    assert counters["imported_in_place_bytes"] - in_place == blocks * 8 * 32768
    nxt = sglang_generate(b, session, context(21 + parts, 200) + first["output_ids"] + [3] * 10)
    assert nxt["meta_info"]["cached_tokens"] == blocks * 8
    assert engine_request(a, "GET", "/requests")["requests"] == []  # evicted from the source
    stats = engine_request(b, "GET", "/requests")["requests"]
    assert [(s["req_id"], s["migrations"]) for s in stats if s["req_id"] == session] == [
        (session, 1)
    ]
    engine_request(b, "POST", "/evict", {"req_id": session})


def test_a_migration_cut_off_between_parts_leaves_the_source_whole(cluster, sims):
    """What a failure half-way leaves: the parts that arrived stay parked (not resident), the
    source still serves the session, and the next attempt moves it whole."""
    import tensorcast as tc
    from tensorcast.sdk.migrate import migrate

    a, b = sims["sim-a"], sims["sim-b"]
    ids = context(40, 200)
    first = sglang_generate(a, "cut", ids)
    with cluster.connect() as rt:
        plan = tc.Plan(tc.CallContext(deadline_ms=30_000))
        for part in range(2):  # two of three parts reach the target, then nothing
            flush = plan.on_instance("sim-a").publish("cut", part=part, parts=3)
            plan.on_instance("sim-b").hydrate("cut", flush.pages, part=part, parts=3)
        result = plan.run(rt, concurrency=2)
        assert [s["result"].get("resident") for s in result["steps"][1::2]] == [False, False]
        assert "cut" not in [s["req_id"] for s in engine_request(b, "GET", "/requests")["requests"]]
        assert "cut" in [s["req_id"] for s in engine_request(a, "GET", "/requests")["requests"]]
        with pytest.raises(tc.InvalidArgument, match="part"):  # a part out of range: refused
            p = tc.Plan(tc.CallContext(deadline_ms=10_000))
            p.on_instance("sim-a").publish("cut", part=3, parts=3)
            p.run(rt)
        migrate(rt, "cut", "sim-a", "sim-b", parts=3)  # same cut: parks nothing twice
    nxt = sglang_generate(b, "cut", ids + first["output_ids"] + [5] * 10)
    assert nxt["meta_info"]["cached_tokens"] == (len(ids) + 4) // 8 * 8
    engine_request(b, "POST", "/evict", {"req_id": "cut"})


def test_instance_start_rejects_bad_engines(cluster):
    proc = cluster.tc("instance", "start", "--worker", "worker-1", "--engine", "gpu")
    assert proc.returncode == 3 and "unknown engine" in proc.stderr
    proc = cluster.tc("instance", "start", "--worker", "worker-1")
    assert proc.returncode == 3 and "--model" in proc.stderr
    proc = cluster.tc(
        "instance", "start", "--worker", "worker-1", "--engine", "sim", "--cost", "warp=1"
    )
    assert proc.returncode == 3 and "--cost" in proc.stderr
