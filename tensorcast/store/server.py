"""Runs the Global Store process: gRPC server, sqlite backend, and the sweeper thread."""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

from tensorcast.config import DEFAULT_BATCH_TIMEOUT_S, DEFAULT_UNREFERENCED_GRACE_S, TLSFiles
from tensorcast.metrics import MetricsServer, Sample
from tensorcast.proto import tensorcast_pb2_grpc as pb_grpc
from tensorcast.rpc.frames import FrameServer
from tensorcast.rpc.server import bind, make_server
from tensorcast.store.base import Coordination, MetadataStore
from tensorcast.store.coordination import SqliteCoordination
from tensorcast.store.service import GlobalStoreService
from tensorcast.store.sqlite_store import SqliteStore

log = logging.getLogger("tensorcast.store")

SWEEP_INTERVAL_S = 0.5


METRIC_HELP = {
    "tc_store_artifacts": "artifacts by owner",
    "tc_store_contents": "distinct contents",
    "tc_store_workers": "registered workers by liveness",
    "tc_store_worker_heartbeat_age_seconds": "time since each worker's last heartbeat",
    "tc_store_worker_pool_bytes": "pool memory per worker and kind (capacity, used)",
    "tc_store_heartbeats_total": "heartbeats by inventory (full, delta, resync: a delta refused)",
}


def _samples(store: MetadataStore) -> list[Sample]:
    now = time.time()
    workers = store.list_workers(now)
    owners = {"system": 0, "lease": 0} | store.artifacts_by_owner(now)
    _, num_contents = store.counts()
    samples: list[Sample] = [
        ("tc_store_artifacts", {"owner": owner}, count) for owner, count in owners.items()
    ]
    samples.append(("tc_store_contents", {}, num_contents))
    for alive in (True, False):
        samples.append(
            (
                "tc_store_workers",
                {"state": "alive" if alive else "dead"},
                sum(w.alive == alive for w in workers),
            )
        )
    # One series per name: a dead worker's only while no live one took its name (a restart
    # under the same --name has a new id), and pools of live workers only.
    live_names = {w.name for w in workers if w.alive}
    for w in workers:
        if not w.alive and w.name in live_names:
            continue
        samples.append(
            ("tc_store_worker_heartbeat_age_seconds", {"worker": w.name}, w.heartbeat_age_s)
        )
    for w in workers:
        if w.alive:
            labels = {"worker": w.name, "kind": "capacity"}
            samples.append(("tc_store_worker_pool_bytes", labels, w.mem_cap_bytes))
    for w in workers:
        if w.alive:
            labels = {"worker": w.name, "kind": "used"}
            samples.append(("tc_store_worker_pool_bytes", labels, w.mem_used_bytes))
    return samples


def open_backend(
    db_path: Path | None,
    etcd_endpoints: list[str],
    heartbeat_ttl_s: float,
    num_shards: int | None = None,
    unreferenced_grace_s: float = DEFAULT_UNREFERENCED_GRACE_S,
    etcd_prefix: str = "/tensorcast/",
    etcd_tls: TLSFiles | None = None,
    batch_timeout_s: float = DEFAULT_BATCH_TIMEOUT_S,
) -> tuple[MetadataStore, Coordination]:
    """The records' home: an etcd cluster when endpoints are given (several Global Store
    processes may share it), else one sqlite file."""
    if etcd_endpoints:
        from tensorcast.store.etcd_kv import EtcdKV
        from tensorcast.store.etcd_store import EtcdCoordination, EtcdStore

        kv = EtcdKV(etcd_endpoints, etcd_prefix, tls=etcd_tls)
        etcd = EtcdStore(kv, heartbeat_ttl_s, unreferenced_grace_s, batch_timeout_s)
        return etcd, EtcdCoordination(etcd, num_shards)
    assert db_path is not None
    sqlite = SqliteStore(db_path, heartbeat_ttl_s, unreferenced_grace_s)
    return sqlite, SqliteCoordination(sqlite, num_shards)


def serve(
    backend: tuple[MetadataStore, Coordination],
    listen: str,
    token: str,
    heartbeat_ttl_s: float,
    on_ready=None,
    stop_event: threading.Event | None = None,
    metrics_listen: str = "127.0.0.1:0",
    tls: TLSFiles | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT (or `stop_event`). `on_ready(addr, metrics_addr,
    frame_port)` runs once listening (frame_port 0: none, with TLS)."""
    store, coord = backend
    db_path = store.describe()
    sweeps: dict[str, Any] = {"failing": False, "error": ""}  # the last sweep's, for /healthz
    server = make_server(token)
    service = GlobalStoreService(store, coord, db_path, heartbeat_ttl_s)
    pb_grpc.add_GlobalStoreServicer_to_server(service, server)
    addr = bind(server, listen, tls)
    # The frame port (decision 76) has no TLS: a TLS cluster's calls all stay on gRPC.
    frames = None if tls else FrameServer(service, token, addr.rpartition(":")[0].strip("[]"))
    service.frame_port = frames.port if frames else 0
    server.start()
    metrics = MetricsServer(
        metrics_listen,
        lambda: (
            _samples(store)
            + [
                ("tc_store_heartbeats_total", {"inventory": k}, n)
                for k, n in service.heartbeats.items()
            ]
        ),
        METRIC_HELP,
        lambda: (
            not sweeps["failing"],
            {
                "db": db_path,
                "schema_version": getattr(store, "schema_version", 0),
                "sweeps": "failing: " + sweeps["error"] if sweeps["failing"] else "ok",
            },
        ),
    )
    stop = stop_event or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    log.info("global store listening on %s, records in %s", addr, db_path)
    if on_ready:
        on_ready(addr, metrics.addr, service.frame_port)
    while not stop.wait(SWEEP_INTERVAL_S):
        now = time.time()
        failing = bool(sweeps["failing"])
        try:
            store.sweep(now, judge_workers=not failing and now >= service.judged_from)
            coord.sweep(now)
        except Exception as e:  # keep serving; the next sweep retries
            if not failing:
                log.exception("sweep failed; retrying every %.1fs", SWEEP_INTERVAL_S)
            sweeps.update(failing=True, error=f"{type(e).__name__}: {e}"[:300])
            continue
        if failing:  # the backend answers again; the workers' heartbeats could not meanwhile
            log.info("sweeps work again")
            service.judged_from = now + heartbeat_ttl_s
            sweeps.update(failing=False, error="")
    log.info("global store stopping")
    metrics.close()
    if frames:
        frames.close()
    server.stop(grace=0.5).wait(5)
    store.close()
