"""`tc up` / `tc down` / `tc status`: a Global Store and N workers on this machine as background
processes, recorded in the state dir (cluster.json, token, store.db, logs/, run/)."""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from tensorcast.errors import NotFound, TensorcastError, Unavailable
from tensorcast.sdk.cluster_file import ClusterRecord, ProcessRecord, read_token, write_token

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


@contextmanager
def _state_lock(state_dir: Path) -> Iterator[None]:
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _is_ours(pid: int) -> bool:
    """A live TensorCast process (started as `tc ...`, `tensorcast ...` or `-m tensorcast...`),
    so a recycled pid is never signalled."""
    try:
        cmdline = psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    return any(
        os.path.basename(arg) in ("tc", "tensorcast") or arg.startswith("tensorcast.")
        for arg in cmdline[:3]
    )


def _wait_exit(pid: int, timeout_s: float) -> bool:
    """Wait for a process that is not our child to exit (a pidfd is readable once it has)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        os.close(fd)


def stop_process(pid: int, timeout_s: float) -> bool:
    """SIGTERM a TensorCast process, SIGKILL it after `timeout_s`; True if it had to be killed."""
    if not _is_ours(pid):
        raise NotFound(f"no TensorCast process with pid {pid} on this host")
    os.kill(pid, signal.SIGTERM)
    if _wait_exit(pid, timeout_s):
        return False
    os.kill(pid, signal.SIGKILL)
    return True


def _spawn(args: list[str], log: Path, token: str, ready: Path) -> subprocess.Popen:
    ready.unlink(missing_ok=True)
    env = dict(os.environ, TC_TOKEN=token)  # not on the command line, where `ps` shows it
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "tensorcast.cli.main", *args, "--ready-file", str(ready)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            # `-m` puts the working directory first on sys.path: started from a source checkout
            # the child would import that tree instead of the installed package.
            cwd=ready.parent,
            start_new_session=True,  # survives the shell that ran `tc up`
        )


def _wait_ready(proc: subprocess.Popen, ready: Path, log: Path) -> dict:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if ready.exists():
            return json.loads(ready.read_text())
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").splitlines()[-15:]
            raise TensorcastError(
                f"{log.stem} exited with code {proc.returncode}:\n" + "\n".join(tail)
            )
        time.sleep(0.05)
    proc.kill()
    raise Unavailable(f"{log.stem} did not become ready within {START_TIMEOUT_S:.0f}s; see {log}")


def _running(state_dir: Path) -> ClusterRecord | None:
    record = ClusterRecord.load(state_dir)
    if record is None:
        return None
    store = next((p for p in record.processes if p.role == "store"), None)
    if store is None or not _is_ours(store.pid):
        return None
    return record


@dataclass
class UpResult:
    record: ClusterRecord
    already_running: bool
    state_dir: Path


def up(state_dir: Path, workers: int, mem: str, listen_host: str = "127.0.0.1") -> UpResult:
    """Start a store and `workers` workers unless this state dir already runs a cluster."""
    state_dir = state_dir.resolve()  # the processes run in state_dir/run
    with _state_lock(state_dir):
        existing = _running(state_dir)
        if existing is not None:
            return UpResult(existing, True, state_dir)
        token = read_token(state_dir) or secrets.token_urlsafe(32)
        write_token(state_dir, token)
        (state_dir / "logs").mkdir(exist_ok=True)
        (state_dir / "run").mkdir(exist_ok=True)
        started: list[subprocess.Popen] = []
        try:
            log = state_dir / "logs" / "store.log"
            proc = _spawn(
                [
                    "store",
                    "start",
                    "--db",
                    str(state_dir / "store.db"),
                    "--listen",
                    f"{listen_host}:0",
                ],
                log,
                token,
                state_dir / "run" / "store.json",
            )
            started.append(proc)
            info = _wait_ready(proc, state_dir / "run" / "store.json", log)
            store_addr = info["addr"]
            record = ClusterRecord(store_addr, time.time())
            record.processes.append(
                ProcessRecord(
                    "store", "store", proc.pid, store_addr, str(log), info["metrics_addr"]
                )
            )
            pending = []
            for i in range(workers):
                name = f"worker-{i + 1}"
                log = state_dir / "logs" / f"{name}.log"
                ready = state_dir / "run" / f"{name}.json"
                proc = _spawn(
                    [
                        "worker",
                        "start",
                        "--store",
                        store_addr,
                        "--listen",
                        f"{listen_host}:0",
                        "--mem",
                        mem,
                        "--name",
                        name,
                    ],
                    log,
                    token,
                    ready,
                )
                started.append(proc)
                pending.append((name, proc, ready, log))
            for name, proc, ready, log in pending:  # workers pre-fault their pools in parallel
                info = _wait_ready(proc, ready, log)
                record.processes.append(
                    ProcessRecord(
                        "worker", name, proc.pid, info["addr"], str(log), info["metrics_addr"]
                    )
                )
            record.save(state_dir)
            return UpResult(record, False, state_dir)
        except BaseException:
            for proc in started:
                proc.kill()
            raise


def _extra_local_workers(state_dir: Path, record: ClusterRecord) -> list[ProcessRecord]:
    """Workers of this cluster on this host that `tc up` did not start (`tc worker start`, an
    autoscaler): `tc down` stops them too, so no worker outlives its store."""
    from tensorcast.sdk.runtime import connect

    known = {p.pid for p in record.processes}
    try:
        with connect(record.store_addr, state_dir=state_dir, timeout_s=5.0) as rt:
            return [
                ProcessRecord("worker", w.name, w.pid, w.addr, "")
                for w in rt.workers()
                if w.alive and rt.is_local(w) and w.pid not in known
            ]
    except TensorcastError:
        return []  # the store is gone: nothing more to learn


def down(state_dir: Path) -> list[ProcessRecord]:
    """Stop the cluster's processes on this host (workers first, then the store); returns them."""
    with _state_lock(state_dir):
        record = ClusterRecord.load(state_dir)
        if record is None:
            return []
        ordered = _extra_local_workers(state_dir, record) + sorted(
            record.processes, key=lambda p: p.role == "store"
        )
        stopped = []
        for group in (
            [p for p in ordered if p.role == "worker"],
            [p for p in ordered if p.role == "store"],
        ):
            live = [p for p in group if _is_ours(p.pid)]
            for p in live:
                os.kill(p.pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            for p in live:
                if not _wait_exit(p.pid, max(0.1, deadline - time.monotonic())):
                    os.kill(p.pid, signal.SIGKILL)
            stopped.extend(live)
        (state_dir / "cluster.json").unlink(missing_ok=True)
        for f in (state_dir / "run").glob("*.json"):
            f.unlink()
        return stopped
