"""Chaos: real client and worker processes SIGKILLed at random points of every operation, with
the promised invariants checked after each round (docs/architecture.md, "What chaos checks").

Each round picks an operation kind and a victim from a seeded generator, starts a fresh worker
and real actor processes (tests/chaos/actor.py) looping that operation, waits until they have
acknowledged work, kills the victim (one actor or the fresh worker) after a random delay, lets
the survivors go on past the fault, kills them too, then checks:

1. no reader ever got wrong bytes (actors check every read and journal mismatches);
2. every acknowledged artifact with a live replica reads back exactly as written;
3. every plan and migration acknowledged (or cut off mid-flight) reruns under its idempotency
   key: an acknowledged one returns the recorded result, a cut-off one completes and then
   returns its own record;
4. pool accounting: once the round's artifacts are deleted and the killed callers' connections
   closed, every surviving worker's caller holds and non-page bytes are back to what they were
   before the round (no leaked hold, reservation or region);
and at the end, after `tc down`, no process of the cluster or of the rounds is left.

CI runs one round per kind (`pytest tests/chaos`); `--chaos-rounds N` runs N rounds (kinds in
seeded order), `--chaos-kinds put,pages` only those kinds, and `--chaos-seed S` replays a run
(the seed of every round is printed).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import Cluster, start_cluster, wait_until
from kv_engine import save_llama

import tensorcast as tc
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.sdk.migrate import migrate

KINDS = ["put", "dedupe", "prefetch", "pin", "pages", "weights", "plan", "migrate"]
ACTORS = {"dedupe": 6}  # actors per round; 2 for the other kinds
# Kinds whose operations touch the round's fresh worker, so killing it is a fault they meet.
WORKER_VICTIM_KINDS = {"put", "dedupe", "prefetch", "pin", "pages", "plan"}
ACTOR = Path(__file__).with_name("actor.py")


@pytest.fixture(scope="module")
def chaos(tmp_path_factory, request):
    """A store and two workers; instances chaos-a/chaos-b (reference engine) for migrations.
    Unnamed contents of killed writers are collected after 2 s instead of 120 s."""
    saved = os.environ.get("TC_UNREFERENCED_GRACE_S")
    os.environ["TC_UNREFERENCED_GRACE_S"] = "2"
    root = tmp_path_factory.mktemp("chaos")
    spawned: list[subprocess.Popen] = []
    try:
        for cluster in start_cluster(root / "state", workers=2, mem="256MiB"):
            cluster.tc("put", "chaos-llama@v1", str(save_llama(root / "llama")), check=True)
            for iid, worker in (("chaos-a", "worker-1"), ("chaos-b", "worker-2")):
                spawned.append(_start_instance(cluster, iid, worker))
            with cluster.connect() as rt:
                wait_until(
                    lambda: (
                        {i.instance_id for i in rt.instances() if i.alive} >= {"chaos-a", "chaos-b"}
                    ),
                    120,
                )
            yield cluster, spawned
            for proc in spawned:
                proc.terminate()
                proc.wait(30)
    finally:
        for proc in spawned:
            if proc.poll() is None:
                proc.kill()
        if saved is None:
            os.environ.pop("TC_UNREFERENCED_GRACE_S", None)
        else:
            os.environ["TC_UNREFERENCED_GRACE_S"] = saved


def _start_instance(cluster: Cluster, iid: str, worker: str) -> subprocess.Popen:
    log = open(cluster.state_dir / f"{iid}.log", "w")  # noqa: SIM115 - the child writes it
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorcast.cli.main",
            "instance",
            "start",
            "--worker",
            worker,
            "--model",
            "chaos-llama@v1",
            "--id",
            iid,
            "--page-tokens",
            "8",
            "--state-dir",
            str(cluster.state_dir),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _start_worker(cluster: Cluster, name: str) -> subprocess.Popen:
    ready = cluster.state_dir / "run" / f"{name}.chaos.json"
    log = open(cluster.state_dir / f"{name}.log", "w")  # noqa: SIM115 - the child writes it
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorcast.cli.main",
            "worker",
            "start",
            "--store",
            cluster.record.store_addr,
            "--mem",
            "128MiB",
            "--name",
            name,
            "--ready-file",
            str(ready),
        ],
        env={**os.environ, "TC_TOKEN": cluster.token},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    wait_until(lambda: ready.exists() or proc.poll() is not None, 60)
    assert proc.poll() is None, (cluster.state_dir / f"{name}.log").read_text()[-2000:]
    return proc


def _journal(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    # A line cut by the kill is not an acknowledgement.
    return [json.loads(line) for line in lines if line.endswith("}")]


def _ops(path: Path) -> int:
    return sum(1 for r in _journal(path) if "op" in r)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def _worker_status(rt: tc.Runtime) -> dict[str, pb.WorkerStatus]:
    """Every reachable worker's own view (a killed one may still be listed as alive)."""
    status = {}
    for w in rt.workers():
        try:
            status[w.name] = rt.worker_stub(w).call("Status", pb.Empty(), timeout_s=5)
        except tc.Unavailable:
            pass
    return status


def _accounting(status: pb.WorkerStatus) -> tuple[int, int]:
    """(caller holds, pool bytes neither KV pages nor regions live page connections hold for
    their next puts): what a leaked hold, reservation or region would change."""
    pages = status.page_region_bytes + status.page_uncommitted_bytes
    return status.num_holds, status.worker.mem_used_bytes - pages


def _rounds(request) -> list[tuple[int, str]]:
    seed = request.config.getoption("--chaos-seed")
    seed = int(seed) if seed is not None else random.SystemRandom().randrange(2**31)
    chosen = request.config.getoption("--chaos-kinds")
    chosen = chosen.split(",") if chosen else KINDS
    assert set(chosen) <= set(KINDS), f"--chaos-kinds: choose from {', '.join(KINDS)}"
    count = request.config.getoption("--chaos-rounds") or len(chosen)
    rnd = random.Random(seed)
    kinds = []
    while len(kinds) < count:
        kinds += rnd.sample(chosen, len(chosen))  # every kind once per len(chosen) rounds
    print(f"chaos: seed {seed} ({count} rounds); replay with --chaos-seed {seed}")
    return [(rnd.randrange(2**31), kind) for kind in kinds[:count]]


def test_chaos_rounds_keep_every_promise(chaos, request, tmp_path):
    cluster, spawned = chaos
    started: list[subprocess.Popen] = []
    try:
        for number, (seed, kind) in enumerate(_rounds(request)):
            _round(cluster, tmp_path, number, seed, kind, started)
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
    # Promise 5: after `tc down` nothing of the cluster or of the rounds is left running.
    for proc in spawned:
        proc.terminate()
        proc.wait(30)
    pids = [p.pid for p in cluster.record.processes]
    pids += [w.pid for w in cluster.connect().workers() if w.alive]
    cluster.tc("down", check=True)
    for pid in pids + [p.pid for p in started]:
        wait_until(lambda pid=pid: _gone(pid), 60)


def _round(cluster, tmp_path, number, seed, kind, started) -> None:
    rnd = random.Random(seed)
    prefix = f"chaos-r{number}"
    worker_name = f"chaos-w{number}"
    victim = "worker" if kind in WORKER_VICTIM_KINDS and rnd.random() < 0.4 else "actor"
    delay_s = rnd.uniform(0.0, 0.6)
    print(f"chaos round {number}: kind={kind} victim={victim} delay={delay_s:.2f}s seed={seed}")
    where = f"(round {number}, kind {kind}, victim {victim}, round seed {seed})"
    with cluster.connect() as rt:
        before = {n: _accounting(s) for n, s in _worker_status(rt).items()}
    worker = _start_worker(cluster, worker_name)
    started.append(worker)
    journals = [tmp_path / f"r{number}-a{i}.jsonl" for i in range(ACTORS.get(kind, 2))]
    actors = []
    for i, journal in enumerate(journals):
        actors.append(
            subprocess.Popen(
                [
                    sys.executable,
                    str(ACTOR),
                    kind,
                    str(cluster.state_dir),
                    str(journal),
                    f"{prefix}/a{i}",
                    str(rnd.randrange(2**31)),
                    worker_name,
                ],
                stderr=open(journal.with_suffix(".err"), "w"),  # noqa: SIM115
            )
        )
    started.extend(actors)

    def alive_or_fail(procs):
        for p, j in zip(procs, journals):
            assert p.poll() is None, f"actor died {where}: {j.with_suffix('.err').read_text()}"

    # The kill lands mid-work: every actor has acknowledged something, then a random delay.
    wait_until(lambda: alive_or_fail(actors) or all(_ops(j) > 0 for j in journals), 120)
    time.sleep(delay_s)  # the random kill point (seeded), not a wait for anything
    if victim == "worker":
        worker.kill()
        survivors = actors
    else:
        actors[0].kill()
        survivors = actors[1:]
    # The survivors go on past the fault: each acknowledges more work (or notes the error).
    marks = {j: len(_journal(j)) for j in journals}
    wait_until(
        lambda: (
            alive_or_fail(survivors)
            or all(len(_journal(j)) > marks[j] for p, j in zip(actors, journals) if p in survivors)
        ),
        120,
    )
    for p in actors:
        p.kill()
    for p in actors:
        p.wait(30)
    records = [r for j in journals for r in _journal(j)]
    with cluster.connect() as rt:
        _check_reads(rt, records, where)
        _check_reruns(rt, records, where)
        _check_accounting(rt, prefix, before, worker_name, where)
    if worker.poll() is None:
        worker.terminate()
        worker.wait(30)


def _check_reads(rt: tc.Runtime, records: list[dict], where: str) -> None:
    wrong = [r for r in records if "wrong" in r]
    assert not wrong, f"a reader got wrong bytes {where}: {wrong[:3]}"
    deleted = {r["name"] for r in records if r.get("op") == "delete"}  # begun, maybe done
    for r in records:
        if r.get("op") != "put" or r["name"] in deleted:
            continue
        expected = torch.full((r["numel"],), r["value"])
        try:
            art = rt.artifact(r["name"])
        except tc.NotFound:
            raise AssertionError(f"acknowledged artifact {r['name']} is gone {where}") from None
        if not art.info.replicas:
            continue  # its only copy died with the killed worker: unreadable, never wrong
        assert torch.equal(art.tensor_dict()["w"], expected), f"{r['name']} {where}"
    for r, page in _read_pages(rt, [r for r in records if r.get("op") == "page"]):
        assert page is None or torch.equal(page.tensor(), torch.full((r["numel"],), r["value"])), (
            f"page {r['key']} {where}"
        )
    published = [r for r in records if r.get("op") == "publish"]
    if published:
        last = published[-1]
        target = {n: torch.zeros(last["numel"]) for n in last["values"]}
        try:
            tc.WeightSubscriber(rt, last["model"], target).sync(last["version"])
        except tc.NotFound:
            pass  # collected by keep_last after a newer version whose ack the kill cut off
        else:
            for n, v in last["values"].items():
                assert torch.equal(target[n], torch.full((last["numel"],), v)), where


def _read_pages(rt: tc.Runtime, records: list[dict]) -> list[tuple[dict, object]]:
    """Each acknowledged page as read now. A batch that names a shard whose home was killed
    fails as Unavailable until the lease moves: then read page by page, skipping those."""
    pages = rt.pages()
    try:
        return list(zip(records, pages.get_pages([r["key"] for r in records])))
    except tc.Unavailable:
        read = []
        for r in records:
            try:
                read.append((r, pages.get_pages([r["key"]])[0]))
            except tc.Unavailable:
                pass  # its home is dead: unreadable for now, never wrong
        return read


def _check_reruns(rt: tc.Runtime, records: list[dict], where: str) -> None:
    acked = {r["key"]: r for r in records if r.get("op") in ("plan", "migrate")}
    begun = [r for r in records if r.get("op") in ("plan-begin", "migrate-begin")]
    for r in begun:
        if r["op"] == "plan-begin":

            def rerun(r=r) -> dict:
                plan = tc.Plan(tc.CallContext(deadline_ms=60_000, idempotency_key=r["key"]))
                plan.on_worker(r["worker"]).prefetch(r["name"])
                plan.on_worker(r["worker"]).pin(r["name"], after=[])
                return plan.run(rt)

        else:

            def rerun(r=r) -> dict:
                return migrate(  # as the actor asked (a key names one plan)
                    rt, r["req"], "chaos-a", "chaos-b", idempotency_key=r["key"], ttl_s=60
                )

        try:
            first = rerun()
        except (tc.Unavailable, tc.NotFound) as e:
            # Only a plan whose target worker (or source artifact's copy) was killed may fail.
            assert r["op"] == "plan-begin", f"{r['key']} {where}: {e}"
            continue
        if r["key"] in acked:
            recorded = _unmarked(acked[r["key"]]["result"])
            assert _unmarked(first) == recorded, f"{r['key']} rerun differs {where}"
        again = rerun()
        assert again.get("replayed") and _unmarked(again) == _unmarked(first), f"{r['key']} {where}"


def _unmarked(result: dict) -> dict:
    """A plan's result without the flag a replay adds."""
    return {k: v for k, v in result.items() if k != "replayed"}


def _check_accounting(rt, prefix, before, worker_name, where) -> None:
    for art in rt.list_artifacts(""):
        if art.art_id.startswith((f"{prefix}/", f"weights/{prefix}-")):
            rt.delete(art.art_id)

    def settled() -> bool:
        status = _worker_status(rt)
        return all(_accounting(status[n]) == before[n] for n in before if n in status)

    try:
        wait_until(settled, 60, 0.2)
    except AssertionError:
        now = {n: _accounting(s) for n, s in _worker_status(rt).items()}
        raise AssertionError(f"pool accounting {where}: before {before}, now {now}") from None
