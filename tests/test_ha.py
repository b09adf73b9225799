"""High availability with real processes: `tc up --ha` (3 etcd members, 2 Global Store processes,
workers failing over between them). Kill -9 the etcd leader, a follower, the store the client is
using and a worker while a loop of puts, lease renewals and shard-table reads runs: no
acknowledged write is lost, no shard token ever has two holders, the loop goes on after each
kill, and everything acknowledged before a kill reads back after it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import Cluster, wait_until

import tensorcast as tc
from tensorcast.sdk.cluster_file import read_token

# The goal is failover within 3 s; a test on a loaded CI machine checks a loose bound and
# prints the measured gap (scripts/bench/store.py measures failover repeatedly).
GAP_BOUND_S = 30.0


def _pids(c: Cluster) -> dict[str, int]:
    return {
        p["name"]: p["pid"]
        for p in json.loads((c.state_dir / "cluster.json").read_text())["processes"]
    }


def _etcd_leader(c: Cluster) -> str:
    """The name of the member that leads (each member's status names the leader's id)."""
    from etcd3gw.client import Etcd3Client

    record = json.loads((c.state_dir / "cluster.json").read_text())
    for p in record["processes"]:
        if p["role"] != "etcd":
            continue
        host, port = p["addr"].rsplit(":", 1)
        try:
            status = Etcd3Client(host=host, port=int(port), timeout=2, api_path="/v3/").status()
        except Exception:
            continue
        if status["header"]["member_id"] == status["leader"]:
            return p["name"]
    raise AssertionError("no etcd member leads")


class Loop:
    """Puts (acknowledged ones journaled), lease renewals and shard-table observations, in a
    thread, until stopped. Errors while a member is down are counted, not raised."""

    def __init__(self, c: Cluster) -> None:
        self.rt = c.connect()
        self.acked: list[tuple[str, float, float]] = []  # (art_id, value, acked at)
        self.lease = self.rt.register({"kv": torch.ones(4)}, "ha-lease", ttl_s=60)
        self.lease_acked_until = 0.0
        self.holders: dict[tuple[int, int], set[str]] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Loop:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)
        self.rt.close()

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            try:
                self.rt.put({"w": torch.full((64,), float(i))}, f"ha-{i}", worker="worker-2")
                self.acked.append((f"ha-{i}", float(i), time.monotonic()))
                i += 1
                info = self.lease.renew(60).info
                self.lease_acked_until = info.expires_at or 0.0
                for lease in self.rt.shards().leases:
                    if lease.held:
                        self.holders.setdefault((lease.shard, lease.token), set()).add(
                            lease.holder_worker_id
                        )
            except tc.TensorcastError as e:
                self.errors.append(f"{type(e).__name__}: {str(e)[:200]}")
                time.sleep(0.05)  # a member is down: retry soon (bounded by the test's stop)

    def acks(self) -> int:
        return len(self.acked)

    def wait_for_progress(self, after: int) -> float:
        """Seconds from now until `after` acks have become `after + 3`."""
        start = time.monotonic()
        wait_until(lambda: self.acks() >= after + 3, GAP_BOUND_S)
        return time.monotonic() - start


@pytest.fixture
def ha(tmp_path):
    c = Cluster(tmp_path / "state", None)  # type: ignore[arg-type]
    up = json.loads(
        c.tc("up", "--ha", "--workers", "2", "--mem", "64MiB", "--json", check=True).stdout
    )
    yield c, up
    c.tc("down")


def test_tc_up_ha_starts_etcd_and_two_stores_and_status_shows_every_member(ha):
    c, up = ha
    roles = [(p["role"], p["name"]) for p in up["processes"]]
    assert roles[:5] == [
        ("etcd", "etcd-1"),
        ("etcd", "etcd-2"),
        ("etcd", "etcd-3"),
        ("store", "store-1"),
        ("store", "store-2"),
    ]
    assert all(p["pid"] > 0 for p in up["processes"])
    assert len(up["store_addr"].split(",")) == 2
    status = json.loads(c.tc("status", "--json", check=True).stdout)
    states = {x["name"]: (x["role"], x["state"]) for x in status["components"]}
    assert states == {
        "store-1": ("store", "healthy"),
        "store-2": ("store", "healthy"),
        "etcd-1": ("etcd", "healthy"),
        "etcd-2": ("etcd", "healthy"),
        "etcd-3": ("etcd", "healthy"),
        "worker-1": ("worker", "healthy"),
        "worker-2": ("worker", "healthy"),
    }


def test_kills_of_etcd_leader_follower_a_store_and_a_worker_lose_nothing(ha):
    c, _ = ha
    gaps = {}
    with Loop(c) as loop:
        wait_until(lambda: loop.acks() >= 5, 60)
        for victim in ("etcd-leader", "etcd-follower", "store", "worker-1"):
            pids = _pids(c)
            if victim == "etcd-leader":
                name = _etcd_leader(c)
            elif victim == "etcd-follower":
                name = next(n for n in pids if n.startswith("etcd-") and n != _etcd_leader(c))
            elif victim == "store":
                addr = loop.rt.store.current_addr  # the store this client is using
                record = json.loads((c.state_dir / "cluster.json").read_text())
                name = next(p["name"] for p in record["processes"] if p["addr"] == addr)
            else:
                name = "worker-1"
            before = loop.acks()
            os.kill(pids[name], signal.SIGKILL)
            gaps[f"{victim} ({name})"] = loop.wait_for_progress(before)
            up = json.loads(c.tc("up", "--json", check=True).stdout)  # bring it back
            assert up["started"] == [name], up
        print("progress resumed after each kill within (s):", gaps)
    assert all(g < GAP_BOUND_S for g in gaps.values())
    # No shard token ever had two holders, whichever store answered.
    assert all(len(holders) == 1 for holders in loop.holders.values()), loop.holders
    with c.connect() as rt:
        # Every acknowledged put is still recorded and reads back exactly (all on worker-2,
        # which was never killed).
        for art_id, value, _ in loop.acked:
            assert torch.equal(rt.artifact(art_id).tensor_dict()["w"], torch.full((64,), value))
        assert rt.info("ha-lease").expires_at >= loop.lease_acked_until - 1e-6
        names = sorted(w.name for w in rt.workers() if w.alive)
        assert names == ["worker-1", "worker-2"]
    status = json.loads(c.tc("status", "--json", check=True).stdout)
    assert status["healthy"], status


def test_store_restart_on_etcd_with_workers_alive_lists_every_replica_again(ha):
    c, _ = ha
    with c.connect() as rt:
        for i in range(3):
            rt.put({"w": torch.full((8,), float(i))}, f"kept-{i}", worker="worker-1")
    pids = _pids(c)
    for name in ("store-1", "store-2"):
        os.kill(pids[name], signal.SIGKILL)
    up = json.loads(c.tc("up", "--json", check=True).stdout)
    assert sorted(up["started"]) == ["store-1", "store-2"]
    with c.connect() as rt:
        wait_until(lambda: all(rt.info(f"kept-{i}").replicas for i in range(3)), 30)
        for i in range(3):
            assert torch.equal(
                rt.artifact(f"kept-{i}").tensor_dict()["w"], torch.full((8,), float(i))
            )


def test_a_hung_store_member_is_failed_over_before_workers_count_as_dead(ha):
    """The store the workers beat through hangs (SIGSTOP, not dead: connections are accepted
    and never answered). Their heartbeats give up on it within half the TTL and go to the
    other store, so they stay alive there (they beat through a 30 s timeout, and counted as
    dead for ~25 s, their copies as lost)."""
    from tensorcast.config import DEFAULT_HEARTBEAT_TTL_S

    c, up = ha
    with c.connect() as rt:
        rt.put({"w": torch.arange(8.0)}, "hung/a", worker="worker-1")
    pids = _pids(c)
    second = up["store_addr"].split(",")[1]
    os.kill(pids["store-1"], signal.SIGSTOP)  # the first member: every worker's current one
    frozen_at = time.monotonic()
    try:
        with tc.connect(second, read_token(c.state_dir)) as rt:
            # What this test is about is time itself: well past the TTL since the last beat
            # through store-1, the workers are alive and the copy found, through store-2.
            wait_until(lambda: time.monotonic() > frozen_at + 2 * DEFAULT_HEARTBEAT_TTL_S, 30)

            def both_alive() -> bool:
                return sorted(w.name for w in rt.workers() if w.alive) == ["worker-1", "worker-2"]

            wait_until(both_alive, DEFAULT_HEARTBEAT_TTL_S)
            assert rt.info("hung/a").replicas
            assert torch.equal(rt.artifact("hung/a").tensor_dict()["w"], torch.arange(8.0))
    finally:
        os.kill(pids["store-1"], signal.SIGCONT)


def test_tc_up_ha_after_one_that_failed_half_way_starts(tmp_path, monkeypatch):
    """The first `tc up --ha` dies after its etcd members wrote their data dirs (here: the
    stores fail to start): the next one starts those same members, not new ones that the
    old data dirs would never let form a quorum."""
    from tensorcast.sdk import local_cluster

    state = tmp_path / "state"
    start_store = local_cluster._start_store

    def fails(*args, **kwargs):
        raise tc.Unavailable("the store did not start (test)")

    monkeypatch.setattr(local_cluster, "_start_store", fails)
    with pytest.raises(tc.Unavailable, match="did not start"):
        local_cluster.up(state, 1, "32MiB", ha=True)
    assert any((state / "etcd").iterdir())  # the members' data dirs stay
    monkeypatch.setattr(local_cluster, "_start_store", start_store)
    monkeypatch.setattr("tensorcast.sdk.local_etcd.START_TIMEOUT_S", 30.0)
    try:
        result = local_cluster.up(state, 1, "32MiB", ha=True)
        with tc.connect(result.record.store_addr, read_token(state)) as rt:
            rt.put({"w": torch.ones(2)}, "after-a-failed-up")
            assert rt.info("after-a-failed-up").art_id == "after-a-failed-up"
    finally:
        local_cluster.down(state)


def test_ha_needs_a_fresh_state_dir(tmp_path):
    c = Cluster(tmp_path / "state", None)  # type: ignore[arg-type]
    c.tc("up", "--mem", "16MiB", check=True)
    try:
        proc = c.tc("up", "--ha")
        assert proc.returncode == tc.InvalidArgument.exit_code and "--ha" in proc.stderr
    finally:
        c.tc("down")
    assert not Path(tmp_path / "state" / "etcd").exists()
