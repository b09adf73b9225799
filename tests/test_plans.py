"""Plans, instances and signals on a real cluster: engine instances in their own processes
attached to workers, KV caches migrated mid-generation, idempotency keys, deadlines, retries,
and malformed plans rejected before anything runs."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch
from conftest import start_cluster, wait_until
from kv_engine import PROMPT, generate, save_llama
from test_json_shapes import _check as check_json_shape

import tensorcast as tc
from tensorcast.engine.hf import HFEngine
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.sdk.instance import InstanceRuntime, manifest_key
from tensorcast.worker.plans import MAX_BACKOFF_S, RETRY_WINDOW_S


@pytest.fixture(scope="module")
def model_id(cluster, tmp_path_factory):
    directory = save_llama(tmp_path_factory.mktemp("llama"))
    cluster.tc("put", "kv-llama@v1", str(directory), check=True)
    return "kv-llama@v1"


@pytest.fixture(scope="module")
def instances(cluster, model_id):
    """inst-a on worker-1 and inst-b on worker-2, each its own `tc instance start` process."""
    procs, endpoints = [], {}
    try:
        for iid, worker in (("inst-a", "worker-1"), ("inst-b", "worker-2")):
            ready = cluster.state_dir / f"{iid}.ready"
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "tensorcast.cli.main",
                        "instance",
                        "start",
                        "--worker",
                        worker,
                        "--model",
                        model_id,
                        "--id",
                        iid,
                        "--page-tokens",
                        "8",
                        "--ready-file",
                        str(ready),
                        "--state-dir",
                        str(cluster.state_dir),
                    ],
                    stdout=open(cluster.state_dir / f"{iid}.log", "w"),  # noqa: SIM115
                    stderr=subprocess.STDOUT,
                )
            )
        for iid, proc in zip(("inst-a", "inst-b"), procs):
            ready = cluster.state_dir / f"{iid}.ready"
            wait_until(lambda r=ready, p=proc: r.exists() or p.poll() is not None, 90)
            assert proc.poll() is None, (cluster.state_dir / f"{iid}.log").read_text()[-3000:]
            endpoints[iid] = json.loads(ready.read_text())["endpoint"]
        with cluster.connect() as rt:
            wait_until(
                lambda: {i.instance_id for i in rt.instances() if i.alive} >= {"inst-a", "inst-b"},
                30,
            )
        yield endpoints
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


def test_migrate_mid_generation_continues_token_identically(cluster, instances):
    a, b = instances["inst-a"], instances["inst-b"]
    reference = generate(a, "ref", PROMPT, 24)
    assert len(set(reference)) > 4  # a degenerate sequence would prove little
    first = generate(a, "req-1", PROMPT, 10)
    proc = cluster.tc(
        "migrate",
        "req-1",
        "--from",
        "inst-a",
        "--to",
        "inst-b",
        "--key",
        "move-req-1",
        "--json",
        check=True,
    )
    result = check_json_shape("migrate", proc.stdout)
    parts = 4  # the default; the reference engine cannot cut its export: all of it is part 0
    assert [s["op"] for s in result["steps"]] == [
        "publish",
        "prefetch_many",
        "hydrate",
    ] * parts + ["evict"]
    assert [s["worker"] for s in result["steps"]] == [
        "worker-1",
        "worker-2",
        "worker-2",
    ] * parts + ["worker-1"]
    hydrated = [s["result"] for s in result["steps"] if s["op"] == "hydrate"]
    assert [h["resident"] for h in hydrated] == [True, False, False, False]
    assert hydrated[0]["pages"] > 0 and [h["pages"] for h in hydrated[1:]] == [0, 0, 0]
    # Pages homed elsewhere were copied to inst-b's worker before hydrate, exactly once.
    with cluster.connect() as rt:
        table, w2 = rt.shards(), rt.resolve_worker("worker-2").worker_id
    pages = result["steps"][0]["result"]["pages"]
    remote = sum(p["size_bytes"] for p in pages if table.lease(p["shard"]).holder_worker_id != w2)
    assert result["steps"][1]["bytes"] == remote
    rest = generate(b, "req-1", None, 14)
    assert first + rest == reference
    with pytest.raises(tc.NotFound):  # evicted from the source
        generate(a, "req-1", None, 1)

    # The same key again: the recorded result, nothing executed (the source has no req-1 now,
    # so running publish again would fail).
    again = json.loads(
        cluster.tc(
            "migrate",
            "req-1",
            "--from",
            "inst-a",
            "--to",
            "inst-b",
            "--key",
            "move-req-1",
            "--json",
            check=True,
        ).stdout
    )
    assert again["replayed"] and again["trace_id"] == result["trace_id"]
    plans = check_json_shape("plans", cluster.tc("plans", "--json", check=True).stdout)["plans"]
    assert sum(p["idempotency_key"] == "move-req-1" for p in plans) == 1
    # Every worker the plan touched logged its steps under the trace id.
    logs = "".join((cluster.state_dir / "logs" / f"worker-{i}.log").read_text() for i in (1, 2))
    assert logs.count(f"trace={result['trace_id']}") >= 8


def test_publish_hydrate_cli_and_signals(cluster, instances):
    a, b = instances["inst-a"], instances["inst-b"]
    reference = generate(a, "ref-2", PROMPT[:20], 12)
    generate(a, "req-2", PROMPT[:20], 5)
    out = check_json_shape(
        "publish",
        cluster.tc("publish", "req-2", "--instance", "inst-a", "--json", check=True).stdout,
    )
    pages = out["steps"][0]["result"]["pages"]
    assert pages[0]["key"] == manifest_key("req-2") and len(pages) > 1
    check_json_shape(
        "hydrate",
        cluster.tc("hydrate", "req-2", "--instance", "inst-b", "--json", check=True).stdout,
    )
    check_json_shape("instances", cluster.tc("instances", "--json", check=True).stdout)
    assert generate(b, "req-2", None, 7) == reference[5:]
    with cluster.connect() as rt:
        snapshot = rt.signals().list_instances()
        assert snapshot.age_s < 5
        by_id = {i.instance_id: i for i in snapshot}
        assert by_id["inst-b"].worker_name == "worker-2" and by_id["inst-b"].endpoint == b
        wait_until(
            lambda: {i.instance_id: i for i in rt.instances()}["inst-b"].cached_tokens >= 31, 30
        )
        workers = rt.signals().list_workers()
        assert {s.worker.name for s in workers} == {"worker-1", "worker-2"}
        assert all(s.healthy and s.worker.heartbeat_age_s < 3 for s in workers)
    assert cluster.tc("hydrate", "no-such-req", "--instance", "inst-b").returncode == 4


def test_malformed_plans_are_rejected_before_anything_runs(cluster, instances):
    with cluster.connect() as rt:

        def plan() -> tc.Plan:
            p = tc.Plan(tc.CallContext(deadline_ms=60_000))
            p.on_instance("inst-a").evict("never-ran")
            return p

        p = plan()
        p.on_instance("nobody").publish("x")
        with pytest.raises(tc.NotFound, match="no instance 'nobody'"):  # as `tc migrate` says
            p.run(rt)
        p = plan()
        p.on_worker("no-worker").pin("kv-llama@v1")
        with pytest.raises(tc.NotFound, match="no worker"):
            p.run(rt)
        gateway = rt.worker_stub(rt.gateways()[0])
        bad = {
            "cycle": [{"after": [1]}, {"after": [0]}],
            "later input": [{"args": {"req_id": {"$step": 1}}}, {}],
            "unknown op": [{"op": "format_disk"}],
            "wrong type": [{"args": {"req_id": 5}}],
            "unknown argument": [{"args": {"req_id": "never-ran", "reqid": "x"}}],
            "bad reference": [{}, {"args": {"req_id": {"$step": 0, "field": ["req_id"]}}}],
            "too deep": [{"args": {"req_id": json.loads("[" * 40 + "]" * 40)}}],
        }
        for name, changes in bad.items():
            steps = [
                dict(
                    {
                        "id": i,
                        "target": {"kind": "instance", "id": "inst-a"},
                        "op": "evict",
                        "args": {"req_id": "never-ran"},
                        "after": [],
                    },
                    **c,
                )
                for i, c in enumerate(changes)
            ]
            body = {"trace_id": name, "deadline_ms": 5000, "steps": steps}
            with pytest.raises(tc.InvalidArgument):
                gateway.call("RunPlan", pb.PlanRequest(plan_json=json.dumps(body)))
        # Nothing ran: no plan was recorded for any of them.
        assert not {p.trace_id for p in rt.plans(100)} & set(bad)
        # The SDK checks the same before sending anything.
        p = plan()
        p.on_worker("worker-1").prefetch("kv-llama@v1", streams="many")
        with pytest.raises(tc.InvalidArgument, match="'streams' must be int, not string"):
            p.run(rt)
        p = plan()
        p.on_worker("worker-1").pin("kv-llama@v1", ttl_s=5)
        with pytest.raises(tc.InvalidArgument, match="unknown argument 'ttl_s'"):
            p.run(rt)


class _TestEngine(HFEngine):
    """The reference engine with a slow or failing export, to drive deadlines and retries."""

    def __init__(self, model, delay_s: float = 0.0, failures: int = 0) -> None:
        super().__init__(model, page_tokens=8)
        self.delay_s = delay_s
        self.failures = failures
        self.released = threading.Event()  # set: exports stop waiting out `delay_s`
        self.exports = 0  # exports started

    def export_kv(self, req_id):
        if self.failures:
            self.failures -= 1
            raise tc.Unavailable("engine busy, try again")
        self.exports += 1
        self.released.wait(self.delay_s)
        return super().export_kv(req_id)


@pytest.fixture
def local_instance(cluster, model_id):
    from tensorcast.integrations.transformers import load_model

    made = []

    def make(iid: str, **kw) -> _TestEngine:
        rt = cluster.connect()
        engine = _TestEngine(load_model(rt, model_id), **kw)
        made.append((rt, InstanceRuntime(rt, engine, rt.resolve_worker("worker-1"), iid).start()))
        with cluster.connect() as probe:
            wait_until(lambda: any(i.instance_id == iid for i in probe.instances()), 30)
        return engine

    yield make
    for rt, inst in made:
        inst.close()
        rt.close()


def test_deadline_mid_plan_keeps_finished_steps_and_rerun_reuses_them(
    cluster, instances, local_instance
):
    engine = local_instance("slow", delay_s=60.0)
    engine.generate("r", PROMPT[:12], 3)
    generate(instances["inst-a"], "req-3", PROMPT[:12], 3)
    with cluster.connect() as rt:
        ctx = tc.CallContext(deadline_ms=1200, idempotency_key="deadline-test")
        p = tc.Plan(ctx)
        p.on_instance("inst-a").publish("req-3")
        p.on_instance("slow").publish("r", after=[])
        started = time.monotonic()
        with pytest.raises(tc.DeadlineExceeded) as info:
            p.run(rt)
        assert time.monotonic() - started < 30  # the 1.2 s deadline, not the 60 s step
        steps = info.value.result["steps"]
        assert steps[0]["status"] == "ok" and steps[0]["result"]["pages"]
        assert steps[1]["status"] == "failed"
        assert steps[1]["error"]["kind"] == "DeadlineExceeded"
        assert rt.pages().exists_pages([manifest_key("req-3")]) == [True]  # step 0's output stays
        # Re-run under the same key with time to spare: step 0 is reused, only step 1 runs.
        engine.delay_s = 0.0
        engine.released.set()
        p2 = tc.Plan(tc.CallContext(deadline_ms=10_000, idempotency_key="deadline-test"))
        p2.on_instance("inst-a").publish("req-3")
        p2.on_instance("slow").publish("r")
        result = p2.run(rt)
        assert [s["status"] for s in result["steps"]] == ["reused", "ok"]


def test_retryable_step_failures_are_retried_with_backoff(cluster, local_instance):
    engine = local_instance("flaky", failures=2)
    engine.generate("r", PROMPT[:9], 2)

    def publish(deadline_ms: int) -> dict:
        with cluster.connect() as rt:
            p = tc.Plan(tc.CallContext(deadline_ms=deadline_ms))
            p.on_instance("flaky").publish("r")
            return p.run(rt)

    step = publish(10_000)["steps"][0]
    assert step["retries"] == 2 and step["status"] == "ok"
    # A failure lasting as long as a shard home's failover (about 3 s) is ridden out: pauses
    # of 0.05, 0.1, 0.2, 0.4 s then 0.5 s each add up to 2.75 s before the ninth attempt.
    engine.failures = 8
    step = publish(30_000)["steps"][0]
    assert step["status"] == "ok" and step["retries"] == 8 and step["duration_s"] >= 2.75
    # A lasting failure is given up on: after the retry window, even with time left...
    engine.failures = 1000
    with pytest.raises(tc.Unavailable) as info:
        publish(30_000)
    step = info.value.result["steps"][0]
    assert RETRY_WINDOW_S - MAX_BACKOFF_S <= step["duration_s"] < 15, step
    # ...or at the deadline, if that comes first.
    with pytest.raises(tc.Unavailable) as info:
        publish(1_500)
    step = info.value.result["steps"][0]
    assert step["retries"] >= 3 and step["duration_s"] < RETRY_WINDOW_S, step


def test_manifest_and_transform_into_run_inside_the_instance(cluster, instances, local_instance):
    engine = local_instance("filler")
    params = engine.buffers()
    name = "model.layers.0.mlp.down_proj.weight"
    before = params[name].clone()
    ptr = params[name].data_ptr()
    with torch.no_grad():
        params[name].zero_()
    generate(instances["inst-a"], "req-4", PROMPT[:9], 2)
    with cluster.connect() as rt:
        p = tc.Plan(tc.CallContext(deadline_ms=20_000))
        filled = p.on_instance("filler").transform_into("kv-llama@v1")
        published = p.on_instance("inst-a").publish("req-4")
        listed = p.on_instance("inst-a").manifest("req-4", after=[published])
        result = p.run(rt, concurrency=2)
    assert result["steps"][filled.step_id]["result"]["filled"] == len(params)
    assert torch.equal(params[name], before) and params[name].data_ptr() == ptr  # in place
    steps = result["steps"]
    assert steps[listed.step_id]["result"]["pages"] == steps[published.step_id]["result"]["pages"]


def test_a_killed_gateway_still_listed_alive_is_skipped_for_the_next(tmp_path, monkeypatch):
    # A long heartbeat TTL keeps the killed gateway listed alive for the whole test, so the
    # plan below meets it first every time (names sort "a-gateway" before "worker-1").
    monkeypatch.setenv("TC_HEARTBEAT_TTL_S", "120")
    for cluster in start_cluster(tmp_path / "state", workers=1, mem="64MiB"):
        with cluster.connect() as rt:
            rt.put({"w": torch.arange(16.0)}, "gw-x", worker="worker-1")
            with cluster.extra_worker("a-gateway", "--roles", "basic,gateway") as gateway:
                wait_until(lambda: rt.gateways()[0].name == "a-gateway", 30)
                gateway.kill()
                gateway.wait(30)
                assert [w.name for w in rt.gateways()] == ["a-gateway", "worker-1"]
                plan = tc.Plan(tc.CallContext(deadline_ms=20_000, idempotency_key="gw-failover"))
                plan.on_worker("worker-1").pin("gw-x")
                result = plan.run(rt)
                assert result["status"] == "ok" and result["gateway"] == "worker-1"
                assert result["steps"][0]["status"] == "ok"
                # Named, the dead gateway is the only one tried: a clear error, nothing run.
                named = tc.Plan(tc.CallContext(deadline_ms=20_000))
                named.on_worker("worker-1").pin("gw-x")
                with pytest.raises(tc.Unavailable, match="a-gateway"):
                    named.run(rt, gateway="a-gateway")
                # A step on the dead worker fails as Unavailable (the public class of the RPC
                # client's Unreachable), so callers can tell it from a bug.
                doomed = tc.Plan(tc.CallContext(deadline_ms=3_000))
                doomed.on_worker("a-gateway").pin("gw-x")
                with pytest.raises(tc.Unavailable) as info:
                    doomed.run(rt)
                step = info.value.result["steps"][0]
                assert step["status"] == "failed" and step["error"]["kind"] == "Unavailable"


def test_a_step_input_that_does_not_resolve_fails_the_plan_and_records_it(cluster):
    """A later step naming a field its input's result lacks fails that step; the plan is
    recorded failed (not left "running", which would hold a rerun under the key until the
    deadline), so the corrected plan runs at once (another plan: nothing is reused)."""
    with cluster.connect() as rt:
        rt.put({"w": torch.ones(8)}, "plans/resolve")
        key = "resolve-key"

        def plan(field: str) -> tc.Plan:
            p = tc.Plan(tc.CallContext(deadline_ms=30_000, idempotency_key=key))
            first = p.on_worker("worker-2").prefetch("plans/resolve")
            p.on_worker("worker-2").pin(getattr(first, field))
            return p

        with pytest.raises(tc.InvalidArgument, match="no result field 'pagez'") as info:
            plan("pagez").run(rt)
        assert [s["status"] for s in info.value.result["steps"]] == ["ok", "failed"]
        assert rt.plan(key).status == "failed"
        result = plan("artifact").run(rt)
        assert [s["status"] for s in result["steps"]] == ["ok", "ok"]
        assert rt.plan(key).status == "ok"


def test_a_rerun_reuses_only_steps_asked_the_same(cluster):
    """Steps of a failed run are reused by a rerun under the same key only when the step is the
    same: same op and target, and the same arguments."""
    with cluster.connect() as rt:
        for name in ("plans/a", "plans/b"):
            rt.put({"w": torch.full((8,), float(len(name)))}, name)
        key = "args-key"
        first = tc.Plan(tc.CallContext(deadline_ms=30_000, idempotency_key=key))
        first.on_worker("worker-2").prefetch("plans/a")
        first.on_worker("worker-2").prefetch("plans/missing")
        with pytest.raises(tc.NotFound):
            first.run(rt)
        second = tc.Plan(tc.CallContext(deadline_ms=30_000, idempotency_key=key))
        second.on_worker("worker-2").prefetch("plans/b")
        second.on_worker("worker-2").prefetch("plans/a")
        result = second.run(rt)
        assert [s["status"] for s in result["steps"]] == ["ok", "ok"]
        assert result["steps"][0]["result"]["artifact"] == "plans/b"


def test_a_finished_key_replays_even_when_its_target_is_gone(cluster):
    """A caller whose reply was lost sends the plan again under its key; the worker the plan
    ran on has stopped since: the recorded result comes back, not an error about the target."""
    with cluster.connect() as rt:
        rt.put({"w": torch.ones(8)}, "plans/replay")
        key = "replay-key"

        def plan() -> tc.Plan:
            p = tc.Plan(tc.CallContext(deadline_ms=30_000, idempotency_key=key))
            p.on_worker("plans-extra").prefetch("plans/replay")
            return p

        with cluster.extra_worker("plans-extra"):
            first = plan().run(rt)
        wait_until(lambda: not any(w.name == "plans-extra" and w.alive for w in rt.workers()), 60)
        again = plan().run(rt)
        assert again["replayed"] is True and again["status"] == "ok"
        assert again["steps"] == first["steps"]


def test_an_instance_operation_that_waited_past_its_deadline_is_not_run(cluster, local_instance):
    """An instance runs MAX_OPS_IN_FLIGHT operations at once; the others wait. One whose plan
    gave up while it waited is not run when its turn comes (the plan is recorded failed, and
    a retry would run it a second time)."""
    from tensorcast.sdk.instance import MAX_OPS_IN_FLIGHT

    engine = local_instance("stuck", delay_s=120.0)
    engine.generate("r", PROMPT[:9], 2)
    failed_at = []

    def publish(deadline_ms: int) -> None:
        with cluster.connect() as rt:
            p = tc.Plan(tc.CallContext(deadline_ms=deadline_ms))
            p.on_instance("stuck").publish("r")
            try:
                p.run(rt)
            except tc.DeadlineExceeded:
                failed_at.append(time.monotonic())

    plans = [threading.Thread(target=publish, args=(1500,)) for _ in range(MAX_OPS_IN_FLIGHT + 2)]
    for t in plans:
        t.start()
    for t in plans:
        t.join(60)
    assert len(failed_at) == len(plans)
    assert engine.exports == MAX_OPS_IN_FLIGHT  # the other two wait for a thread
    # Their deadline (at most the plans' 1.5 s, counted from when the instance took them) has
    # passed: the condition this test is about is time itself.
    wait_until(lambda: time.monotonic() > max(failed_at) + 3.0, 10, 0.1)
    engine.delay_s = 0.0
    engine.released.set()
    with cluster.connect() as rt:  # queued behind the two: when it is done, so are they
        p = tc.Plan(tc.CallContext(deadline_ms=60_000))
        p.on_instance("stuck").publish("r")
        assert p.run(rt)["status"] == "ok"
    assert engine.exports == MAX_OPS_IN_FLIGHT + 1


def test_a_context_without_a_key_runs_every_plan_and_a_key_names_one_plan(cluster):
    """Without an idempotency key every run is new, even with the CallContext reused; with a
    key, the same plan again replays its result and another plan under it is refused."""
    with cluster.connect() as rt:
        for name in ("plans/ctx-a", "plans/ctx-b"):
            rt.put({"w": torch.ones(8)}, name)
        ctx = tc.CallContext(deadline_ms=30_000)
        first = tc.Plan(ctx)
        first.on_worker("worker-2").prefetch("plans/ctx-a")
        second = tc.Plan(ctx)
        second.on_worker("worker-2").prefetch("plans/ctx-b")
        assert first.run(rt)["steps"][0]["result"]["artifact"] == "plans/ctx-a"
        again = second.run(rt)
        assert again["replayed"] is False
        assert again["steps"][0]["result"]["artifact"] == "plans/ctx-b"
        assert second.run(rt)["replayed"] is False  # the same plan, run anew

        def keyed(name: str) -> tc.Plan:
            p = tc.Plan(tc.CallContext(deadline_ms=30_000, idempotency_key="one-plan-key"))
            p.on_worker("worker-2").prefetch(name)
            return p

        assert keyed("plans/ctx-a").run(rt)["replayed"] is False
        assert keyed("plans/ctx-a").run(rt)["replayed"] is True
        with pytest.raises(tc.InvalidArgument, match="names another plan"):
            keyed("plans/ctx-b").run(rt)


def test_a_plan_finds_a_worker_restarted_under_its_name(cluster):
    """A worker killed and started again under its name is listed twice until the dead entry
    expires: a plan naming it runs on the live one."""
    with cluster.connect() as rt:
        rt.put({"w": torch.ones(8)}, "plans/restarted")
        with cluster.extra_worker("plans-rs") as first:
            first.kill()
            first.wait(30)
        wait_until(lambda: any(w.name == "plans-rs" and not w.alive for w in rt.workers()), 60)
        with cluster.extra_worker("plans-rs"):
            named = [w for w in rt.workers() if w.name == "plans-rs"]
            assert sorted(w.alive for w in named) == [False, True]
            p = tc.Plan(tc.CallContext(deadline_ms=30_000))
            p.on_worker("plans-rs").prefetch("plans/restarted")
            assert p.run(rt)["steps"][0]["worker"] == "plans-rs"


def test_a_gateway_refuses_plans_past_its_limit_instead_of_starving_its_other_calls(cluster):
    """Callers waiting on a key that runs elsewhere each hold a gateway thread: past
    MAX_PLANS_IN_FLIGHT a gateway refuses (ResourceExhausted) and keeps answering its other
    calls; the waiters get the result once the key finishes."""
    from concurrent.futures import ThreadPoolExecutor

    from tensorcast.rpc.convert import plan_to_pb
    from tensorcast.types import PlanRecord
    from tensorcast.worker.plans import MAX_PLANS_IN_FLIGHT

    with cluster.connect() as rt:
        rt.put({"w": torch.ones(8)}, "plans/limit")
        body = tc.Plan(tc.CallContext(deadline_ms=60_000, idempotency_key="limit-key"))
        body.on_worker("worker-2").prefetch("plans/limit")
        plan = body.to_json()
        held = PlanRecord(
            "limit-key", "elsewhere", "running", {}, 0.0, deadline_at=time.time() + 60
        )
        assert rt.store.call("BeginPlan", plan_to_pb(held)).started  # "runs elsewhere"
        gateway = rt.worker_stub(rt.resolve_worker("worker-1"))
        request = pb.PlanRequest(plan_json=json.dumps(plan))
        with ThreadPoolExecutor(MAX_PLANS_IN_FLIGHT) as pool:
            waiting = [
                pool.submit(gateway.call, "RunPlan", request, timeout_s=90)
                for _ in range(MAX_PLANS_IN_FLIGHT)
            ]
            wait_until(lambda: _in_flight(cluster, "worker-1") == MAX_PLANS_IN_FLIGHT, 30)
            with pytest.raises(tc.ResourceExhausted, match=f"runs {MAX_PLANS_IN_FLIGHT} plans"):
                gateway.call("RunPlan", request, timeout_s=5)
            gateway.call("Status", pb.Empty(), timeout_s=5)  # its other calls still answered
            done = {"status": "ok", "steps": [], "error": None}
            rt.store.call(
                "FinishPlan", plan_to_pb(PlanRecord("limit-key", "elsewhere", "ok", done, 0.0))
            )
            for fut in waiting:
                assert json.loads(fut.result(60).result_json)["replayed"] is True


def _in_flight(cluster, worker_name: str) -> float:
    proc = next(p for p in cluster.record.processes if p.name == worker_name)
    with urllib.request.urlopen(f"http://{proc.metrics_addr}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("tc_plans_in_flight "):
                return float(line.split()[1])
    raise AssertionError("tc_plans_in_flight missing from /metrics")
