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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import psutil

from tensorcast.config import DEFAULT_WORKER_MEM, parse_size
from tensorcast.errors import InvalidArgument, NotFound, TensorcastError, Unavailable
from tensorcast.sdk.cluster_file import ClusterRecord, ProcessRecord, read_token, write_token

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0
# A worker with a disk tier writes its memory out before it exits: `tc down` gives the
# workers of such a cluster this much more per byte of their pools (which share one disk).
PERSIST_BYTES_PER_S = 100 * 1024 * 1024
# Workers pre-fault their pools before they report ready (in parallel, sharing the memory
# bandwidth): `tc up` waits for them this much longer per byte of the pools (a fresh 2 GiB
# pool took 3.7 s on the 2-core VM CI runs on; this rate is several times slower still).
PREFAULT_BYTES_PER_S = 128 * 1024 * 1024
LAYOUT_FILE = "layout.json"
HA_ETCD_MEMBERS = 3
HA_STORES = 2


@contextmanager
def _state_lock(state_dir: Path) -> Iterator[None]:
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _is_ours(pid: int, started_at: float = 0.0) -> bool:
    """A live TensorCast process (started as `tc ...`, `tensorcast ...` or `-m tensorcast...`),
    and the one started at `started_at` when known, so a recycled pid is never signalled (nor
    adopted), even by another cluster's process."""
    try:
        process = psutil.Process(pid)
        cmdline = process.cmdline()
        if started_at and abs(process.create_time() - started_at) > 1.0:
            return False
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    if cmdline and os.path.basename(cmdline[0]) == "etcd":  # a member of an --ha cluster
        return any(arg.startswith("tensorcast-") for arg in cmdline)
    return any(
        os.path.basename(arg) in ("tc", "tensorcast") or arg.startswith("tensorcast.")
        for arg in cmdline[:3]
    )


def _started_at(pid: int) -> float:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return 0.0  # gone already: `tc up` reports it failing to start


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


def _check_running_workers(
    live: dict[str, ProcessRecord], saved: Layout, wanted: Layout, mem: str | None
) -> None:
    """Options that running workers cannot follow are refused, not half applied: `--mem` is
    every worker's pool size (running ones kept theirs, and the next restart of all of them
    took the new one), and `--workers` below the running count dropped the others from the
    record while they ran on."""
    running = sorted(n for n in live if n.startswith("worker-"))
    if not running:
        return
    if mem and parse_size(mem) != parse_size(saved.mem):
        raise InvalidArgument(
            f"{len(running)} worker(s) of this cluster run with {saved.mem} pools, and --mem is "
            "every worker's: `tc down` first to change it (or `tc worker start` one of another "
            "size)"
        )
    beyond = [
        n
        for n in running
        if n.rpartition("-")[2].isdigit() and int(n.rpartition("-")[2]) > wanted.workers
    ]
    if beyond:
        raise InvalidArgument(
            f"{', '.join(beyond)} run(s) beyond --workers {wanted.workers}: stop them first "
            "(tc worker stop NAME), or ask for as many"
        )


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


def _wait_ready(
    proc: subprocess.Popen, ready: Path, log: Path, timeout_s: float = START_TIMEOUT_S
) -> dict:
    deadline = time.monotonic() + timeout_s
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
    raise Unavailable(f"{log.stem} did not become ready within {timeout_s:.0f}s; see {log}")


@dataclass
class UpResult:
    record: ClusterRecord
    already_running: bool
    state_dir: Path
    started: list[str] = field(default_factory=list)  # processes started now, by name
    adopted: list[str] = field(default_factory=list)  # found running and kept


@dataclass
class Layout:
    """What `tc up` was asked for last time (state_dir/layout.json): a later `tc up` without
    options brings back the same cluster, its stores (and etcd members) at the same addresses."""

    workers: int = 1
    mem: str = DEFAULT_WORKER_MEM
    disk: str = ""  # workers keep their disk tier in DISK/<worker name>
    store_addr: str = ""  # one address, or the members' H1:P1,H2:P2 with --ha
    ha: bool = False
    etcd: list[dict] = field(default_factory=list)  # EtcdMember records (--ha)
    etcd_token: str = ""
    tls: bool = False  # every process speaks mutual TLS with STATE_DIR/tls

    @classmethod
    def load(cls, state_dir: Path) -> Layout:
        try:
            return cls(**json.loads((state_dir / LAYOUT_FILE).read_text()))
        except (OSError, ValueError, TypeError):
            return cls()

    def save(self, state_dir: Path) -> None:
        tmp = state_dir / (LAYOUT_FILE + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, state_dir / LAYOUT_FILE)

    def store_names(self) -> list[str]:
        return [f"store-{i + 1}" for i in range(HA_STORES)] if self.ha else ["store"]


def up(
    state_dir: Path,
    workers: int | None = None,
    mem: str | None = None,
    listen_host: str = "127.0.0.1",
    disk: Path | None = None,
    ha: bool = False,
    tls: bool = False,
) -> UpResult:
    """Bring up a store and `workers` workers (by default as last time in this state dir).

    Stores come back at the addresses they had, on the same records, so workers that outlived
    them reconnect and report their inventory again. Processes of the cluster still running
    are adopted, never started twice; missing workers start under their old names (with a disk
    tier, what they held is readable again). `ha`: a 3-member etcd cluster and two Global Store
    processes serving it; workers and callers fail over between the stores. `tls`: a local CA
    and certificate in STATE_DIR/tls, and every process (and `tc`) speaks mutual TLS."""
    state_dir = state_dir.resolve()  # the processes run in state_dir/run
    with _state_lock(state_dir):
        layout = Layout.load(state_dir)
        fresh = not (state_dir / LAYOUT_FILE).exists()
        if ha and not fresh and not layout.ha:
            raise InvalidArgument(
                f"{state_dir} holds a cluster on sqlite: --ha needs a new state dir (its records "
                "would not move to etcd)"
            )
        if tls and not fresh and not layout.tls:
            raise InvalidArgument(
                f"{state_dir} holds a plaintext cluster: `tc down` it and remove {state_dir} "
                "first, or use a new --state-dir for --tls"
            )
        layout.ha = layout.ha or ha
        layout.tls = layout.tls or tls
        # The worker settings asked for now go into the saved layout only once the workers
        # they start are up: a `--mem` or `--disk` that fails must not be what the next plain
        # `tc up` repeats.
        worked = replace(layout)
        layout.workers = workers or layout.workers
        layout.mem = mem or layout.mem
        layout.disk = str(disk.resolve()) if disk else layout.disk
        previous = ClusterRecord.load(state_dir)
        live = {
            p.name: p
            for p in (previous.processes if previous else [])
            if _is_ours(p.pid, p.started_at)
        }
        _check_running_workers(live, worked, layout, mem)
        etcd_names = [f"etcd-{i + 1}" for i in range(HA_ETCD_MEMBERS)] if layout.ha else []
        names = etcd_names + layout.store_names()
        names += [f"worker-{i + 1}" for i in range(layout.workers)]
        if previous is not None and all(n in live for n in names):
            return UpResult(previous, True, state_dir, adopted=names)
        token = read_token(state_dir) or secrets.token_urlsafe(32)
        write_token(state_dir, token)
        (state_dir / "logs").mkdir(exist_ok=True)
        (state_dir / "run").mkdir(exist_ok=True)
        result = UpResult(ClusterRecord("", time.time()), False, state_dir)
        spawned: list[subprocess.Popen] = []
        tls_args = []
        if layout.tls:
            from tensorcast.sdk.tls_certs import local_cluster_tls

            files = local_cluster_tls(state_dir)
            tls_args = ["--tls-ca", files.ca, "--tls-cert", files.cert, "--tls-key", files.key]
        try:
            endpoints = _up_etcd(state_dir, layout, worked, listen_host, live, result, spawned)
            workers_live = any(n.startswith("worker-") for n in live)
            stores = []
            saved = layout.store_addr.split(",") if layout.store_addr else []
            for i, name in enumerate(layout.store_names()):
                if name in live:
                    result.adopted.append(name)
                    stores.append(live[name])
                    continue
                old = saved[i] if i < len(saved) else ""
                stores.append(
                    _start_store(
                        state_dir,
                        name,
                        old,
                        listen_host,
                        token,
                        [*endpoints_args(endpoints), *tls_args],
                        workers_live,
                        spawned,
                    )
                )
                result.started.append(name)
            result.record.store_addr = layout.store_addr = ",".join(s.addr for s in stores)
            result.record.processes += stores
            _with_workers_of(layout, worked).save(state_dir)
            _forget_dead_workers(
                state_dir, result.record.store_addr, token, [n for n in names if n not in live]
            )
            pending = []
            for name in names:
                if not name.startswith("worker-"):
                    continue
                if name in live:
                    result.adopted.append(name)
                    result.record.processes.append(live[name])
                    continue
                args = ["--store", result.record.store_addr, "--listen", f"{listen_host}:0"]
                args += ["--mem", layout.mem, *tls_args]
                if layout.disk:
                    args += ["--disk", str(Path(layout.disk) / name)]
                pending.append(_start_worker(state_dir, name, args, token, spawned))
            started = time.monotonic()
            for name, proc, ready, log in pending:  # workers pre-fault their pools in parallel
                left = start_timeout_s(len(pending), layout.mem) - (time.monotonic() - started)
                info = _wait_ready(proc, ready, log, max(left, 1.0))
                result.started.append(name)
                result.record.processes.append(
                    ProcessRecord(
                        "worker",
                        name,
                        proc.pid,
                        info["addr"],
                        str(log),
                        info["metrics_addr"],
                        started_at=_started_at(proc.pid),
                    )
                )
            layout.save(state_dir)
            result.record.save(state_dir)
            return result
        except BaseException:
            for proc in spawned:
                proc.kill()
            raise


def _with_workers_of(layout: Layout, worked: Layout) -> Layout:
    """`layout` with the worker settings of `worked` (those last seen starting workers)."""
    return replace(layout, workers=worked.workers, mem=worked.mem, disk=worked.disk)


def _up_etcd(
    state_dir: Path,
    layout: Layout,
    worked: Layout,
    listen_host: str,
    live: dict[str, ProcessRecord],
    result: UpResult,
    spawned: list[subprocess.Popen],
) -> list[str]:
    """The etcd members of an --ha cluster (started where missing, at their old addresses and
    data dirs); returns their client addresses. Empty without --ha. `worked`: the layout's
    worker settings as last seen working (saved with the members' plan)."""
    from tensorcast.sdk import local_etcd

    if not layout.ha:
        return []
    if not layout.etcd:
        members = local_etcd.plan_members(HA_ETCD_MEMBERS, listen_host, state_dir / "etcd")
        layout.etcd = [asdict(m) for m in members]
        layout.etcd_token = local_etcd.cluster_token()
        # Saved before any member starts: a member's data dir holds its peers' addresses, so
        # a `tc up` after a failed one must start the same members, not plan new ones.
        _with_workers_of(layout, worked).save(state_dir)
    members = [local_etcd.EtcdMember.from_json(m) for m in layout.etcd]
    log = state_dir / "logs" / "etcd.log"
    procs = []
    for m in members:
        if m.name in live:
            result.adopted.append(m.name)
            result.record.processes.append(live[m.name])
            continue
        proc = local_etcd.spawn(m, members, layout.etcd_token, log, state_dir / "run")
        spawned.append(proc)
        procs.append(proc)
        result.started.append(m.name)
        result.record.processes.append(
            ProcessRecord(
                "etcd", m.name, proc.pid, m.client_addr, str(log), started_at=_started_at(proc.pid)
            )
        )
    local_etcd.wait_healthy(members, procs, log)
    return [m.client_addr for m in members]


def endpoints_args(etcd_endpoints: list[str]) -> list[str]:
    if not etcd_endpoints:
        return []
    return ["--backend", "etcd", "--etcd-endpoints", ",".join(etcd_endpoints)]


def _start_store(
    state_dir: Path,
    name: str,
    old_addr: str,
    listen_host: str,
    token: str,
    extra_args: list[str],
    workers_live: bool,
    spawned: list[subprocess.Popen],
) -> ProcessRecord:
    """A store at its old address (its live workers beat there); with none of its workers
    alive a new port does as well when the old one is taken meanwhile."""
    log = state_dir / "logs" / f"{name}.log"
    ready = state_dir / "run" / f"{name}.json"
    records = [] if "--backend" in extra_args else ["--db", str(state_dir / "store.db")]
    listens = [old_addr] if old_addr else []
    if not (listens and workers_live):
        listens.append(f"{listen_host}:0")
    for i, listen in enumerate(listens):
        args = ["store", "start", *records, *extra_args, "--listen", listen]
        proc = _spawn([*args, "--state-dir", str(state_dir)], log, token, ready)
        spawned.append(proc)
        try:
            info = _wait_ready(proc, ready, log)
        except TensorcastError:
            if i == len(listens) - 1:
                raise
            continue
        return ProcessRecord(
            "store",
            name,
            proc.pid,
            info["addr"],
            str(log),
            info["metrics_addr"],
            info["frame_port"],
            _started_at(proc.pid),
        )
    raise AssertionError("unreachable")


def _start_worker(
    state_dir: Path, name: str, args: list[str], token: str, spawned: list[subprocess.Popen]
) -> tuple[str, subprocess.Popen, Path, Path]:
    log = state_dir / "logs" / f"{name}.log"
    ready = state_dir / "run" / f"{name}.json"
    # --state-dir: a child must not find its TLS files (or token) in the default state dir.
    args = ["worker", "start", *args, "--name", name, "--state-dir", str(state_dir)]
    proc = _spawn(args, log, token, ready)
    spawned.append(proc)
    return name, proc, ready, log


def _forget_dead_workers(state_dir: Path, store_addr: str, token: str, names: list[str]) -> None:
    """Workers of this host about to start again under their old names: their processes are
    gone (checked by pid), so their registrations go too rather than hold the names until
    their heartbeats expire. A live worker of such a name stays (the new one is refused)."""
    from tensorcast.proto import tensorcast_pb2 as pb
    from tensorcast.sdk.runtime import Runtime

    if not names:
        return
    from tensorcast.config import tls_files

    rt = Runtime(store_addr, token, 10.0, tls_files(state_dir))
    try:
        for w in rt.workers():
            if w.name in names and rt.is_local(w) and not _is_ours(w.pid):
                rt.store.call("DeregisterWorker", pb.DeregisterWorkerRequest(worker_id=w.worker_id))
    finally:
        rt.close()


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


def start_timeout_s(workers: int, mem: str) -> float:
    """How long `tc up` waits for `workers` new workers of `mem` each to become ready."""
    return START_TIMEOUT_S + workers * parse_size(mem) / PREFAULT_BYTES_PER_S


def stop_timeout_s(layout: Layout) -> float:
    """How long `tc down` waits for the workers before killing them."""
    if not layout.disk:
        return STOP_TIMEOUT_S
    pools = layout.workers * parse_size(layout.mem)
    return STOP_TIMEOUT_S + pools / PERSIST_BYTES_PER_S


def down(
    state_dir: Path, timeout_s: float | None = None
) -> tuple[list[ProcessRecord], list[ProcessRecord]]:
    """Stop the cluster's processes on this host (workers, then stores, then etcd members);
    returns them, and those that had to be killed (SIGKILL after `timeout_s`, by default
    `stop_timeout_s` for workers and STOP_TIMEOUT_S for the others): a disk-tier worker
    killed may not have saved all it held."""
    if not state_dir.is_dir():  # nothing to stop (a mistyped --state-dir is not created)
        return [], []
    with _state_lock(state_dir):
        record = ClusterRecord.load(state_dir)
        if record is None:
            return [], []
        worker_timeout_s = timeout_s or stop_timeout_s(Layout.load(state_dir))
        ordered = _extra_local_workers(state_dir, record) + record.processes
        stopped: list[ProcessRecord] = []
        killed: list[ProcessRecord] = []
        for role in ("worker", "store", "etcd"):
            group = [p for p in ordered if p.role == role]
            live = [p for p in group if _is_ours(p.pid, p.started_at)]
            for p in live:
                _signal(p.pid, signal.SIGTERM)
            wait_s = worker_timeout_s if role == "worker" else timeout_s or STOP_TIMEOUT_S
            deadline = time.monotonic() + wait_s
            for p in live:
                if not _wait_exit(p.pid, max(0.1, deadline - time.monotonic())):
                    _signal(p.pid, signal.SIGKILL)
                    killed.append(p)
            stopped.extend(live)
        (state_dir / "cluster.json").unlink(missing_ok=True)
        for f in (state_dir / "run").glob("*.json"):
            f.unlink()
        return stopped, killed


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # it exited meanwhile
