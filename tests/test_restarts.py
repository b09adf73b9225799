"""Restarts lose nothing: a store killed and brought back by `tc up`, workers that outlive it, a
planned `tc down` / `tc up` with a disk tier, lost artifacts, worker names, store failover.
Real processes throughout (`tc up` as a user runs it)."""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import Cluster, shards_settled, wait_until
from test_router_sim import start_sim_instance

import tensorcast as tc


def _tc(c: Cluster, *args: str, check: bool = True) -> dict | subprocess.CompletedProcess:
    proc = c.tc(*args, "--json", check=check)
    return json.loads(proc.stdout) if check else proc


def _pids(up: dict) -> dict[str, int]:
    return {p["name"]: p["pid"] for p in up["processes"]}


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _restart_store_past_the_ttl(c: Cluster, up: dict) -> None:
    """Kill the store and bring it back only once the heartbeat TTL has passed since: every
    heartbeat and lease it holds is stale (what such tests are about is time itself)."""
    from tensorcast.config import DEFAULT_HEARTBEAT_TTL_S

    os.kill(_pids(up)["store"], signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: not _alive(_pids(up)["store"]), 30)
    wait_until(lambda: time.monotonic() > killed_at + DEFAULT_HEARTBEAT_TTL_S + 1.5, 30, 0.2)
    _tc(c, "up")


def _holders(rt: tc.Runtime, art_id: str) -> set[str]:
    names = {w.worker_id: w.name for w in rt.workers()}
    return {names[r.worker_id] for r in rt.info(art_id).replicas}


def _data(i: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1024,), float(i)), "i": torch.arange(i + 1)}


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.fixture
def cluster_dir(tmp_path):
    c = Cluster(tmp_path / "state", None)  # type: ignore[arg-type]
    yield c
    c.tc("down")


def test_store_killed_then_tc_up_brings_it_back_where_the_survivors_look(cluster_dir):
    """The operator's story from issue 21: two workers, artifacts replicated on both; kill -9
    worker-1, then the store; `tc up` restarts both at their old address and name and keeps the
    surviving worker-2 (no second worker-2), which reports its inventory: every artifact is
    listed on it again and reads back."""
    c = cluster_dir
    first = _tc(c, "up", "--workers", "2", "--mem", "64MiB")
    with c.connect() as rt:
        for i in range(4):
            rt.put(_data(i), f"kept-{i}", worker="worker-1").prefetch("worker-2")
            assert _holders(rt, f"kept-{i}") == {"worker-1", "worker-2"}
    os.kill(_pids(first)["worker-1"], signal.SIGKILL)
    os.kill(_pids(first)["store"], signal.SIGKILL)
    wait_until(lambda: not _alive(_pids(first)["store"]), 30)

    second = _tc(c, "up")
    assert second["store_addr"] == first["store_addr"]
    assert sorted(second["started"]) == ["store", "worker-1"] and second["adopted"] == ["worker-2"]
    assert _pids(second)["worker-2"] == _pids(first)["worker-2"]
    started = time.monotonic()
    with c.connect() as rt:
        wait_until(lambda: all("worker-2" in _holders(rt, f"kept-{i}") for i in range(4)), 30, 0.05)
        print(f"replicas listed again {time.monotonic() - started:.2f}s after the store was up")
        for i in range(4):
            assert _same(rt.artifact(f"kept-{i}").tensor_dict(), _data(i))
        names = sorted(w.name for w in rt.workers() if w.alive)
        assert names == ["worker-1", "worker-2"]  # one of each name
    status = _tc(c, "status")
    assert status["healthy"]
    assert sorted(x["name"] for x in status["components"]) == ["store", "worker-1", "worker-2"]


def test_an_instance_follows_its_worker_restarted_by_tc_up(cluster_dir):
    """A worker killed and restarted by `tc up` listens at a new address (and id); the engine
    attached to it finds it again by name instead of retrying the dead address for ever."""
    c = cluster_dir
    first = _tc(c, "up", "--workers", "1", "--mem", "64MiB")
    proc, _ = start_sim_instance(c, "sim-r", "worker-1")
    try:
        with c.connect() as rt:
            old = rt.resolve_worker("worker-1")
            wait_until(lambda: [i.alive for i in rt.instances()] == [True], 30)
        os.kill(_pids(first)["worker-1"], signal.SIGKILL)
        wait_until(lambda: not _alive(_pids(first)["worker-1"]), 30)
        new_pid = _pids(_tc(c, "up"))["worker-1"]
        with c.connect() as rt:

            def attached_to_the_new_worker() -> bool:
                live = {w.worker_id for w in rt.workers() if w.alive and w.pid == new_pid}
                return [(i.instance_id, i.alive, i.worker_id in live) for i in rt.instances()] == [
                    ("sim-r", True, True)
                ]

            wait_until(attached_to_the_new_worker, 30)
            assert rt.resolve_worker("worker-1").addr != old.addr
    finally:
        proc.terminate()
        proc.wait(10)


def _pool_mappings() -> set[str]:
    """The inodes of the shared-memory files (workers' pools, page directories) this process
    maps."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return {line.split()[4] for line in lines if "/memfd:" in line}


def test_a_caller_unmaps_the_pool_of_a_worker_that_restarted(cluster_dir):
    """A worker killed and restarted by `tc up` comes back with a new id and a new pool. A
    caller that used the old one (a tensor mapped from it, KV pages written in place) lets go
    of its mappings once it talks to the new worker: kept, they would keep the dead worker's
    whole pool allocated for as long as the caller (an engine, a router) runs."""
    c = cluster_dir
    first = _tc(c, "up", "--workers", "1", "--mem", "64MiB")
    with c.connect() as rt:
        rt.put(_data(1), "before")
        got = rt.artifact("before").tensor_dict()
        assert _same(got, _data(1))
        rt.pages().put_pages({"kv/restart/0": b"x" * 4096})
        old = _pool_mappings()
        assert old  # the pool and the page directory
        del got
        gc.collect()
        os.kill(_pids(first)["worker-1"], signal.SIGKILL)
        wait_until(lambda: not _alive(_pids(first)["worker-1"]), 30)
        new_pid = _pids(_tc(c, "up"))["worker-1"]
        wait_until(lambda: rt.resolve_worker("worker-1").pid == new_pid, 30)
        rt.put(_data(2), "after", worker="worker-1")
        after = rt.artifact("after").tensor_dict()
        assert _same(after, _data(2))
        wait_until(lambda: not old & _pool_mappings(), 10, 0.05)
        assert _pool_mappings()  # the new worker's pool, which `after` maps


def test_planned_restart_with_a_disk_tier_keeps_every_artifact(cluster_dir, tmp_path):
    c = cluster_dir
    disk = tmp_path / "disk"
    _tc(c, "up", "--workers", "2", "--mem", "64MiB", "--disk", str(disk))
    with c.connect() as rt:
        for i in range(3):
            rt.put(_data(i), f"durable-{i}", worker=f"worker-{1 + i % 2}")
    _tc(c, "down")
    assert sorted(p.name for p in disk.iterdir()) == ["worker-1", "worker-2"]
    again = _tc(c, "up")  # no options: the same layout, disk tier included
    assert sorted(again["started"]) == ["store", "worker-1", "worker-2"]
    with c.connect() as rt:
        for i in range(3):
            assert {r.tier for r in rt.info(f"durable-{i}").replicas} == {"disk"}
            assert _same(rt.artifact(f"durable-{i}").tensor_dict(), _data(i))
    out = tmp_path / "out.safetensors"
    c.tc("get", "durable-1", "-o", str(out), check=True)
    from safetensors.torch import load_file

    assert _same(load_file(out), _data(1))


def test_without_a_disk_tier_gone_artifacts_show_as_lost_and_rm_lost_removes_them(cluster_dir):
    c = cluster_dir
    _tc(c, "up", "--mem", "64MiB")
    with c.connect() as rt:
        rt.put(_data(1), "gone-1")
        rt.put(_data(2), "gone-2")
    _tc(c, "down")
    _tc(c, "up")
    listed = {a["art_id"]: a for a in _tc(c, "ls")["artifacts"]}
    assert {k: v["lost"] for k, v in listed.items()} == {"gone-1": True, "gone-2": True}
    assert "0 (lost)" in c.tc("ls", check=True).stdout
    dry = _tc(c, "rm", "--lost", "--dry-run")
    assert dry == {"deleted": [], "lost": ["gone-1", "gone-2"], "dry_run": True}
    assert len(_tc(c, "ls")["artifacts"]) == 2
    assert _tc(c, "rm", "--lost")["deleted"] == ["gone-1", "gone-2"]
    assert _tc(c, "ls")["artifacts"] == []
    bad = c.tc("rm")
    assert bad.returncode == 2 and "--lost" in bad.stderr  # a usage error


def test_a_second_worker_under_a_live_workers_name_is_refused(cluster):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tensorcast.cli.main",
            "worker",
            "start",
            "--store",
            cluster.record.store_addr,
            "--mem",
            "16MiB",
            "--name",
            "worker-1",
        ],
        env={**os.environ, "TC_TOKEN": cluster.token},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == tc.AlreadyExists.exit_code, proc.stderr
    assert "worker-1" in proc.stderr and "heartbeated" in proc.stderr
    with cluster.connect() as rt:
        assert sorted(w.name for w in rt.workers() if w.alive) == ["worker-1", "worker-2"]


def _dead_addr() -> str:
    with socket.socket() as s:  # a port nobody listens on once this closes
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_workers_and_callers_fail_over_across_store_addresses(cluster):
    addrs = f"{_dead_addr()},{cluster.record.store_addr}"
    with tc.connect(addrs, cluster.token) as rt:
        rt.put(_data(5), "via-second-member")
        assert rt.store.current_addr == cluster.record.store_addr
        assert _same(rt.artifact("via-second-member").tensor_dict(), _data(5))
    with cluster.extra_worker("member-test", "--store", addrs), cluster.connect() as rt:
        # Ready: it registered through the second address; alive: its heartbeats go there too.
        wait_until(lambda: any(w.name == "member-test" and w.alive for w in rt.workers()), 30)
    with pytest.raises(tc.Unavailable, match="cannot reach"):
        tc.connect(f"{_dead_addr()},{_dead_addr()}", cluster.token, timeout_s=3)
    with pytest.raises(tc.InvalidArgument):
        tc.connect("127.0.0.1:notaport", cluster.token)


def test_a_worker_stops_on_a_sigterm_that_lands_on_any_of_its_threads(fresh_cluster):
    """The kernel may hand a process's SIGTERM to any thread; Python runs the handler on the
    main thread only once that thread runs again, so a main thread parked in a plain
    `Event.wait()` never saw it (`tc down` then killed the worker after a minute, its disk
    tier unsaved). Sent to one of its other threads, the worker still stops."""
    import ctypes

    with fresh_cluster.extra_worker("sig") as proc:
        others = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task") if int(t) != proc.pid]
        assert others
        libc = ctypes.CDLL(None, use_errno=True)
        SYS_TGKILL = 234  # x86-64
        assert libc.syscall(SYS_TGKILL, proc.pid, others[-1], signal.SIGTERM) == 0
        assert proc.wait(30) == 0


def test_a_store_back_after_an_outage_keeps_its_workers_copies_while_they_report(cluster_dir):
    """The store down for longer than the heartbeat TTL: the heartbeats it holds are all stale.
    It must not drop the workers' replica rows before they have had a TTL to beat again, and
    `delete_lost` waits for that (every copy looks lost until then: it deleted them all)."""
    import sqlite3

    from tensorcast.config import DEFAULT_HEARTBEAT_TTL_S

    c = cluster_dir
    first = _tc(c, "up", "--workers", "1", "--mem", "64MiB")
    with c.connect() as rt:
        for i in range(3):
            rt.put(_data(i), f"outage/{i}")
    worker = _pids(first)["worker-1"]
    os.kill(worker, signal.SIGSTOP)  # it cannot report to the new store until we say so
    try:
        _restart_store_past_the_ttl(c, first)
        with c.connect() as rt:
            settling_s = rt.store_status().settling_s
            assert 0 <= settling_s <= DEFAULT_HEARTBEAT_TTL_S
            if settling_s < 2.5:  # the worker needs a moment of it after SIGCONT, below
                pytest.skip("this machine took most of the settling window to get here")
            db = sqlite3.connect(f"file:{c.state_dir / 'store.db'}?mode=ro", uri=True)
            try:
                # Past the store's first sweeps (every 0.5 s), still inside the window.
                wait_until(lambda: rt.store_status().settling_s < settling_s - 0.6, 30, 0.1)
                assert db.execute("SELECT COUNT(*) FROM replicas").fetchone()[0] >= 3
            finally:
                db.close()
    finally:
        os.kill(worker, signal.SIGCONT)
    with c.connect() as rt:
        # At once: it waits for the rest of the window, in which the worker reports.
        assert rt.delete_lost(dry_run=True) == []
        assert rt.store_status().settling_s == 0
        assert all(rt.info(f"outage/{i}").replicas for i in range(3))
        assert all(_same(rt.artifact(f"outage/{i}").tensor_dict(), _data(i)) for i in range(3))


def test_kv_pages_survive_a_store_outage_longer_than_their_shard_leases(cluster_dir):
    """The store down for longer than the shard leases' TTL: every lease lapses still naming
    its home, and each home takes its own shards back under the next token once the store is
    up again (the first home to beat must not take the other's: architecture.md decision
    121); every page is still there."""

    c = cluster_dir
    first = _tc(c, "up", "--workers", "2", "--mem", "64MiB")
    blob = bytes(range(256)) * 64
    keys = [f"kv/outage/{i}" for i in range(40)]
    with c.connect() as rt:
        wait_until(lambda: shards_settled(rt, 2), 60)
        rt.pages().put_pages(dict.fromkeys(keys, blob), ttl_s=600)
        before = {lease.shard: lease for lease in rt.shards().leases}
        assert len({lease.holder_worker_id for lease in before.values()}) == 2
    _restart_store_past_the_ttl(c, first)
    with c.connect() as rt:

        def taken_back() -> bool:
            return all(
                lease.held
                and lease.holder_worker_id == before[lease.shard].holder_worker_id
                and lease.token == before[lease.shard].token + 1
                for lease in rt.shards().leases
            )

        wait_until(taken_back, 60)
        pages = rt.pages()
        wait_until(lambda: all(p is not None for p in pages.get_pages(keys)), 30)
        assert all(bytes(p.data) == blob for p in pages.get_pages(keys))
