"""The native core through its Python face: hashing and parallel reads."""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorcast as tc
from tensorcast.errors import InvalidArgument
from tensorcast.transport import native

CHUNK = native.TREE_HASH_CHUNK_BYTES


@pytest.mark.parametrize("size", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 5])
def test_hash_is_independent_of_threads(size):
    data = os.urandom(size)
    digests = {native.hash_buffer(data, threads) for threads in (1, 2, 7)}
    assert len(digests) == 1
    assert len(digests.pop()) == 32


def test_hash_detects_a_flipped_bit_in_any_chunk():
    data = bytearray(os.urandom(2 * CHUNK + 100))
    original = native.hash_buffer(data)
    for position in (0, CHUNK - 1, CHUNK, 2 * CHUNK + 99):
        data[position] ^= 1
        assert native.hash_buffer(data) != original
        data[position] ^= 1
    assert native.hash_buffer(data) == original


def test_hash_buffers_equals_one_by_one():
    bufs = [os.urandom(n) for n in (0, 7, 4096, CHUNK + 3)] * 3
    assert native.hash_buffers(bufs) == [native.hash_buffer(b) for b in bufs]


def test_known_answer():
    # Pins the format (tree hash v1 over XXH3-128): stored content ids depend on it.
    assert native.hash_buffer(b"hello") == "1e143c32d23cf07083259d8c354d7881"


def test_read_file_into(tmp_path):
    data = os.urandom(3 * 1024 * 1024 + 17)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    dest = bytearray(len(data) + 10)
    native.read_file_into(path, 5, len(data) - 5, dest, 10, threads=2)
    assert bytes(dest[10 : 10 + len(data) - 5]) == data[5:]
    with pytest.raises(InvalidArgument, match="shorter"):
        native.read_file_into(path, 0, len(data) + 1, bytearray(len(data) + 1), 0)


def test_read_files_reads_and_hashes_spans_of_many_files(tmp_path):
    """Spans of two files in one call (adjacent ones are read as one run): the bytes land where
    asked and the hashes are the tree hashes of those bytes."""
    a, b = os.urandom(3 * CHUNK + 999), os.urandom(CHUNK // 2)
    (tmp_path / "a").write_bytes(a)
    (tmp_path / "b").write_bytes(b)
    spans = [
        (0, 17, CHUNK, 17),  # these two are adjacent in the file and in dest
        (0, 17 + CHUNK, len(a) - 17 - CHUNK, 17 + CHUNK),
        (1, 0, len(b), 4 * CHUNK),
        (1, 5, 100, 5 * CHUNK + 1),
        (1, 0, 0, 5 * CHUNK),
    ]
    dest = bytearray(6 * CHUNK)
    files = [tmp_path / "a", tmp_path / "b"]
    hashes = native.read_files(files, spans, dest, hash=True, threads=3)
    assert dest[17 : len(a)] == a[17:]
    assert dest[4 * CHUNK : 4 * CHUNK + len(b)] == b
    assert dest[5 * CHUNK + 1 : 5 * CHUNK + 101] == b[5:105]
    assert hashes == native.hash_buffers([a[17 : 17 + CHUNK], a[17 + CHUNK :], b, b[5:105], b""])
    assert native.read_files(files, spans, bytearray(6 * CHUNK)) is None
    with pytest.raises(InvalidArgument, match="shorter"):
        native.read_files(files, [(1, 1, len(b), 0)], bytearray(len(b) + 1))


def test_pulls_reuse_idle_connections_to_the_same_server():
    """A finished pull leaves its authenticated connections for the next pull from the same
    server: later pulls open none; a wrong token never gets a pooled connection."""
    from tensorcast.errors import TensorcastError

    source = bytearray(os.urandom(10 << 20))
    server = native.data_server("127.0.0.1", source, "secret")
    try:
        addr = f"127.0.0.1:{server.port}"

        def pull(streams: int) -> None:
            dest = bytearray(len(source))
            ticket = server.open_ticket(0, len(source), 10_000)
            stats = native.pull(addr, "secret", ticket, 0, len(source), dest, 0, streams=streams)
            server.close_ticket(ticket)
            assert dest == source and stats["bytes"] == len(source)

        # One stream: its connection is pooled when the pull ends, whatever the scheduling.
        for _ in range(3):
            pull(1)
        assert server.stats()["connections_accepted"] == 1
        # Two streams: one takes the pooled connection, so at most one new one is opened (none
        # when the first stream finishes every chunk before the second has connected).
        pull(2)
        opened = server.stats()["connections_accepted"]
        assert opened <= 2
        ticket = server.open_ticket(0, len(source), 10_000)
        with pytest.raises(TensorcastError):
            native.pull(addr, "wrong", ticket, 0, len(source), bytearray(len(source)), 0)
        assert server.stats()["connections_accepted"] > opened  # it had to say HELLO itself
    finally:
        server.stop()


def test_tickets_no_read_uses_show_as_idle():
    """A ticket whose puller died stops being read: the server lists it as idle (its owner then
    frees what it holds); one just read is not idle."""
    from conftest import wait_until

    source = bytearray(os.urandom(1 << 20))
    server = native.data_server("127.0.0.1", source, "secret")
    try:
        abandoned = server.open_ticket(0, len(source), 600_000)
        used = server.open_ticket(0, len(source), 600_000)
        wait_until(lambda: abandoned in server.idle_tickets(200), 30)
        native.pull(f"127.0.0.1:{server.port}", "secret", used, 0, 4096, bytearray(4096), 0)
        idle = server.idle_tickets(200)
        assert abandoned in idle and used not in server.idle_tickets(10_000)
    finally:
        server.stop()


@pytest.mark.parametrize("count,size", [(1, 1000), (3, 0), (64, 256 * 1024)])
def test_copy_many_copies_each_source_into_its_dest(count, size):
    sources = [os.urandom(size) for _ in range(count)]
    dests = [bytearray(size + 7) for _ in range(count)]  # larger dests keep their tails
    native.copy_many(dests, sources)
    assert all(d[:size] == s and d[size:] == bytes(7) for d, s in zip(dests, sources))


def test_copy_many_rejects_bad_batches_and_copies_nothing():
    dest = bytearray(8)
    with pytest.raises(ValueError, match="differ in length"):
        native.copy_many([dest], [b"a", b"b"])
    with pytest.raises(ValueError):  # the second dest is too small: not even the first is copied
        native.copy_many([dest, bytearray(2)], [b"12345678", b"123"])
    assert dest == bytearray(8)
    with pytest.raises(ValueError, match="overlaps"):
        view = memoryview(dest)
        native.copy_many([view[2:6]], [view[0:4]])
    with pytest.raises(BufferError):  # a read-only dest
        native.copy_many([b"readonly"], [b"12345678"])


def test_copy_hash_many_returns_the_hash_of_each_copy():
    sources = [os.urandom(n) for n in (0, 1, 65539, 5 << 20)]
    dests = [bytearray(len(s) + 1) for s in sources]
    hashes = native.copy_hash_many(dests, sources)
    assert hashes == [native.hash_buffer(s) for s in sources]
    assert [bytes(d[:-1]) for d in dests] == sources


def _page_server(tmp_name: str):
    """A native page server over a fresh pool (no cluster): the worker's wiring in small."""
    from tensorcast.transport.unix import page_socket_name, socket_address
    from tensorcast.worker.pages import PageStore
    from tensorcast.worker.pool import Pool

    pool = Pool(8 << 20)
    store = PageStore(pool)
    store.index.set_leases({0: (1, time.monotonic() + 600)})
    server = native.PageServer(
        socket_address(page_socket_name(tmp_name)), store.index, "tok", pool.capacity_bytes
    )
    return pool, store, server


def _commit_page(conn, pool, key: str, data: bytes) -> dict:
    """Write `data` into a region allocated on `conn` and commit it as page `key` (shard 0,
    token 1); returns the page as committed."""
    (offset,) = conn.alloc([len(data)])
    pool.view[offset : offset + len(data)] = data
    page = {
        "key": key,
        "shard": 0,
        "token": 1,
        "dtype": "U8",
        "shape": [len(data)],
        "offset": offset,
        "size_bytes": len(data),
        "hash": native.hash_buffer(data),
    }
    conn.commit(60, [page], [])
    return page


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=4), st.integers(0, 255), st.integers(0, 6))
def test_page_server_answers_random_frames_and_loses_nothing(bodies, version, op):
    """Random requests after a good HELLO: every reply is well formed, a committed page is
    never disturbed, and closing the connection gives back every region it allocated."""
    import socket
    import struct

    from tensorcast.sdk.page_client import PageConnection
    from tensorcast.transport.unix import page_socket_name, socket_address

    name = f"fuzz-{os.getpid()}"
    pool, store, server = _page_server(name)
    try:
        conn = PageConnection(name, lambda: pool.view, "tok", 5)
        page = _commit_page(conn, pool, "keep", b"\x07" * 4096)
        used = pool.arena.used_bytes
        header = struct.Struct("<BBHI")
        hello = b"\x03\x00tok"
        raw = header.pack(1, 1, 0, len(hello)) + hello
        for body in bodies:
            raw += header.pack(version if body else 1, op, 0, len(body)) + body
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(socket_address(page_socket_name(name)))
            s.sendall(raw)
            s.shutdown(socket.SHUT_WR)
            data = b""
            while chunk := s.recv(1 << 16):
                data += chunk
        replies = 0
        while data:
            v, status, _, size = header.unpack_from(data)
            assert v == 1 and status in (0, 1) and len(data) >= header.size + size
            data = data[header.size + size :]
            replies += 1
        assert 1 <= replies <= 1 + len(bodies)
        # The raw connection is closed: its regions are back, the committed page untouched.
        deadline = time.monotonic() + 30
        while pool.arena.used_bytes != used and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.arena.used_bytes == used
        (found,) = conn.get([("keep", 0, 1)])
        assert found is not None and found[4] == page["hash"]
        assert bytes(pool.view[found[0] : found[0] + 4096]) == b"\x07" * 4096
        conn.close()
    finally:
        server.stop()
        store.close()
        pool.close()


def test_a_silent_page_server_times_out_as_unavailable():
    """A page socket that accepts but never answers: the caller's request fails within its
    timeout as Unavailable (bounded wait), and the connection is marked broken."""
    import socket

    from tensorcast.sdk.page_client import PageConnection
    from tensorcast.transport.unix import page_socket_name, socket_address

    name = f"silent-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(socket_address(page_socket_name(name)))
        listener.listen(1)
        started = time.monotonic()
        with pytest.raises(tc.Unavailable, match="page connection failed"):
            PageConnection(name, lambda: memoryview(bytearray(4096)), "tok", 0.3)
        assert 0.25 < time.monotonic() - started < 5


def test_a_page_overwritten_while_read_reads_as_absent():
    """The region of a page evicted and reused between the worker's answer and the caller's
    copy: the copy's hash does not match, so the page reads as absent, never as other bytes."""
    from tensorcast.sdk.page_client import PageConnection
    from tensorcast.sdk.pages import Pages

    name = f"overwrite-{os.getpid()}"
    pool, store, server = _page_server(name)
    try:
        conn = PageConnection(name, lambda: pool.view, "tok", 5)
        page = _commit_page(conn, pool, "p", b"\x05" * 4096)
        offset = page["offset"]
        (got,) = Pages._get_local(conn, [("p", 0, 1)])
        assert got is not None and bytes(got.data) == b"\x05" * 4096
        looked_up = conn.get

        def get_then_reuse(wanted):
            found = looked_up(wanted)
            pool.view[offset : offset + 4096] = b"\x06" * 4096  # evicted, region reused
            return found

        conn.get = get_then_reuse
        assert Pages._get_local(conn, [("p", 0, 1)]) == [None]
        conn.close()
    finally:
        server.stop()
        store.close()
        pool.close()


def _pmd_mapped_kib(mm) -> int:
    """ShmemPmdMapped (KiB mapped with 2 MiB entries) of the mapping `mm`, from /proc/self/smaps."""
    import ctypes

    anchor = ctypes.c_char.from_buffer(mm)
    start = ctypes.addressof(anchor)
    del anchor
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo = int(head.split("-")[0], 16)
                inside = lo <= start < int(head.split("-")[1], 16)
            elif inside and head == "ShmemPmdMapped:":
                return int(line.split()[1])
    return 0


def test_the_pool_and_its_callers_map_huge_pages_where_the_host_allows(tmp_path):
    """With shared-memory huge pages enabled (set here for the test as root, then restored),
    the worker's pool and a caller's mapping of it are backed by 2 MiB pages; without, both
    still map and populate the whole pool with 4 KiB pages."""
    from tensorcast.transport import shm
    from tensorcast.worker.pool import Pool

    before = shm.shmem_huge_pages()
    if before == "unknown":
        pytest.skip("no /sys/kernel/mm/transparent_hugepage/shmem_enabled on this kernel")
    try:
        for policy in ("never", "advise"):
            try:
                shm.SHMEM_THP.write_text(policy)
            except OSError as e:
                pytest.skip(f"cannot set the shared-memory huge page policy ({e}); needs root")
            pool = Pool(64 << 20)
            try:
                caller = shm.map_pool(pool.fd, pool.capacity_bytes)
                caller[: 1 << 20] = b"\x05" * (1 << 20)
                assert bytes(pool.view[(1 << 20) - 4 : (1 << 20) + 4]) == b"\x05" * 4 + b"\0" * 4
                huge = [_pmd_mapped_kib(pool.mm), _pmd_mapped_kib(caller)]
                if policy == "never":
                    assert huge == [0, 0]
                else:  # (a fragmented host may not find a 2 MiB page for every slot)
                    assert all(kib >= 32 << 10 for kib in huge), huge
                caller.close()
            finally:
                pool.close()
    finally:
        shm.SHMEM_THP.write_text(before)
