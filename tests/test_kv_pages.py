"""KV pages in sharded homes on real worker processes: batch put/get/exists through shared
memory and through the native data port (callers on other hosts), TTL and LRU eviction, fencing,
and a shard home killed with -9."""

from __future__ import annotations

import os
import signal
import socket
import time
import urllib.request

import pytest
import torch
from conftest import pool_used, shards_settled, start_cluster, wait_until

import tensorcast as tc
from tensorcast.metrics import rpc_counts
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.sdk import page_client
from tensorcast.sharding import shard_of
from tensorcast.transport import native


@pytest.fixture
def two_homes(tmp_path):
    yield from start_cluster(tmp_path / "state", workers=2, mem="64MiB")


def _pages(n: int, numel: int = 1024, tag: float = 0.0) -> dict[str, torch.Tensor]:
    return {
        f"kv/test/{tag}/{i}": torch.arange(numel, dtype=torch.float32) + i + tag for i in range(n)
    }


def _exited(pid: int) -> bool:
    """Every thread of the process has exited (its descriptors are closed with the last)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    return False
        except FileNotFoundError:
            pass
    return True


def _remote(rt: tc.Runtime) -> tc.Runtime:
    """Pretend to be on another host: every page operation goes to the homes' data ports."""
    rt.host_id = "another-host"
    return rt


@pytest.mark.parametrize("path", ["shared-memory", "remote"])
def test_batch_put_get_exists_round_trip(cluster, path):
    with cluster.connect() as rt:
        if path == "remote":
            _remote(rt)
        pages = rt.pages()
        data = _pages(40, tag=1.0 if path == "remote" else 2.0)
        data["kv/test/bytes-" + path] = bytearray(b"\x01\x02\x03" * 1000)
        refs = pages.put_pages(data, ttl_s=60)
        assert [r.key for r in refs] == list(data)
        keys = [*data, "kv/test/absent"]
        got = pages.get_pages(keys)
        assert got[-1] is None
        for key, page in zip(data, got):
            expected = data[key]
            if isinstance(expected, torch.Tensor):
                assert torch.equal(page.tensor(), expected)
            else:
                assert bytes(page.data) == bytes(expected)
        assert pages.exists_pages(keys) == [True] * len(data) + [False]
        assert pages.table_fetches == 1  # every operation above used the cached lease table


def test_page_operations_never_ask_the_global_store(cluster):
    def store_calls() -> dict[str, float]:
        metrics_addr = next(p for p in cluster.record.processes if p.role == "store").metrics_addr
        text = urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=5).read().decode()
        return rpc_counts(text)

    with cluster.connect() as rt:
        pages = rt.pages()
        pages.table()
        before = store_calls()
        for round_ in range(20):
            batch = _pages(50, numel=256, tag=100.0 + round_)
            pages.put_pages(batch, ttl_s=60)
            assert all(p is not None for p in pages.get_pages(list(batch)))
            pages.exists_pages(list(batch))
        after = store_calls()
    changed = {m for m in after if after[m] != before.get(m)}
    # 3000 page operations: only the workers' heartbeats (and their lease bids) reached the store.
    assert changed <= {"Heartbeat", "AcquireShards"}, changed


def test_ttl_expiry_and_lru_eviction_when_the_pool_is_full(fresh_cluster):
    with fresh_cluster.connect() as rt:
        pages = rt.pages()
        pages.put_pages({"kv/short": torch.ones(16)}, ttl_s=0.5)
        time.sleep(0.8)
        assert pages.get_pages(["kv/short"]) == [None]
        assert pages.exists_pages(["kv/short"]) == [False]
        # 64 MiB pool, 96 pages of 1 MiB: the oldest pages make room for the newest.
        for i in range(96):
            pages.put_pages({f"kv/big/{i}": torch.full((256 * 1024,), float(i))}, ttl_s=600)
        present = pages.exists_pages([f"kv/big/{i}" for i in range(96)])
        assert present[-10:] == [True] * 10 and not all(present[:10])
        newest = pages.get_pages(["kv/big/95"])[0]
        assert torch.equal(newest.tensor(), torch.full((256 * 1024,), 95.0))


@pytest.mark.parametrize("path", ["shared-memory", "remote"])
def test_reads_renew_page_leases(cluster, path):
    """A page read through `get_pages` more often than its ttl_s outlives that ttl_s (same
    host: reads through the shared-memory directory, which the worker learns of at expiry;
    remote: READs on the data port); a sibling only asked about (`exists_pages`) expires."""
    with cluster.connect() as rt:
        if path == "remote":
            _remote(rt)
        pages = rt.pages()
        for ttl_s in (1.0, 2.0, 4.0, 8.0):
            if _read_page_outlives_its_ttl(pages, f"kv/renew/{path}/{ttl_s}", ttl_s):
                return
        pytest.fail("no attempt read its page within its ttl_s, even with an 8 s ttl_s")


def _read_page_outlives_its_ttl(pages, prefix: str, ttl_s: float) -> bool:
    """Read one page every ttl_s / 5 until 1.5 ttl_s after its put. False (inconclusive: try
    a longer ttl_s) when the machine stalled so long between reads that the lease ran out."""
    read, idle = f"{prefix}/read", f"{prefix}/idle"
    pages.put_pages({read: torch.ones(16), idle: torch.ones(16)}, ttl_s=ttl_s)
    put_done = time.monotonic()
    last_read = time.monotonic()  # each read found the page: it is live ttl_s from then on
    while True:
        started = time.monotonic()
        (page,) = pages.get_pages([read])
        if page is None:
            assert time.monotonic() >= last_read + ttl_s, "a page read within its ttl_s expired"
            return False
        last_read = started
        pages.exists_pages([idle])  # asked about, never read: no renewal
        if started > put_done + 1.5 * ttl_s:
            break
        time.sleep(ttl_s / 5)
    # Past the put's lease: the read page is still there, the other one went on time.
    assert pages.exists_pages([idle]) == [False] and pages.get_pages([idle]) == [None]
    if pages.exists_pages([read]) == [True]:
        return True
    assert time.monotonic() >= last_read + ttl_s, "a page read within its ttl_s expired"
    return False


def test_bad_pages_are_rejected_and_change_nothing(cluster):
    with cluster.connect() as rt:
        pages = _remote(rt).pages()
        pages.put_pages({"kv/keep": torch.ones(8)}, ttl_s=60)
        table = pages.table()
        shard = shard_of("kv/keep", table.num_shards)
        lease = table.lease(shard)
        stub = rt.worker_stub_at(lease.holder_worker_id, lease.holder_addr)
        data = torch.zeros(8).numpy().tobytes()

        def put(**overrides):
            page = dict(
                key="kv/keep",
                shard=shard,
                token=lease.token,
                dtype="F32",
                shape=[8],
                data=data,
                hash=native.hash_buffer(data),
            )
            page.update(overrides)
            stub.call("PutPages", pb.PutPagesRequest(pages=[pb.Page(**page)], ttl_s=60))

        with pytest.raises(tc.IntegrityError):
            put(hash="0" * 32)
        with pytest.raises(tc.FencingError, match="stale fencing token"):
            put(token=lease.token + 1)
        with pytest.raises(tc.InvalidArgument, match="do not match"):
            put(shape=[9])
        with pytest.raises(tc.InvalidArgument):
            pages.put_pages({"k" * 600: torch.ones(1)})
        assert torch.equal(pages.get_pages(["kv/keep"])[0].tensor(), torch.ones(8))


def test_killed_home_rehomes_with_higher_token_and_stale_writes_are_fenced(two_homes):
    with two_homes.connect() as rt:
        pages = rt.pages()
        wait_until(lambda: len(pages.table(refresh=True).live_homes) == 2, 30)
        data = _pages(64, tag=7.0)
        pages.put_pages(data, ttl_s=600)
        table = pages.table()
        victim_id = table.lease(shard_of(next(iter(data)), table.num_shards)).holder_worker_id
        victim = next(w for w in rt.workers() if w.worker_id == victim_id)
        survivor = next(w for w in rt.workers() if w.worker_id != victim_id)
        lost = {s for s in range(table.num_shards) if table.lease(s).holder_worker_id == victim_id}
        old_tokens = {s: table.lease(s).token for s in lost}
        victim_keys = [k for k in data if shard_of(k, table.num_shards) in lost]
        killed_at = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        wait_until(lambda: _exited(victim.pid), 30)  # its sockets are closed now

        # Until the lease expires the shard has a dead home: a clear error, never wrong bytes
        # (its memory is still mapped here, directory included: it must not be read).
        with pytest.raises(tc.Unavailable):
            pages.get_pages(victim_keys[:1])

        def rehomed():
            t = pages.table(refresh=True)
            return (
                all(
                    t.lease(s).held and t.lease(s).holder_worker_id == survivor.worker_id
                    for s in lost
                )
                and t
            )

        new = wait_until(rehomed, 60, interval_s=0.1)
        elapsed = time.monotonic() - killed_at
        assert elapsed < new.lease_ttl_s + 15, elapsed  # lease TTL, slack for a loaded machine
        assert all(new.lease(s).token > old_tokens[s] for s in lost)
        # The pages died with their home: absent, not wrong; the engine republishes them.
        assert pages.get_pages(victim_keys) == [None] * len(victim_keys)
        pages.put_pages({k: data[k] for k in victim_keys}, ttl_s=600)
        got = pages.get_pages(victim_keys)
        assert all(torch.equal(g.tensor(), data[k]) for g, k in zip(got, victim_keys))
        # A writer still holding the old token is fenced off by the new home.
        shard = shard_of(victim_keys[0], new.num_shards)  # a lost shard that had pages
        stub = rt.worker_stub(survivor)
        blob = b"\x00" * 4
        key = next(k for k in victim_keys if shard_of(k, new.num_shards) == shard)
        with pytest.raises(tc.FencingError, match="stale fencing token"):
            stub.call(
                "PutPages",
                pb.PutPagesRequest(
                    ttl_s=60,
                    pages=[
                        pb.Page(
                            key=key,
                            shard=shard,
                            token=old_tokens[shard],
                            dtype="U8",
                            shape=[4],
                            data=blob,
                            hash=native.hash_buffer(blob),
                        )
                    ],
                ),
            )
        assert torch.equal(pages.get_pages([key])[0].tensor(), data[key])


def _worker_metrics(cluster) -> dict[str, float]:
    out: dict[str, float] = {}
    for p in cluster.record.processes:
        if p.role != "worker":
            continue
        text = urllib.request.urlopen(f"http://{p.metrics_addr}/metrics", timeout=5).read()
        for line in text.decode().splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = out.get(key, 0.0) + float(value)
    return out


def test_remote_pages_travel_on_the_data_port_into_the_callers_buffers(fresh_cluster):
    """A caller on another host: pages go to the worker's data port in binary page frames (no
    gRPC page call), straight from and into the caller's buffers, checked by hash."""
    with fresh_cluster.connect() as rt:
        pages = _remote(rt).pages()
        data = {f"kv/port/{i}": torch.full((64 * 1024,), float(i)) for i in range(24)}  # 6 MiB
        before = _worker_metrics(fresh_cluster)
        refs = pages.put_pages(data, ttl_s=60)
        assert [r.hash for r in refs] == native.hash_buffers([t.numpy() for t in data.values()])
        into = [torch.zeros(64 * 1024 + 7) for _ in data]  # larger than the pages: views
        got = pages.get_pages([*data, "kv/port/absent"], into=[*into, torch.zeros(1)])
        assert got[-1] is None
        for page, buffer, (key, expected) in zip(got, into, data.items()):
            assert page is not None and page.key == key
            assert torch.equal(page.tensor(), expected)
            assert page.tensor().data_ptr() == buffer.data_ptr()  # received in place
        assert pages.exists_pages([*data, "kv/port/absent"]) == [True] * len(data) + [False]
        with pytest.raises(tc.InvalidArgument, match="does not fit"):
            pages.get_pages(["kv/port/0"], into=[torch.zeros(10)])
        assert torch.equal(pages.get_pages(["kv/port/1"])[0].tensor(), data["kv/port/1"])
        after = _worker_metrics(fresh_cluster)

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    for method in ("PutPages", "GetPages", "ExistsPages"):
        assert delta(f'tc_rpc_duration_seconds_count{{method="{method}"}}') == 0
    assert delta("tc_kv_remote_page_requests_total") >= 4  # put, read x3, exists
    assert delta('tc_kv_remote_page_bytes_total{direction="in"}') == 24 * 256 * 1024
    assert delta('tc_kv_remote_page_bytes_total{direction="out"}') >= 25 * 256 * 1024
    assert after["tc_kv_remote_page_errors_total"] == 0  # the misfit buffer is the caller's


def test_remote_batches_larger_than_one_request_are_split(cluster):
    with cluster.connect() as rt:
        pages = _remote(rt).pages()
        data = {f"kv/large/{i}": torch.full((512 * 1024,), float(i)) for i in range(40)}  # 80 MiB
        pages.put_pages(data, ttl_s=60)
        got = pages.get_pages(list(data))
        assert all(torch.equal(g.tensor(), data[k]) for g, k in zip(got, data))


def test_a_stopped_home_hands_its_shards_and_pages_to_the_other_home(two_homes):
    """`tc worker stop` on a shard home: before it deregisters it moves each shard with pages
    to the other home (a higher token) and copies the pages along: none lost, none changed."""
    with two_homes.connect() as rt:
        pages = rt.pages()
        wait_until(lambda: shards_settled(rt, 2), 30, interval_s=0.2)
        data = _pages(96, numel=512, tag=9.0)
        pages.put_pages(data, ttl_s=600)
        table = pages.table(refresh=True)
        leaving = next(w for w in rt.workers() if w.name == "worker-2")
        staying = next(w for w in rt.workers() if w.name != "worker-2")
        moved = {
            s
            for s in range(table.num_shards)
            if table.lease(s).holder_worker_id == leaving.worker_id
        }
        keys = [k for k in data if shard_of(k, table.num_shards) in moved]
        assert keys, "hashing gives the second home some of the pages"
        two_homes.tc("worker", "stop", "worker-2", check=True)
        after = pages.table(refresh=True)
        with_pages = {shard_of(k, table.num_shards) for k in keys}
        assert all(
            after.lease(s).held
            and after.lease(s).holder_worker_id == staying.worker_id
            and after.lease(s).token > table.lease(s).token
            for s in with_pages
        ), [(after.lease(s), table.lease(s).token) for s in with_pages]
        got = pages.get_pages(list(data))
        assert all(g is not None and torch.equal(g.tensor(), data[k]) for g, k in zip(got, data))


def test_a_joining_home_takes_its_shards_and_their_pages(fresh_cluster, tmp_path):
    """worker-1 homes every shard; a second shard-home joins: each shard hashing ranks it first
    for moves there with a higher token, its pages copied along, none lost or changed."""
    with fresh_cluster.connect() as rt:
        pages = rt.pages()
        before = pages.table()
        first = {lease.holder_worker_id for lease in before.leases}
        assert len(first) == 1 and all(lease.held for lease in before.leases)
        data = _pages(120, numel=256, tag=5.0)
        pages.put_pages(data, ttl_s=600)

        with fresh_cluster.extra_worker("late"):
            late = next(w for w in rt.workers() if w.name == "late")

            wait_until(lambda: shards_settled(rt, 2), 30, interval_s=0.2)
            after = pages.table(refresh=True)
            moved = [
                s
                for s in range(after.num_shards)
                if after.lease(s).holder_worker_id == late.worker_id
            ]
            assert moved, "hashing ranks the new home first for some shards"
            assert all(after.lease(s).token > before.lease(s).token for s in moved)
            assert all(
                after.lease(s).token == before.lease(s).token
                for s in range(after.num_shards)
                if s not in moved
            )
            # Every page is still there, byte for byte, some now served by the new home (the
            # copies run in the background just after the lease moved).
            got = wait_until(
                lambda: (g := pages.get_pages(list(data))) and all(p is not None for p in g) and g,
                30,
                interval_s=0.1,
            )
            assert all(
                g is not None and torch.equal(g.tensor(), data[k]) for g, k in zip(got, data)
            )
            on_late = [k for k in data if shard_of(k, after.num_shards) in moved]
            assert on_late
            stub = rt.worker_stub(late)
            reply = stub.call(
                "GetPages",
                pb.PageKeys(
                    keys=[
                        pb.PageKey(
                            key=k,
                            shard=shard_of(k, after.num_shards),
                            token=after.lease(shard_of(k, after.num_shards)).token,
                        )
                        for k in on_late
                    ]
                ),
            )
            assert [p.key for p in reply.pages] == on_late


def test_pages_moved_to_a_joining_home_keep_their_own_expiry(fresh_cluster):
    """A hand-off copies pages in batches sent with one TTL each: pages leased for 600 s that
    share a shard with pages leased for 3 s must not leave with the short ones."""
    with fresh_cluster.connect() as rt:
        pages = rt.pages()
        long, short = _pages(60, numel=256, tag=1.0), _pages(60, numel=256, tag=2.0)
        long = {f"long/{k}": v for k, v in long.items()}
        short = {f"short/{k}": v for k, v in short.items()}
        pages.put_pages(short, ttl_s=3)
        pages.put_pages(long, ttl_s=600)
        with fresh_cluster.extra_worker("late-ttl"):
            late = next(w for w in rt.workers() if w.name == "late-ttl")
            wait_until(lambda: shards_settled(rt, 2), 30, interval_s=0.2)
            table = pages.table(refresh=True)
            moved = {
                s
                for s in range(table.num_shards)
                if table.lease(s).holder_worker_id == late.worker_id
            }
            assert any(shard_of(k, table.num_shards) in moved for k in long)
            # The short pages expire (the condition is time itself: their 3 s lease).
            wait_until(lambda: not any(pages.exists_pages(list(short))), 30, interval_s=0.2)
            got = pages.get_pages(list(long))
            assert all(
                g is not None and torch.equal(g.tensor(), long[k]) for g, k in zip(got, long)
            )


def test_steady_puts_take_one_round_trip_and_regions_are_checked(cluster):
    """After a first put, puts of the same page size write into regions the previous commit
    reserved (one native request each); commits naming regions that are not the connection's,
    or under a stale token, are refused and change nothing."""
    with cluster.connect() as rt:
        pages = rt.pages()
        shards = pages.table().num_shards
        same = [k for k in (f"kv/rt/{i}" for i in range(200)) if shard_of(k, shards) == 0][:4]
        data = {k: torch.full((4096,), float(i)) for i, k in enumerate(same)}
        pages.put_pages({same[0]: data[same[0]]}, ttl_s=60)
        lease = pages.table().lease(0)
        conn = pages._local(lease)
        ops = (page_client.ALLOC, page_client.COMMIT)
        before = [conn.client.requests_sent(op) for op in ops]
        for key in same[1:]:
            pages.put_pages({key: data[key]}, ttl_s=60)
        after = [conn.client.requests_sent(op) for op in ops]
        assert [a - b for a, b in zip(after, before)] == [0, 3]  # no ALLOC round trips
        got = pages.get_pages(list(data))
        assert all(torch.equal(g.tensor(), data[k]) for g, k in zip(got, data))
        used = pool_used(rt)

        def forged(
            offset: int,
            size: int,
            token: int = lease.token,
            key: str = "kv/rt/evil",
            digest: str | None = None,
        ):
            blob = b"\x00" * size
            page = {
                "key": key,
                "shard": lease.shard,
                "token": token,
                "dtype": "U8",
                "shape": [size],
                "offset": offset,
                "size_bytes": size,
                "hash": digest or native.hash_buffer(blob),
            }
            return conn.commit(60, [page], [])

        spare = conn.spare()[16384][-1]
        with pytest.raises(tc.InvalidArgument, match="does not have the page's size"):
            forged(spare, 32768)  # claims twice its region's size
        # A region another connection owns (the other caller's reserved spare) is not ours.
        with cluster.connect() as other:
            other.pages().put_pages({same[0]: data[same[0]]}, ttl_s=60)
            theirs = other.pages()._local(lease).spare()[16384][-1]
            with pytest.raises(tc.InvalidArgument, match="not this connection's"):
                forged(theirs, 16384)
        (mine,) = conn.alloc([16384])
        with pytest.raises(tc.FencingError):
            forged(mine, 16384, token=lease.token + 1)
        # A refused commit frees its region: committing it again names no region of ours.
        with pytest.raises(tc.InvalidArgument, match="not this connection's"):
            forged(mine, 16384)
        assert pages.get_pages(["kv/rt/evil"]) == [None]
        assert pool_used(rt) == used
        # The worker takes the hash as the writer claims it (the client hashed each page as
        # it copied it in): bytes that do not match it read as absent, never as other bytes.
        (mine,) = conn.alloc([16384])
        with pytest.raises(tc.InvalidArgument, match="hex digits"):
            forged(mine, 16384, key="kv/rt/liar", digest="not-a-hash")
        (mine,) = conn.alloc([16384])
        forged(mine, 16384, key="kv/rt/liar", digest="0" * 32)
        assert pages.get_pages(["kv/rt/liar"]) == [None]
        # What the wire cannot carry is refused before any region is taken.
        spare = conn.spare()
        with pytest.raises(tc.InvalidArgument, match="page limits"):
            pages.put_pages({"k" * 600: torch.ones(4)})
        assert conn.spare() == spare


def test_native_page_socket_survives_malformed_frames(cluster):
    """Garbage on the native page socket: a typed error, the connection closed, the worker and
    its pages untouched."""
    import socket
    import struct

    from tensorcast.transport.unix import page_socket_name, socket_address

    with cluster.connect() as rt:
        pages = rt.pages()
        keep = {"kv/native/keep": torch.arange(64, dtype=torch.float32)}
        pages.put_pages(keep, ttl_s=60)
        lease = pages.table().lease(shard_of("kv/native/keep", pages.table().num_shards))
        address = socket_address(page_socket_name(lease.holder_local_socket))
        header = struct.Struct("<BBHI")
        used = pool_used(rt)

        def replies(frame: bytes) -> list[tuple[int, bytes]]:
            """Send raw bytes on a fresh connection; the (status, body) replies until it closes."""
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(10)
                s.connect(address)
                s.sendall(frame)
                s.shutdown(socket.SHUT_WR)  # no more requests: the worker closes after answering
                data = b""
                while chunk := s.recv(65536):
                    data += chunk
            out = []
            while data:
                version, status, _, size = header.unpack_from(data)
                assert version == 1 and len(data) >= header.size + size, data
                out.append((status, data[header.size : header.size + size]))
                data = data[header.size + size :]
            return out

        def error(body: bytes) -> tuple[str, str]:
            (n,) = struct.unpack_from("<H", body)
            kind = body[2 : 2 + n].decode()
            (size,) = struct.unpack_from("<I", body, 2 + n)
            return kind, body[6 + n : 6 + n + size].decode()

        def text(s: str) -> bytes:
            return struct.pack("<H", len(s)) + s.encode()

        def frame(op: int, body: bytes, version: int = 1, size: int | None = None) -> bytes:
            return header.pack(version, op, 0, len(body) if size is None else size) + body

        good = frame(page_client.HELLO, text(cluster.token))
        get = struct.pack("<I", 1) + text("kv/native/keep") + struct.pack("<IQ", 0, 0)
        cases = {
            "no hello": (frame(page_client.GET, get), "Unauthenticated"),
            # Nothing but HELLO is read before it (a WAKE would keep the connection open).
            "wake before hello": (frame(page_client.WAKE, b""), "Unauthenticated"),
            "huge before hello": (frame(page_client.GET, b"", size=8 << 20), "Unauthenticated"),
            "wrong token": (frame(page_client.HELLO, text("nope")), "Unauthenticated"),
            "bad version": (good + frame(page_client.GET, get, version=9), "InvalidArgument"),
            "unknown op": (good + frame(77, b""), "InvalidArgument"),
            "oversized": (good + frame(page_client.GET, b"", size=1 << 30), "InvalidArgument"),
            "short body": (good + frame(page_client.GET, b"\x01\x00\x00\x00"), "InvalidArgument"),
            "huge batch": (good + frame(page_client.ALLOC, b"\xff" * 4), "InvalidArgument"),
            "wake with a body": (good + frame(page_client.WAKE, b"x"), "InvalidArgument"),
            "wake, then get": (
                good + frame(page_client.WAKE, b"") + frame(page_client.GET, get),
                None,  # WAKE is never answered: one reply, the GET's
            ),
            "empty commit": (
                good + frame(page_client.COMMIT, struct.pack("<dII", 60.0, 0, 0)),
                None,  # well formed: fine, and the connection stays open
            ),
        }
        for name, (raw, kind) in cases.items():
            got = replies(raw)
            if raw.startswith(good):
                assert got[0][0] == 0, name  # the HELLO reply
                got = got[1:]
            if kind is None:
                assert [status for status, _ in got] == [0], name
                continue
            assert len(got) == 1 and got[0][0] == 1, (name, got)
            got_kind, message = error(got[0][1])
            assert got_kind == kind and message, (name, got_kind, message)
        # The good frames still work after all that, and nothing leaked or changed.
        got_pages = pages.get_pages(list(keep))
        assert torch.equal(got_pages[0].tensor(), keep["kv/native/keep"])
        assert pool_used(rt) == used


def test_a_broken_page_connection_is_replaced(cluster):
    """A same-host page connection that fails (its socket gone) is dropped and reopened: the
    operation is retried on a fresh one, and the regions the old one held are given back."""
    with cluster.connect() as rt:
        pages = rt.pages()
        key = "kv/broken/1"
        pages.put_pages({key: torch.ones(4096)}, ttl_s=60)
        lease = pages.table().lease(shard_of(key, pages.table().num_shards))
        old = pages._local(lease)
        assert old.spare()  # the commit reserved regions for the next put
        used = pool_used(rt)
        # The socket fails under the client (as when the worker's end goes away).
        with socket.socket(fileno=os.dup(old.client.fileno)) as s:
            s.shutdown(socket.SHUT_RDWR)
        pages.put_pages({key: torch.full((4096,), 2.0)}, ttl_s=60)
        new = pages._local(lease)
        assert new is not old and old.broken and not new.broken
        assert torch.equal(pages.get_pages([key])[0].tensor(), torch.full((4096,), 2.0))
        # The old connection's spare regions went back when the worker saw it close; the new
        # one holds as many as the old did.
        assert wait_until(lambda: pool_used(rt) == used, 30)


def test_reads_racing_eviction_get_the_page_or_nothing(fresh_cluster):
    """A 64 MiB pool, a writer putting 1 MiB pages as fast as it can (so the least recently
    used pages are evicted and their regions reused all the time) and a reader, in another
    connection, getting pages that may be evicted under it: every page it gets has exactly
    the bytes put under its key; the others read as absent."""
    import threading

    def value(i: int) -> torch.Tensor:
        return torch.full((256 * 1024,), float(i))

    stop = threading.Event()
    written = [0]
    errors_seen: list[BaseException] = []

    def writer() -> None:
        try:
            with fresh_cluster.connect() as rt:
                pages = rt.pages()
                i = 0
                while not stop.is_set():
                    pages.put_pages({f"kv/race/{i}": value(i)}, ttl_s=60)
                    written[0] = i
                    i += 1
        except BaseException as e:  # surfaced by the assertion below
            errors_seen.append(e)

    thread = threading.Thread(target=writer)
    thread.start()
    found = absent = 0
    try:
        with fresh_cluster.connect() as rt:
            pages = rt.pages()
            deadline = time.monotonic() + 4
            while time.monotonic() < deadline and not errors_seen:
                newest = written[0]
                # The oldest live pages are the next to be evicted: read where the race is.
                keys = [f"kv/race/{max(0, newest - k)}" for k in range(40, 70, 3)]
                for key, page in zip(keys, pages.get_pages(keys)):
                    if page is None:
                        absent += 1
                        continue
                    found += 1
                    i = int(key.rsplit("/", 1)[1])
                    assert torch.equal(page.tensor(), value(i)), key
    finally:
        stop.set()
        thread.join(30)
    assert not errors_seen, errors_seen
    assert written[0] > 100  # the pool turned over several times
    assert found > 0 and absent > 0  # both outcomes happened: the race was real


def test_more_keys_than_one_request_takes_are_split(cluster):
    """10,000 pages over two homes: each home gets more than one native request may carry."""
    with cluster.connect() as rt:
        pages = rt.pages()
        many = {f"kv/many/{i}": bytearray(i.to_bytes(4, "little")) for i in range(10_000)}
        pages.put_pages(many, ttl_s=60)
        assert pages.exists_pages(list(many)) == [True] * len(many)
        got = pages.get_pages(list(many))
        assert [bytes(g.data) for g in got] == [bytes(v) for v in many.values()]


def test_large_batches_are_split_and_one_connection_cannot_hold_the_pool(fresh_cluster):
    """A 64 MiB pool: a put of 40 MiB in one call goes in batches (a connection may hold at
    most half the pool uncommitted), and a raw request for more than half the pool is refused
    without touching anything."""
    with fresh_cluster.connect() as rt:
        pages = rt.pages()
        big = {f"kv/split/{i}": torch.full((256 * 1024,), float(i)) for i in range(40)}
        pages.put_pages(big, ttl_s=60)
        got = pages.get_pages(list(big))
        assert all(torch.equal(g.tensor(), v) for g, v in zip(got, big.values()))
        lease = pages.table().lease(0)
        conn = pages._local(lease)
        used = pool_used(rt)
        with pytest.raises(tc.ResourceExhausted, match="half the pool"):
            conn.alloc([16 << 20, 16 << 20, 1 << 20])
        assert pool_used(rt) == used
        assert pages.exists_pages(list(big)) == [True] * len(big)  # nothing was evicted


def test_workers_account_for_page_regions_and_regions_held_for_puts(fresh_cluster):
    """Status shows the pool bytes pages take (4 KiB-aligned regions) and the regions page
    connections hold for their next puts, which come back when the connection closes: what
    the chaos suite's leak check subtracts."""
    with fresh_cluster.connect() as probe:
        worker = probe.workers()[0]

        def status() -> pb.WorkerStatus:
            return probe.worker_stub(worker).call("Status", pb.Empty())

        base = status()
        with fresh_cluster.connect() as rt:
            rt.pages().put_pages({"kv/acct/1": torch.ones(1000)}, ttl_s=60)  # 4000 bytes
            held = status()
            assert held.page_bytes - base.page_bytes == 4000
            assert held.page_region_bytes - base.page_region_bytes == 4096
            assert held.page_uncommitted_bytes > 0  # reserved for this connection's next put
            assert held.worker.mem_used_bytes - base.worker.mem_used_bytes == (
                4096 + held.page_uncommitted_bytes - base.page_uncommitted_bytes
            )
        wait_until(lambda: status().page_uncommitted_bytes == base.page_uncommitted_bytes, 30)
        assert status().worker.mem_used_bytes - base.worker.mem_used_bytes == 4096


def test_a_device_put_that_fails_before_its_commit_gives_its_regions_back(
    fresh_cluster, monkeypatch
):
    """A GPU page put allocates pool regions, copies into them from the device, then commits;
    when the copy fails (here: the device sync, the step a real GPU error surfaces at), the
    regions come back to the worker (the page socket has no free: the connection is closed) and
    the next put opens a new connection and works."""
    from tensorcast.sdk import gpu_pages

    with fresh_cluster.connect() as probe:
        worker = probe.workers()[0]

        def status() -> pb.WorkerStatus:
            return probe.worker_stub(worker).call("Status", pb.Empty())

        with fresh_cluster.connect() as rt:
            pages = rt.pages()
            pages.put_pages({"kv/dev/warm": torch.ones(8)}, ttl_s=60)  # connects
            base = status()
            conn = pages._local(pages.table().lease(0))

            def failed_sync(devices: set) -> None:
                raise RuntimeError("device lost")

            # No CUDA here: the pool is used unregistered (registering it is all CUDA adds).
            monkeypatch.setattr(
                gpu_pages, "pool_tensor", lambda c: torch.frombuffer(c.arena(), dtype=torch.uint8)
            )
            monkeypatch.setattr(gpu_pages, "_sync", failed_sync)
            with pytest.raises(RuntimeError, match="device lost"):
                gpu_pages._put_device(
                    conn, 60.0, [("kv/dev/x", 0, 0, "F32", (1 << 18,))], [torch.ones(1 << 18)]
                )
            assert conn.broken
            wait_until(lambda: status().page_uncommitted_bytes <= base.page_uncommitted_bytes, 30)
            monkeypatch.undo()
            pages.put_pages({"kv/dev/after": torch.ones(8)}, ttl_s=60)
            assert torch.equal(pages.get_pages(["kv/dev/after"])[0].tensor(), torch.ones(8))
