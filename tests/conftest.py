"""Fixtures that start real clusters: a Global Store and worker processes on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# Fast liveness for tests; inherited by every process the fixtures start.
os.environ["TC_HEARTBEAT_INTERVAL_S"] = "0.2"
os.environ["TC_HEARTBEAT_TTL_S"] = "3.0"
os.environ.pop("TC_ADDR", None)
os.environ.pop("TC_TOKEN", None)

import tensorcast as tc
from tensorcast.sdk import local_cluster
from tensorcast.sdk.cluster_file import ClusterRecord, read_token


def pytest_addoption(parser):
    parser.addoption("--chaos-rounds", type=int, default=None, help="chaos rounds to run")
    parser.addoption("--chaos-seed", type=int, default=None, help="replay a chaos run")
    parser.addoption("--chaos-kinds", default=None, help="chaos kinds, comma-separated")


@dataclass
class Cluster:
    state_dir: Path
    record: ClusterRecord

    @property
    def token(self) -> str:
        token = read_token(self.state_dir)
        assert token
        return token

    def connect(self) -> tc.Runtime:
        return tc.connect(state_dir=self.state_dir)

    def pid(self, name: str) -> int:
        return next(p.pid for p in self.record.processes if p.name == name)

    @contextlib.contextmanager
    def extra_worker(self, name: str, *args: str) -> Iterator[subprocess.Popen]:
        """One more `tc worker start` process (64 MiB, extra `args`), ready when yielded,
        terminated on exit."""
        ready = self.state_dir / "run" / f"{name}.extra.json"
        ready.unlink(missing_ok=True)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tensorcast.cli.main",
                "worker",
                "start",
                "--store",
                self.record.store_addr,
                "--mem",
                "64MiB",
                "--name",
                name,
                "--ready-file",
                str(ready),
                *args,
            ],
            env={**os.environ, "TC_TOKEN": self.token},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_until(ready.exists, 30)
            yield proc
        finally:
            proc.terminate()
            proc.wait(10)

    def start_store_again(self) -> subprocess.Popen:
        """A new store process on the same database and address (after the old one died)."""
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tensorcast.cli.main",
                "store",
                "start",
                "--db",
                str(self.state_dir / "store.db"),
                "--listen",
                self.record.store_addr,
                "--state-dir",
                str(self.state_dir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def tc(
        self, *args: str, check: bool = False, env: dict | None = None
    ) -> subprocess.CompletedProcess:
        """Run the real `tc` CLI against this cluster."""
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "tensorcast.cli.main",
                *args,
                "--state-dir",
                str(self.state_dir),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **(env or {})},
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"tc {' '.join(args)} failed ({proc.returncode}): {proc.stderr}")
        return proc


def start_cluster(state_dir: Path, workers: int = 1, mem: str = "256MiB") -> Iterator[Cluster]:
    result = local_cluster.up(state_dir, workers, mem)
    try:
        cluster = Cluster(state_dir, result.record)
        with cluster.connect() as rt:
            wait_until(lambda: shards_settled(rt, workers), 30, 0.1)
        yield cluster
    finally:
        local_cluster.down(state_dir)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    """One store and two workers, shared by a test module."""
    yield from start_cluster(tmp_path_factory.mktemp("cluster"), workers=2, mem="256MiB")


@pytest.fixture
def fresh_cluster(tmp_path) -> Iterator[Cluster]:
    """A private single-worker cluster for tests that kill or fill things."""
    yield from start_cluster(tmp_path / "state", workers=1, mem="64MiB")


@pytest.fixture
def rt(cluster) -> Iterator[tc.Runtime]:
    runtime = cluster.connect()
    yield runtime
    runtime.close()


def shards_settled(rt: tc.Runtime, homes: int) -> bool:
    """Every KV shard held by the home hashing ranks first: lease hand-offs between the
    cluster's workers (the first to start takes every shard) are over."""
    from tensorcast.sharding import settled

    table = rt.shards()
    return len(table.live_homes) == homes and settled(table)


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        time.sleep(interval_s)


def wait_dead(rt: tc.Runtime, name: str) -> None:
    """Until the Global Store reports worker `name` dead (no heartbeat for a TTL): after a
    kill, so that what follows does not depend on how soon the store noticed."""
    ttl_s = float(os.environ["TC_HEARTBEAT_TTL_S"])
    wait_until(lambda: not any(w.alive for w in rt.workers() if w.name == name), ttl_s + 30)


def worker_contents(rt: tc.Runtime) -> int:
    """Contents held by the live workers' pools (held-but-dropped ones not counted)."""
    from tensorcast.proto import tensorcast_pb2 as pb

    return sum(
        rt.worker_stub(w).call("Status", pb.Empty()).num_contents for w in rt.workers() if w.alive
    )


def pool_used(rt: tc.Runtime) -> dict[str, int]:
    """Bytes used per worker, straight from each worker (not the heartbeat-delayed store view)."""
    from tensorcast.proto import tensorcast_pb2 as pb

    return {
        w.name: rt.worker_stub(w).call("Status", pb.Empty()).worker.mem_used_bytes
        for w in rt.workers()
        if w.alive
    }
