"""Runs the Global Store process: gRPC server, sqlite backend, and the sweeper thread."""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path

from tensorcast.proto import tensorcast_pb2_grpc as pb_grpc
from tensorcast.rpc.server import bind, make_server
from tensorcast.store.service import GlobalStoreService
from tensorcast.store.sqlite_store import SqliteStore

log = logging.getLogger("tensorcast.store")

SWEEP_INTERVAL_S = 0.5


def serve(
    db_path: Path,
    listen: str,
    token: str,
    heartbeat_ttl_s: float,
    on_ready=None,
    stop_event: threading.Event | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT (or `stop_event`). `on_ready(addr)` runs once listening."""
    store = SqliteStore(db_path, heartbeat_ttl_s)
    server = make_server(token)
    pb_grpc.add_GlobalStoreServicer_to_server(
        GlobalStoreService(store, str(db_path), heartbeat_ttl_s), server
    )
    addr = bind(server, listen)
    server.start()
    stop = stop_event or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    log.info("global store listening on %s, db %s, schema v%s", addr, db_path, store.schema_version)
    if on_ready:
        on_ready(addr)
    while not stop.wait(SWEEP_INTERVAL_S):
        try:
            store.sweep(time.time())
        except Exception:  # keep serving; the next sweep retries
            log.exception("sweep failed")
    log.info("global store stopping")
    server.stop(grace=0.5).wait(5)
    store.close()
