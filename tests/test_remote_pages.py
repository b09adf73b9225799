"""KV pages across hosts for real: two shard homes in their own network namespaces, callers in a
third namespace with no worker, pages on the homes' data ports (native page frames, no gRPC).
Faults: a home killed mid-batch, a link cut mid-transfer, corrupt frames on the page socket."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import urllib.request

import pytest
from conftest import wait_until
from netns import Network, netns_cluster, unavailable_reason

import tensorcast as tc
from tensorcast.sdk.plan import Plan
from tensorcast.transport import native

pytestmark = pytest.mark.root
_reason = unavailable_reason()
if _reason:
    pytest.skip(f"cross-host tests skipped: {_reason}", allow_module_level=True)

MiB = 1024 * 1024


@pytest.fixture
def hosts(tmp_path):
    """Homes on hosts a and b (metrics reachable over the bridge), host c without a worker."""
    network = Network.unique(3)
    a, b, c = network.hosts
    workers = {}
    for cluster in netns_cluster(tmp_path, "256MiB", network, workers=[]):
        for ns in (a, b):
            args = ["--metrics-listen", f"{network.hosts[ns]}:0"]
            workers[ns] = cluster.start_worker(ns, "256MiB", args)
        cluster.workers = workers  # type: ignore[attr-defined]
        cluster.names = (a, b, c)  # type: ignore[attr-defined]
        with tc.connect(cluster.store_addr, cluster.token) as rt:
            wait_until(lambda rt=rt: _settled(rt), 60, interval_s=0.2)
        yield cluster


def _settled(rt: tc.Runtime) -> bool:
    """Both homes hold the shards hashing ranks them first for (no hand-off still to come)."""
    from tensorcast.sharding import settled

    table = rt.pages().table(refresh=True)
    return len(table.live_homes) == 2 and settled(table)


def _metrics(addr: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


# A caller's helpers, run inside host c: pages whose bytes derive from their key.
CALLER = r"""
import hashlib, json, sys, time
import tensorcast as tc

def blob(key, size):
    seed = hashlib.blake2b(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]

def homes_of(pages, keys):
    from tensorcast.sharding import shard_of
    table = pages.table()
    return [table.lease(shard_of(k, table.num_shards)).holder_worker_id for k in keys]
"""


def test_a_caller_without_a_worker_puts_gets_and_prefetches_pages_on_other_hosts(hosts):
    a, b, c = hosts.names
    before = {ns: _metrics(w["metrics_addr"]) for ns, w in hosts.workers.items()}
    out = hosts.in_host(
        c,
        CALLER
        + r"""
rt = tc.connect()
assert all(w.host_id != rt.host_id for w in rt.workers())  # nobody on this host
pages = rt.pages()
keys = [f"kv/x/{i}" for i in range(48)]
refs = pages.put_pages({k: blob(k, 256 * 1024) for k in keys}, ttl_s=300)
into = [bytearray(256 * 1024) for _ in keys]
got = pages.get_pages(keys, into=into)
same = all(bytes(into[i]) == blob(k, 256 * 1024) and got[i] is not None for i, k in enumerate(keys))
plain = pages.get_pages(keys[:3] + ["kv/x/absent"])
same &= plain[-1] is None
same &= all(bytes(p.data) == blob(k, 256 * 1024) for p, k in zip(plain[:3], keys))
exists = pages.exists_pages(keys + ["kv/x/absent"])
print(json.dumps({"same": same, "exists": exists, "homes": homes_of(pages, keys),
                  "refs": [r.to_json() for r in refs]}))
""",
    )
    assert out["same"] and out["exists"] == [True] * 48 + [False]
    assert len(set(out["homes"])) == 2  # the batch spanned both homes
    after = {ns: _metrics(w["metrics_addr"]) for ns, w in hosts.workers.items()}
    for ns in (a, b):
        for method in ("PutPages", "GetPages", "ExistsPages"):
            key = f'tc_rpc_duration_seconds_count{{method="{method}"}}'
            assert after[ns].get(key, 0) == before[ns].get(key, 0), (ns, method)
        assert after[ns]["tc_kv_remote_page_requests_total"] > 0
    # prefetch_many of page references to worker a: the pages homed on b cross the bridge over
    # the data plane into a's page cache, where a hydrate finds them.
    with tc.connect(hosts.store_addr, hosts.token) as rt:
        worker_a = rt.resolve_worker(a)
        plan = Plan()
        step = plan.on_worker(worker_a.worker_id).prefetch_many(out["refs"])
        result = plan.run(rt)
    on_b = sum(1 for h in out["homes"] if h == hosts.workers[b]["worker_id"])
    moved = result["steps"][step.step_id]["bytes"]
    assert moved == on_b * 256 * 1024  # the pages homed on b; a's own were already there
    cached = _metrics(hosts.workers[a]["metrics_addr"])
    assert cached['tc_kv_pages{kind="cached"}'] == on_b
    b_after = _metrics(hosts.workers[b]["metrics_addr"])
    get_pages = 'tc_rpc_duration_seconds_count{method="GetPages"}'
    assert b_after.get(get_pages, 0) == before[b].get(get_pages, 0)
    out_bytes = 'tc_kv_remote_page_bytes_total{direction="out"}'
    assert b_after[out_bytes] >= after[b][out_bytes] + moved


def test_a_batch_over_a_same_host_and_a_remote_home_reads_only_the_referenced_version(hosts):
    """A caller on host a (its worker one of the homes): a batch over both homes is served by
    both at once, and a reference to a page put again since reads as absent from either
    home, never as the newer bytes."""
    a, b, _ = hosts.names
    out = hosts.in_host(
        a,
        CALLER
        + r"""
rt = tc.connect()
pages = rt.pages()
keys = [f"kv/v/{i}" for i in range(48)]
size = 256 * 1024
old = pages.put_pages({k: blob(k + "/1", size) for k in keys}, ttl_s=300)
new = pages.put_pages({k: blob(k + "/2", size) for k in keys}, ttl_s=300)
stale = pages.get_pages(old, into=[bytearray(size) for _ in keys])
into = [bytearray(size) for _ in keys]
fresh = pages.get_pages(new, into=into)
by_key = pages.get_pages(keys)
print(json.dumps({
    "homes": homes_of(pages, keys),
    "mine": [w.worker_id for w in rt.workers() if w.host_id == rt.host_id],
    "stale": [p is None for p in stale],
    "fresh": [p is not None and bytes(into[i]) == blob(k + "/2", size)
              for i, (p, k) in enumerate(zip(fresh, keys))],
    "by_key": [p is not None and bytes(p.data) == blob(k + "/2", size)
               for p, k in zip(by_key, keys)],
}))
""",
    )
    assert out["mine"] == [hosts.workers[a]["worker_id"]]
    assert set(out["homes"]) == {hosts.workers[a]["worker_id"], hosts.workers[b]["worker_id"]}
    assert out["stale"] == [True] * 48
    assert out["fresh"] == [True] * 48
    assert out["by_key"] == [True] * 48


def _caller(hosts, ns: str, code: str) -> subprocess.Popen:
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-u", "-c", CALLER + code],
        stdout=subprocess.PIPE,
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TC_TOKEN": hosts.token, "TC_ADDR": hosts.store_addr},
    )


def _next_line(proc: subprocess.Popen, timeout_s: float) -> dict:
    """The caller's next JSON line, waited for within a deadline."""
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)  # type: ignore[arg-type]
        if not sel.select(timeout_s):
            proc.kill()
            raise AssertionError(f"no line from the caller in {timeout_s} s: {proc.stderr.read()}")  # type: ignore[union-attr]
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line:
        raise AssertionError(f"the caller exited: {proc.stderr.read()}")  # type: ignore[union-attr]
    return json.loads(line)


def test_a_home_killed_mid_batch_reads_absent_and_the_other_home_still_serves(hosts):
    _, b, c = hosts.names
    hosts.network.limit_rate(b, "400mbit")  # b's share takes a while: the kill lands in it
    proc = _caller(
        hosts,
        c,
        r"""
rt = tc.connect()
pages = rt.pages()
keys = [f"kv/kill/{i}" for i in range(64)]
pages.put_pages({k: blob(k, 1024 * 1024) for k in keys}, ttl_s=300)
owners = homes_of(pages, keys)
print(json.dumps({"owners": owners}), flush=True)
into = [bytearray(1024 * 1024) for _ in keys]
for round_ in range(10**6):
    try:
        got = pages.get_pages(keys, into=into)
    except tc.TensorcastError as e:
        print(json.dumps({"error": type(e).__name__ + ": " + str(e)}), flush=True)
        continue
    wrong = sum(1 for p, k in zip(got, keys)
                if p is not None and bytes(p.data) != blob(k, 1024 * 1024))
    served = [p is not None for p in got]
    print(json.dumps({"round": round_, "wrong": wrong, "served": served}), flush=True)
    if sys.stdin.readline().strip() == "stop":
        break
""",
    )
    try:
        owners = _next_line(proc, 120)["owners"]
        b_id = hosts.workers[b]["worker_id"]
        on_b = [o == b_id for o in owners]
        assert any(on_b) and not all(on_b)
        rounds = [_next_line(proc, 120)]
        proc.stdin.write("go\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        os.kill(hosts.procs[b].pid, signal.SIGKILL)  # while the next round reads b's pages
        for _ in range(3):
            rounds.append(_next_line(proc, 120))
            proc.stdin.write("go\n")  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
        proc.stdin.write("stop\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
    finally:
        proc.kill()
        proc.wait(10)
    assert all("error" not in r for r in rounds), rounds
    assert all(r["wrong"] == 0 for r in rounds)  # never other bytes
    assert rounds[0]["served"] == [True] * 64
    for r in rounds[1:]:  # a's pages always served, even in the round the kill hit
        assert all(s for s, b_owned in zip(r["served"], on_b) if not b_owned)
    assert not any(s for s, b_owned in zip(rounds[-1]["served"], on_b) if b_owned)


def test_a_link_cut_mid_transfer_ends_cleanly_within_the_deadline(hosts):
    _, b, c = hosts.names
    hosts.network.limit_rate(b, "40mbit")  # b's share (~16 MiB) cannot finish in 3 s
    proc = _caller(
        hosts,
        c,
        r"""
rt = tc.connect(timeout_s=3.0)
pages = rt.pages()
keys = [f"kv/cut/{i}" for i in range(32)]
slow = tc.connect(timeout_s=60.0).pages()
slow.put_pages({k: blob(k, 1024 * 1024) for k in keys}, ttl_s=300)
print(json.dumps({"owners": homes_of(pages, keys)}), flush=True)
sys.stdin.readline()
started = time.monotonic()
try:
    got = pages.get_pages(keys)
    outcome = {"wrong": sum(1 for p, k in zip(got, keys)
                            if p is not None and bytes(p.data) != blob(k, 1024 * 1024)),
               "served": [p is not None for p in got]}
except tc.TensorcastError as e:
    outcome = {"error": type(e).__name__}
outcome["elapsed_s"] = time.monotonic() - started
print(json.dumps(outcome), flush=True)
sys.stdin.readline()
got = slow.get_pages(keys)  # b may have lost its leases while cut off: its pages absent
print(json.dumps({"served": [p is not None for p in got],
                  "wrong": sum(1 for p, k in zip(got, keys)
                               if p is not None and bytes(p.data) != blob(k, 1024 * 1024))}),
      flush=True)
""",
    )
    try:
        owners = _next_line(proc, 120)["owners"]
        assert len(set(owners)) == 2
        proc.stdin.write("go\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        hosts.network.set_link(b, up=False)
        try:
            outcome = _next_line(proc, 60)
        finally:
            hosts.network.set_link(b, up=True)
        proc.stdin.write("go\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        after = _next_line(proc, 60)
    finally:
        proc.kill()
        proc.wait(10)
    assert outcome["elapsed_s"] < 3.0 + 5.0, outcome  # the deadline, slack for a loaded host
    if "error" in outcome:
        assert outcome["error"] in ("DeadlineExceeded", "Unavailable"), outcome
    else:
        assert outcome["wrong"] == 0
    # The next call works (the cut link was not kept): a's pages served, nothing wrong.
    assert after["wrong"] == 0
    assert all(s for s, o in zip(after["served"], owners) if o != hosts.workers[b]["worker_id"])


def _frame(op: int, body: bytes, version: int = 1) -> bytes:
    return struct.pack("<BBHI", version, op, 0, len(body)) + body


def _put_body(key: str, size: int, digest: str, shard: int, token: int) -> bytes:
    k, d = key.encode(), digest.encode()
    return (
        struct.pack("<dBI", 60.0, 0, 1)
        + struct.pack("<H", len(k))
        + k
        + struct.pack("<IQ", shard, token)
        + struct.pack("<H", 2)
        + b"U8"
        + struct.pack("<Bq", 1, size)
        + struct.pack("<QH", size, len(d))
        + d
    )


RAW_FRAMES = r"""
import json, socket, struct
P = json.loads(PARAMS_JSON)

def frame(op, body, version=1):
    return struct.pack("<BBHI", version, op, 0, len(body)) + body

def reply(s):
    head = b""
    while len(head) < 8:
        chunk = s.recv(8 - len(head))
        if not chunk:
            return None
        head += chunk
    version, status, _, size = struct.unpack("<BBHI", head)
    body = b""
    while len(body) < size:
        chunk = s.recv(size - len(body))
        if not chunk:
            return None
        body += chunk
    return status, body

def closed(s):
    s.settimeout(10)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True

def conn(hello=True):
    s = socket.create_connection((P["host"], P["port"]), timeout=10)
    if hello:
        t = P["token"].encode()
        s.sendall(frame(1, struct.pack("<H", len(t)) + t))
        assert reply(s)[0] == 0
    return s

out = {}
s = conn(hello=False); s.sendall(frame(7, b"\0\0\0\0"))
r = reply(s); out["read_before_hello"] = [r[0], closed(s)]
s = conn(); s.sendall(frame(7, b"\0" * 3, version=9))
r = reply(s); out["bad_version"] = [r[0], closed(s)]
s = conn(); s.sendall(b"\x01\x07\0\0\xff\xff\xff\x7f")
r = reply(s); out["oversize"] = [r[0], closed(s)]
s = conn(); s.sendall(frame(7, b"\x05\0\0\0garbage"))
r = reply(s); out["garbled_keys"] = [r[0], closed(s)]
s = conn(); s.sendall(frame(3, b"\0" * 16))
r = reply(s); out["commit_on_data_port"] = [r[0], closed(s)]
blob = bytes(range(256)) * 4096
s = conn(); s.sendall(frame(8, bytes.fromhex(P["damaged"])) + blob[:-1] + b"X")
r = reply(s); out["damaged_put"] = [r[0], b"IntegrityError" in r[1]]
key = b"kv/corrupt0"
s.sendall(frame(5, struct.pack("<IH", 1, len(key)) + key + struct.pack("<IQ", *P["lease"])))
r = reply(s); out["exists_after"] = [r[0], r[1][4:].hex()]
s = conn(); s.sendall(frame(8, bytes.fromhex(P["cut"])) + blob[: len(blob) // 2]); s.close()
print(json.dumps(out))
"""


def test_corrupt_frames_on_the_page_socket_are_rejected_and_store_nothing(hosts):
    """Raw frames from host c to a's data port: each bad one is answered and its connection
    closed (or, for bytes that fail their hash, refused with nothing stored)."""
    a, _, c = hosts.names
    a_id = hosts.workers[a]["worker_id"]
    with tc.connect(hosts.store_addr, hosts.token) as rt:
        data_addr = next(w.data_addr for w in rt.workers() if w.name == a)
        lease = next(z for z in rt.pages().table().leases if z.holder_worker_id == a_id)
    before = _metrics(hosts.workers[a]["metrics_addr"])
    digest = native.hash_buffer(bytes(range(256)) * 4096)
    params = {
        "host": data_addr.rpartition(":")[0],
        "port": int(data_addr.rpartition(":")[2]),
        "token": hosts.token,
        "lease": [lease.shard, lease.token],
        "damaged": _put_body("kv/corrupt0", MiB, digest, lease.shard, lease.token).hex(),
        "cut": _put_body("kv/corrupt1", MiB, digest, lease.shard, lease.token).hex(),
    }
    out = hosts.in_host(c, RAW_FRAMES.replace("PARAMS_JSON", repr(json.dumps(params))))
    for case in (
        "read_before_hello",
        "bad_version",
        "oversize",
        "garbled_keys",
        "commit_on_data_port",
    ):
        assert out[case] == [1, True], (case, out[case])  # an error reply, then closed
    assert out["damaged_put"] == [1, True]
    assert out["exists_after"] == [0, "00"]  # nothing stored; the connection still served

    def quiet() -> dict | bool:
        m = _metrics(hosts.workers[a]["metrics_addr"])
        return m["tc_kv_remote_page_connections"] == 0 and m

    after = wait_until(quiet, 30)
    assert after['tc_kv_pages{kind="home"}'] == before['tc_kv_pages{kind="home"}']
    assert after["tc_kv_page_bytes"] == before["tc_kv_page_bytes"]
    # The truncated put's regions were freed: the pool holds what it held before.
    used = 'tc_pool_bytes{kind="used",tier="cpu"}'
    assert after[used] == before[used]
    with tc.connect(hosts.store_addr, hosts.token) as rt:  # and the home still serves
        rt.host_id = "elsewhere"
        assert rt.pages().exists_pages(["kv/corrupt0", "kv/corrupt1"]) == [False, False]
