"""`tc rebalance`, `tc router start` and the router view of `tc top` on a real cluster with
emulated-engine instances (`tc instance start --engine sim`) in their own processes.

Load is made deterministic: sim-a's decode step is modelled at 100 s (x1/1000 = 0.1 s real), so
"hog" requests asking for 5000 tokens stay running for the whole module, while one-token turns
finish at their prefill. No test waits for time to pass: every wait is for a condition."""

from __future__ import annotations

import json
import threading
import time

import pytest
from conftest import wait_until
from test_json_shapes import _check as check_json_shape
from test_router_sim import context, start_sim_instance

from tensorcast import errors
from tensorcast.engine.server import engine_request
from tensorcast.router.policy import RebalanceParams
from tensorcast.router.server import Router, RouterConfig, RouterHTTPServer


def turn(endpoint: str, session: str, ids: list[int], n: int = 1, timeout_s: float = 60.0) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": n},
        "session_params": {"id": session},
    }
    return engine_request(endpoint, "POST", "/generate", body, timeout_s=timeout_s)


def sessions_on(endpoint: str) -> dict[str, dict]:
    return {r["req_id"]: r for r in engine_request(endpoint, "GET", "/requests")["requests"]}


@pytest.fixture(scope="module")
def sims(cluster):
    procs, endpoints = {}, {}
    try:
        for iid, worker, extra in (
            ("sim-a", "worker-1", ["--cost", "decode_base_s=100"]),
            ("sim-b", "worker-2", []),
            ("sim-c", "worker-2", []),
        ):
            procs[iid], endpoints[iid] = start_sim_instance(cluster, iid, worker, *extra)
        # Four requests that keep sim-a busy for the whole module (their clients give up).
        for k in range(4):
            with pytest.raises(errors.DeadlineExceeded):
                turn(endpoints["sim-a"], f"hog-{k}", context(100 + k, 40), n=5000, timeout_s=0.5)
        with cluster.connect() as rt:
            wait_until(
                lambda: (
                    {i.instance_id: i.running for i in rt.instances() if i.alive}.items()
                    >= {("sim-a", 4), ("sim-b", 0), ("sim-c", 0)}
                ),
                20,
            )
        yield endpoints, procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait(10)


def test_rebalance_dry_run_then_move(cluster, sims):
    endpoints, _ = sims
    first = turn(endpoints["sim-a"], "victim", context(7, 300))
    ended = time.monotonic()
    assert "victim" in sessions_on(endpoints["sim-a"])
    # The store may still hold a load report taken during that turn (sim-a running 5): wait
    # for one taken after it (reports every 0.1 s, forwarded at the worker's heartbeat).
    with cluster.connect() as rt:

        def reported_after_the_turn() -> bool:
            a = next(i for i in rt.instances() if i.instance_id == "sim-a")
            fresh = time.monotonic() - ended > a.heartbeat_age_s + 0.1 + 0.1
            return fresh and (a.waiting, a.running) == (0, 4)

        wait_until(reported_after_the_turn, 20)

    proc = cluster.tc("rebalance", "--dry-run", "--json", check=True)
    record = check_json_shape("rebalance", proc.stdout)
    assert record["samples"] == {"sim-a": 4, "sim-b": 0, "sim-c": 0}
    assert record["decision"]["req_id"] == "victim"
    assert (record["decision"]["source"], record["decision"]["target"]) == ("sim-a", "sim-b")
    tokens = sessions_on(endpoints["sim-a"])["victim"]["tokens"]
    run, key = record["idempotency_key"].split("/", 2)[1:]
    assert key == f"victim/sim-a->sim-b/0/{tokens}" and len(run) == 8
    # Another run never shares a key with this one: plan results are kept for a day, and the
    # same request id at the same point later (a workload run again) must not replay this.
    again = json.loads(cluster.tc("rebalance", "--dry-run", "--json", check=True).stdout)
    assert {k: again["decision"][k] for k in ("req_id", "source", "target")} == {
        k: record["decision"][k] for k in ("req_id", "source", "target")
    }
    assert again["idempotency_key"] != record["idempotency_key"]
    assert record["migration"] is None
    assert "victim" in sessions_on(endpoints["sim-a"])  # dry run: nothing moved

    proc = cluster.tc("rebalance", "--json", check=True)
    record = json.loads(proc.stdout)
    assert record["migration"]["status"] == "ok"
    blocks = (364 + 1) // 8  # 364 prompt + 1 output tokens in blocks of 8
    assert record["migration"]["bytes"] >= blocks * 8 * 64
    assert [s["op"] for s in record["migration"]["steps"]] == [
        "publish",
        "prefetch_many",
        "hydrate",
    ] * 4 + ["evict"]  # in the default 4 parts
    assert "victim" not in sessions_on(endpoints["sim-a"])
    moved = sessions_on(endpoints["sim-b"])["victim"]
    assert moved["migrations"] == 1 and moved["tokens"] == blocks * 8
    nxt = turn(endpoints["sim-b"], "victim", context(7, 300) + first["output_ids"] + [1] * 20)
    assert nxt["meta_info"]["cached_tokens"] == blocks * 8

    # Still imbalanced, but nothing on sim-a is eligible (the hogs are running).
    proc = cluster.tc("rebalance", check=True)
    assert "no eligible request on sim-a" in proc.stdout

    # --every with --ticks is bounded; each tick is one JSON line.
    proc = cluster.tc("rebalance", "--every", "0.01", "--ticks", "2", "--dry-run", "--json")
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert proc.returncode == 0 and [r["tick"] for r in lines] == [1, 2]


def test_a_failed_migration_leaves_its_request_out_until_it_changes(cluster, sims, monkeypatch):
    """A migration that keeps failing (here: the target full) must not win every tick and
    block every other request; `tc rebalance --every` exits non-zero when one failed."""
    from typer.testing import CliRunner

    import tensorcast.sdk.migrate as migrate_module
    from tensorcast.cli.main import app
    from tensorcast.router.rebalance import Rebalancer

    endpoints, _ = sims
    turn(endpoints["sim-a"], "x-big", context(91, 900))
    turn(endpoints["sim-a"], "x-small", context(92, 10))
    tried: list[str] = []

    def target_full(rt, req_id, *args, **kwargs):
        tried.append(req_id)
        raise errors.ResourceExhausted("the target's pool is full")

    params = RebalanceParams(theta_abs=2.0, theta_rel=1.5)
    with cluster.connect() as rt:
        rebalancer = Rebalancer(rt, params, only=["sim-a", "sim-b"], migrate=target_full)
        first = rebalancer.tick()
        second = rebalancer.tick()
    assert first["decision"]["req_id"] == "x-big"
    assert first["migration"]["error"]["kind"] == "ResourceExhausted"
    assert second["decision"] is not None and second["decision"]["req_id"] != "x-big"
    assert tried.count("x-big") == 1 and rebalancer.failed == 2

    monkeypatch.setattr(migrate_module, "migrate", target_full)
    args = ["rebalance", "--every", "0.01", "--ticks", "2", "--state-dir", str(cluster.state_dir)]
    result = CliRunner().invoke(app, [*args, "--instance", "sim-a", "--instance", "sim-b"])
    assert result.exit_code == 1 and "migration(s) failed" in result.output
    assert "x-small" in sessions_on(endpoints["sim-a"])  # nothing moved


def test_router_leaves_a_session_whose_migration_failed_out_until_its_next_turn(
    cluster, sims, router, monkeypatch
):
    import tensorcast.sdk.migrate as migrate_module

    """Any failure, not only a source without KV (the NotFound test above): here the target
    is full. The session is no candidate until a turn changes it."""
    r, addr = router(policy="rebalance", instances=("sim-a", "sim-b"))
    ids = context(93, 200)
    where, first = routed(addr, "y-93", ids)
    assert where == "sim-a"
    tried: list[str] = []

    def target_full(rt, session, *args, **kwargs):
        tried.append(session)
        raise errors.ResourceExhausted("the target's pool is full")

    monkeypatch.setattr(migrate_module, "migrate", target_full)
    no_turn_in_flight(r)
    assert r.tick_once()["decision"]["req_id"] == "y-93"
    wait_until(lambda: r.state()["migrations"], 60)
    assert "ResourceExhausted" in r.state()["migrations"][0]["error"]
    again = r.tick_once()
    assert again["decision"] is None and "no eligible request" in again["reason"]
    routed(addr, "y-93", ids + first["output_ids"] + [5] * 10)
    no_turn_in_flight(r)
    assert r.tick_once()["decision"]["req_id"] == "y-93"  # changed: a candidate again
    wait_until(lambda: len(r.state()["migrations"]) == 2, 60)
    assert tried == ["y-93", "y-93"]


def test_rebalance_bad_input(cluster, sims):
    proc = cluster.tc("rebalance", "--instance", "no-such-instance")
    assert proc.returncode == 4 and "no instance 'no-such-instance'" in proc.stderr
    proc = cluster.tc("rebalance", "--alpha", "0")
    assert proc.returncode == 3 and "alpha" in proc.stderr
    proc = cluster.tc("rebalance", "--every", "inf")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    endpoints, _ = sims
    before = sessions_on(endpoints["sim-a"])
    proc = cluster.tc("migrate", "hog-0", "--from", "sim-a", "--to", "sim-a")
    assert proc.returncode == 3 and "nothing to move" in proc.stderr
    assert sessions_on(endpoints["sim-a"]).keys() == before.keys()


def test_router_start_bad_input(cluster, sims):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = cluster.tc("router", "start", "--listen", f"127.0.0.1:{port}")
    assert proc.returncode == errors.Unavailable.exit_code, proc.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in proc.stderr and "Traceback" not in proc.stderr
    proc = cluster.tc("router", "start", "--tick", "inf")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


@pytest.fixture
def router(cluster, sims):
    made = []

    def make(**kwargs):
        rt = cluster.connect()
        config = RouterConfig(
            tick_s=3600.0,  # ticks are run by the test
            params=RebalanceParams(theta_abs=2.0, theta_rel=1.5),
            block_tokens=8,
            **kwargs,
        )
        r = Router(rt, config).start(wait_for_instances_s=10)
        http = RouterHTTPServer(r).start()
        made.append((r, http, rt))
        return r, http.addr

    yield make
    for r, http, rt in made:
        http.close()
        r.close()
        rt.close()


def no_turn_in_flight(r: Router) -> None:
    """The router counts a turn until its handler returns, just after the client has its reply:
    wait for that before anything that reads the counts (a tick skips running sessions)."""
    wait_until(lambda: all(i["inflight"] == 0 for i in r.state()["instances"]), 20)


def routed(addr: str, session: str, ids: list[int]) -> tuple[str, dict]:
    import http.client

    conn = http.client.HTTPConnection(*addr.split(":"), timeout=60)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}, "session_id": session}
    conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    data = json.loads(response.read())
    assert response.status == 200, data
    return response.getheader("X-TC-Instance"), data


def test_router_rebalance_moves_a_session_and_a_racing_turn_waits(
    cluster, sims, router, monkeypatch
):
    endpoints, _ = sims
    r, addr = router(policy="rebalance", instances=("sim-a", "sim-b"))
    # Place a new session: every index is empty, so the smallest id (sim-a) takes it.
    ids = context(31, 200)
    where, first = routed(addr, "s-31", ids)
    assert where == "sim-a"
    where, again = routed(addr, "s-31", ids + first["output_ids"])
    assert where == "sim-a" and again["meta_info"]["cached_tokens"] > 0  # sticky + cache hit

    # Hold the migration at its start so that a turn can race it.
    import tensorcast.sdk.migrate as migrate_module

    release = threading.Event()
    real = migrate_module.migrate

    def held(*args, **kwargs):
        assert release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(migrate_module, "migrate", held)
    no_turn_in_flight(r)
    record = r.tick_once()
    assert record["decision"]["req_id"] == "s-31"
    assert (record["decision"]["source"], record["decision"]["target"]) == ("sim-a", "sim-b")

    result: dict = {}
    context2 = ids + first["output_ids"] + again["output_ids"] + [2] * 30
    racer = threading.Thread(
        target=lambda: result.update(zip(("where", "reply"), routed(addr, "s-31", context2)))
    )
    racer.start()
    wait_until(lambda: r.state()["waiting_turns"] == 1, 20)
    assert not result  # it waits for the migration, it did not go to the source
    release.set()
    racer.join(60)
    assert result["where"] == "sim-b"
    assert result["reply"]["meta_info"]["cached_tokens"] >= len(ids)  # the moved KV, a hit
    state = r.state()
    (move,) = state["migrations"]
    assert move["status"] == "ok" and move["bytes"] > 0 and move["req_id"] == "s-31"
    assert (state["migrations_ok"], state["migrated_bytes"]) == (1, move["bytes"])
    assert "s-31" not in sessions_on(endpoints["sim-a"])
    # The record is what `tc router state` prints.
    proc = cluster.tc("router", "state", "--router", addr, "--json", check=True)
    assert check_json_shape("router state", proc.stdout)["migrations"][0]["key"] == move["key"]
    proc = cluster.tc("router", "state", "--router", addr, check=True)
    assert "s-31" in proc.stdout and "sim-a -> sim-b" in proc.stdout


def test_rebalance_spreads_new_sessions_that_share_a_prefix(cluster, sims, router):
    """Agent sessions share a long system prompt: placed by cache affinity (the gateway's
    cache-aware rule) they all pile onto the first instance that saw it; the rebalance router
    places a new session on the least busy instance instead (nothing in flight between these
    sequential turns: the one owning the fewest active sessions)."""
    r, addr = router(policy="rebalance", instances=("sim-a", "sim-b"))
    system = context(50, 160)
    picks = [routed(addr, f"sp-{k}", system + context(60 + k, 20))[0] for k in range(4)]
    assert picks == ["sim-a", "sim-b", "sim-a", "sim-b"]
    again, _ = routed(addr, "sp-0", system + context(60, 20) + [3] * 10)
    assert again == "sim-a"  # a known session stays where its cache is
    assert {i["instance_id"]: i["sessions"] for i in r.state()["instances"]} == {
        "sim-a": 2,
        "sim-b": 2,
    }


def test_rebalance_places_new_sessions_by_the_load_its_ticks_see(cluster, sims, router):
    """sim-a reports 4 running requests (the module's hogs, sent around the router): once a
    tick has seen that, new sessions go to sim-b, not to the instance the next ticks would
    move them off."""
    r, addr = router(policy="rebalance", instances=("sim-a", "sim-b"))
    assert r.tick_once()["decision"] is None  # no session to move yet; the loads are in
    picks = [routed(addr, f"pl-{k}", context(110 + k, 20))[0] for k in range(3)]
    assert picks == ["sim-b"] * 3


def test_a_turn_for_an_instance_that_died_goes_to_a_live_one(cluster, sims, router):
    """An instance killed: until discovery drops it (up to a heartbeat TTL), the router still
    lists it. A turn that finds it refusing connections goes to a live instance at once
    (nothing was sent), and it gets no new session meanwhile (it got them all: 503s)."""
    proc, _ = start_sim_instance(cluster, "sim-d", "worker-2")
    try:
        r, addr = router(policy="rebalance", instances=("sim-b", "sim-d"), discover_s=3600.0)
        first = [routed(addr, f"d-{k}", context(80 + k, 20))[0] for k in range(2)]
        assert sorted(first) == ["sim-b", "sim-d"]  # occupancy spreads them
        k = first.index("sim-d")
    finally:
        proc.kill()
        proc.wait(10)
    where, reply = routed(addr, f"d-{k}", context(80 + k, 20) + [1] * 8)
    assert where == "sim-b" and reply["meta_info"]["completion_tokens"] == 1
    assert routed(addr, "d-new", context(90, 20))[0] == "sim-b"
    assert [i["instance_id"] for i in r.state()["instances"]] == ["sim-b", "sim-d"]  # listed


def test_baseline_policies_spread_or_stick(cluster, sims, router):
    _, rr_addr = router(policy="round-robin", instances=("sim-b", "sim-c"))
    picks = [routed(rr_addr, f"rr-{k}", context(200 + k, 20))[0] for k in range(4)]
    assert picks == ["sim-b", "sim-c", "sim-b", "sim-c"]
    cache_router, ca_addr = router(policy="cache-aware", instances=("sim-b", "sim-c"))
    ids = context(300, 100)
    first, reply = routed(ca_addr, "ca-1", ids)
    second, _ = routed(ca_addr, "ca-1", ids + reply["output_ids"] + [4] * 10)
    assert first == second
    assert cache_router.state()["sessions"] == 1
    la_router, la_addr = router(policy="load-aware", instances=("sim-a", "sim-b"))
    where, _ = routed(la_addr, "la-1", context(301, 10))
    assert where in ("sim-a", "sim-b") and la_router.state()["instances"][0]["routed"] >= 0


def test_router_rejects_malformed_requests(cluster, sims, router):
    import http.client

    _, addr = router(policy="round-robin", instances=("sim-b",))
    for body, status in (
        (b"{nope", 400),
        (b"[]", 400),
        (json.dumps({"sampling_params": {}}).encode(), 400),
        (json.dumps({"input_ids": "abc"}).encode(), 400),
        (json.dumps({"input_ids": [1, 2], "rid": 5}).encode(), 400),
        (json.dumps({"input_ids": [-1] * 40}).encode(), 400),
        (json.dumps({"input_ids": [2**40] * 40}).encode(), 400),
        (json.dumps({"input_ids": [True, 1]}).encode(), 400),
        (b"[" * 100_000, 400),  # nesting past Python's recursion limit
    ):
        conn = http.client.HTTPConnection(*addr.split(":"), timeout=30)
        conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        reply = json.loads(response.read())
        assert response.status == status and reply["error"] == "InvalidArgument", body
    conn = http.client.HTTPConnection(*addr.split(":"), timeout=30)
    conn.request("GET", "/nope")
    assert conn.getresponse().status == 404
    bad_params = {"input_ids": [1, 2], "session_params": "s"}
    for path, body, headers, status in (
        ("/generate", json.dumps(bad_params).encode(), {}, 400),
        ("/v1/chat/completions", b'{"messages": []}', {}, 404),  # body never read
        ("/generate", iter([b'{"input_ids": [1]}']), {}, 400),  # sent chunked
    ):
        conn = http.client.HTTPConnection(*addr.split(":"), timeout=30)
        conn.request("POST", path, body, headers)
        response = conn.getresponse()
        reply = json.loads(response.read())
        assert response.status == status, (path, reply)
        # An error closes the connection: an unread body is never parsed as a next request.
        assert response.getheader("Connection") == "close"
    proc = cluster.tc("router", "start", "--policy", "fastest")
    assert proc.returncode == 3 and "unknown policy" in proc.stderr
    proc = cluster.tc("router", "state", "--router", "127.0.0.1:1")
    assert proc.returncode == 7


def test_an_error_reply_before_the_body_is_read_lets_the_client_finish_sending(
    cluster, sims, router
):
    """The router answers a chunked request (refused) before reading its body: the client may
    still be sending it. The router reads and drops the rest before closing, so the client's
    last chunk is not answered with a reset and the connection ends with a clean close."""
    import socket

    _, addr = router(policy="round-robin", instances=("sim-b",))
    host, port = addr.split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            assert chunk, reply
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 400") and b"Connection: close" in reply
        sock.sendall(b'12\r\n{"input_ids": [1]}\r\n0\r\n\r\n')  # the rest, after the reply
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(65536) == b""  # a clean close (a reset raises ConnectionResetError)


def test_a_session_with_nothing_to_move_waits_for_its_next_turn(cluster, sims, router):
    """The engine evicted a session's KV: its migration fails (NotFound), and it is no
    candidate again until a turn makes KV to move, so it cannot fail every tick; that turn
    changes the decision's idempotency key, so the retry never reuses the failed move's
    steps (which published the KV before the turn)."""
    from tensorcast.sdk.plan import CallContext, Plan

    endpoints, _ = sims
    r, addr = router(policy="rebalance", instances=("sim-a", "sim-b"))
    ids = context(71, 120)
    where, first = routed(addr, "s-71", ids)
    assert where == "sim-a"
    with cluster.connect() as rt:
        plan = Plan(CallContext())
        plan.on_instance("sim-a").evict("s-71")
        plan.run(rt)
    assert "s-71" not in sessions_on(endpoints["sim-a"])
    no_turn_in_flight(r)
    record = r.tick_once()
    assert record["decision"]["req_id"] == "s-71"
    failed_key = record["idempotency_key"]
    wait_until(lambda: r.state()["migrations"], 60)
    (move,) = r.state()["migrations"]
    assert move["status"] == "failed" and "NotFound" in move["error"], move
    again = r.tick_once()
    assert again["decision"] is None and "no eligible request" in again["reason"]
    where, _ = routed(addr, "s-71", ids + first["output_ids"] + [6] * 10)
    assert where == "sim-a"  # recomputed on its owner
    no_turn_in_flight(r)
    record = r.tick_once()
    assert record["decision"]["req_id"] == "s-71" and record["idempotency_key"] != failed_key
    wait_until(lambda: len(r.state()["migrations"]) == 2, 60)
    assert r.state()["migrations"][0]["status"] == "ok"
    assert "s-71" in sessions_on(endpoints["sim-b"])


def test_a_move_the_caller_gave_up_on_counts_if_the_gateway_finished_it(
    cluster, sims, router, monkeypatch
):
    """The router's call to the gateway fails (its deadline, the connection) but the gateway
    finishes the plan: the router reads the outcome the store recorded under the decision's
    key, and the session goes to its new owner (its KV left the source)."""
    import tensorcast.sdk.plan as plan_module

    endpoints, _ = sims
    r, addr = router(policy="rebalance", instances=("sim-a", "sim-b"))
    ids = context(81, 120)
    where, first = routed(addr, "s-81", ids)
    assert where == "sim-a"
    real = plan_module.Plan.run

    def finished_but_unanswered(self, *args, **kwargs):
        real(self, *args, **kwargs)
        raise errors.DeadlineExceeded("the answer did not come back in time")

    monkeypatch.setattr(plan_module.Plan, "run", finished_but_unanswered)
    no_turn_in_flight(r)
    record = r.tick_once()
    assert record["decision"]["req_id"] == "s-81"
    wait_until(lambda: r.state()["migrations"], 60)
    (move,) = r.state()["migrations"]
    assert move["status"] == "ok" and move["bytes"] > 0, move
    assert "s-81" not in sessions_on(endpoints["sim-a"])
    where, reply = routed(addr, "s-81", ids + first["output_ids"] + [7] * 10)
    assert where == "sim-b" and reply["meta_info"]["cached_tokens"] >= 120


def test_idle_sessions_are_forgotten_and_the_table_is_bounded(cluster, sims, router, monkeypatch):
    import tensorcast.router.server as server_module

    r, addr = router(
        policy="round-robin",
        instances=("sim-b", "sim-c"),
        session_idle_s=30.0,
        discover_s=3600.0,  # its loop also forgets sessions: only the test's calls here
    )
    for k in range(3):
        routed(addr, f"idle-{k}", context(400 + k, 10))
    no_turn_in_flight(r)  # a session with a turn in flight is never forgotten
    assert r.state()["sessions"] == 3
    now = time.monotonic()
    assert r.forget_idle_sessions(now) == 0  # none idle for 30 s yet
    monkeypatch.setattr(server_module, "MAX_SESSIONS", 2)
    assert r.forget_idle_sessions(now) == 1  # over the cap: the longest idle goes
    assert r.state()["sessions"] == 2
    assert r.forget_idle_sessions(now + 31) == 2
    assert r.state()["sessions"] == 0
    with pytest.raises(errors.InvalidArgument, match="session_idle_s"):
        RouterConfig(session_idle_s=0)


def test_dead_target_mid_migration_leaves_the_session_on_its_source(
    cluster, sims, router, monkeypatch
):
    """Runs last in the module: it kills sim-c."""
    endpoints, procs = sims
    r, addr = router(policy="rebalance", instances=("sim-a", "sim-c"))
    ids = context(41, 120)
    where, first = routed(addr, "s-41", ids)
    assert where == "sim-a"

    import tensorcast.sdk.migrate as migrate_module

    release = threading.Event()
    real = migrate_module.migrate

    def held(*args, **kwargs):
        assert release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(migrate_module, "migrate", held)
    no_turn_in_flight(r)
    record = r.tick_once()
    assert record["decision"]["target"] == "sim-c"
    procs["sim-c"].kill()  # the target dies before the plan reaches it
    procs["sim-c"].wait(10)
    release.set()
    wait_until(lambda: r.state()["migrations"], 60)
    state = r.state()
    (move,) = state["migrations"]
    assert move["status"] == "failed"
    # Its publish moved bytes; the session did not move: not counted as moved.
    assert (state["migrations_ok"], state["migrated_bytes"]) == (0, 0), move
    # Never lost: the source still holds it and the next turn goes there, with its cache.
    assert "s-41" in sessions_on(endpoints["sim-a"])
    where, reply = routed(addr, "s-41", ids + first["output_ids"] + [5] * 10)
    assert where == "sim-a" and reply["meta_info"]["cached_tokens"] >= 120


def test_top_router_view():
    """The router tabs render the state a router serves (fixed data, pilot test). Session
    ids are any client's text: one that reads as markup ("[/]") shows as it is (it crashed
    tc top, in the migrations and in the plans its router recorded)."""
    import asyncio

    from tensorcast.tui.snapshot import ClusterSnapshot
    from tensorcast.tui.top import TopApp
    from tensorcast.types import PlanRecord

    state = {
        "router_id": "r1",
        "policy": "rebalance",
        "load_source": "signals",
        "sessions": 3,
        "migrations_ok": 1,
        "migrated_bytes": 3 << 20,
        "instances": [
            {
                "instance_id": "sim-a",
                "inflight": 4,
                "reported_waiting": 1,
                "reported_running": 4,
                "ewma_load": 4.5,
                "sessions": 2,
                "routed": 9,
            }
        ],
        "migrations": [
            {
                "req_id": "s-1",
                "source": "sim-a",
                "target": "sim-b",
                "status": "ok",
                "bytes": 3 << 20,
                "duration_s": 0.25,
                "at": 990.0,
                "key": "router-r1/s-1/sim-a->sim-b/0/96",
            },
            {
                "req_id": "[/]",
                "source": "sim-a",
                "target": "sim-b",
                "status": "failed",
                "duration_s": 0.5,
                "at": 980.0,
                "key": "router-r1/[/]/sim-a->sim-b/0/65",
            },
        ],
    }
    plan = PlanRecord("router-r1/[/]/sim-a->sim-b/0/65", "[b]t", "failed", {}, 980.0, 981.0)

    class Source:
        def fetch(self):
            return ClusterSnapshot(1000.0, "store:1", plans=(plan,), router=state)

    def cells(app: TopApp, view: str, i: int) -> list[str]:
        return [str(c) for c in app.tables[view].get_row_at(i)]

    async def run():
        app = TopApp(Source(), interval_s=3600, clock=lambda: 1000.0, show_router=True)  # type: ignore[arg-type]
        async with app.run_test() as pilot:
            await pilot.pause()
            await pilot.press("6")
            await pilot.pause()
            assert cells(app, "router", 0) == ["sim-a", "4", "1+4", "4.50", "2", "9"]
            await pilot.press("7")
            await pilot.pause()
            rows = [cells(app, "migrations", i) for i in range(2)]
            row = next(r for r in rows if r[0] == "s-1")
            assert row[:6] == ["s-1", "sim-a", "sim-b", "ok", "3.0 MiB", "0.250s"]
            assert row[6] == "10s ago"
            assert any(r[0] == "[/]" and r[-1] == plan.idempotency_key for r in rows)
            assert "1 migrations" in str(app.status.content)
            await pilot.press("5")
            await pilot.pause()
            assert cells(app, "plans", 0)[:2] == ["[b]t", plan.idempotency_key]

    asyncio.run(run())


def test_turns_past_the_router_limit_are_refused_at_once(cluster, sims, router, monkeypatch):
    """Each turn holds a thread and its body until its instance answers: past MAX_TURNS at
    once the router answers 503 instead of taking more (here the limit is 0)."""
    import http.client

    import tensorcast.router.server as server_module

    monkeypatch.setattr(server_module, "MAX_TURNS", 0)
    _, addr = router(policy="round-robin", instances=("sim-b",))
    conn = http.client.HTTPConnection(*addr.split(":"), timeout=30)
    conn.request("POST", "/generate", json.dumps({"input_ids": [1, 2]}))
    response = conn.getresponse()
    reply = json.loads(response.read())
    assert response.status == 503 and "turns at once" in reply["message"]


def test_a_stopping_router_removes_only_its_own_record(tmp_path):
    """Router A on :3011, then B on :30114 (the record names B): A stopping kept a record
    holding its address as a substring, and deleted B's."""
    from tensorcast.cli.router import _names

    record = tmp_path / "router.json"
    record.write_text(json.dumps({"addr": "127.0.0.1:30114", "pid": 2, "policy": "rebalance"}))
    assert not _names(record, {"addr": "127.0.0.1:3011", "pid": 1})
    assert _names(record, {"addr": "127.0.0.1:30114", "pid": 2})
    record.write_text("{not json")
    assert not _names(record, {"addr": "127.0.0.1:30114", "pid": 2})


def test_a_session_begun_again_never_reuses_an_earlier_ones_decision_key(monkeypatch):
    """Decision keys name the session's history (migrations, tokens): a session forgotten
    (idle) and begun again under the same id could reach the same history, and its move
    would replay the earlier move's recorded "ok" (the store keeps plan results a day)
    without moving anything. Each session the router begins has a serial in its keys."""
    from tensorcast.types import InstanceInfo

    class Signals:
        def list_instances(self):
            return [
                InstanceInfo("a", "w", "sim", "127.0.0.1:1", running=9),
                InstanceInfo("b", "w", "sim", "127.0.0.1:2"),
            ]

    class Runtime:
        def signals(self):
            return Signals()

    r = Router(Runtime(), RouterConfig(params=RebalanceParams(theta_abs=2.0, theta_rel=1.5)))  # type: ignore[arg-type]
    moves: list[str] = []

    def migrate(session, source, target, key):
        moves.append(key)
        with r._cv:
            r._sessions[session].migrating = False
            r._migrating -= 1

    monkeypatch.setattr(r, "_migrate", migrate)
    r.discover()
    for incarnation in (1, 2):
        assert r.acquire("s", list(range(64)))[0] == "a"
        r.release("s", "a", 64)
        record = r.tick_once()
        wait_until(lambda n=incarnation: len(moves) == n, 10)
        assert record["idempotency_key"].startswith(f"router-{r.router_id}/{incarnation}/s/")
        assert r.forget_idle_sessions(now=time.monotonic() + 10**6) == 1
        r._loads = {}  # as a fresh router's: the next placement is by occupancy again
    assert moves[0] != moves[1]
