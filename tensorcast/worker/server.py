"""Runs a worker process: pool, gRPC service, local socket, registration and heartbeats."""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from tensorcast.config import TLSFiles, accepted_tokens, fault_injection
from tensorcast.errors import InvalidArgument, ResourceExhausted, TensorcastError
from tensorcast.metrics import MetricsServer, Sample
from tensorcast.proto import tensorcast_pb2_grpc as pb_grpc
from tensorcast.rpc.server import bind, make_server
from tensorcast.transport import native, shm
from tensorcast.transport.unix import page_socket_name, socket_address
from tensorcast.worker.disk_tier import DiskTier
from tensorcast.worker.gpu_tier import GpuTier
from tensorcast.worker.instances import MAX_ATTACHED
from tensorcast.worker.local_server import LocalServer
from tensorcast.worker.node import ROLES, WorkerNode
from tensorcast.worker.plans import MAX_PLANS_IN_FLIGHT, PlanExecutor
from tensorcast.worker.pool import Pool
from tensorcast.worker.service import WorkerService
from tensorcast.worker.transfers import Transfers

log = logging.getLogger("tensorcast.worker")


def parse_roles(text: str) -> tuple[str, ...]:
    roles = tuple(r.strip() for r in text.split(",") if r.strip())
    bad = [r for r in roles if r not in ROLES]
    if bad or not roles:
        raise InvalidArgument(f"bad roles {text!r}: choose from {', '.join(ROLES)}")
    return roles


def advertised(addr: str) -> str:
    host, _, port = addr.rpartition(":")
    if host in ("0.0.0.0", "[::]", "::", ""):
        host = socket.gethostbyname(socket.gethostname())
    return f"{host}:{port}"


# A stopping shard home copies its pages to the next homes for at most this long (`tc worker
# stop` waits 10 s by default before SIGKILL, and a disk tier is written after it).
HAND_OVER_BUDGET_S = 5.0
STOP_POLL_S = 0.5

METRIC_HELP = {
    "tc_pool_bytes": "pool memory by tier and kind (capacity, used)",
    "tc_replicas": "replicas held, by tier",
    "tc_pinned_replicas": "replicas pinned in memory",
    "tc_transfer_sent_bytes_total": "bytes sent to peers by the native data server",
    "tc_transfer_received_bytes_total": "bytes pulled from peers into this worker",
    "tc_transfers_active": "outgoing transfers (open tickets)",
    "tc_file_read_bytes_total": "bytes read from files registered by reference (the cold path)",
    "tc_heartbeat_age_seconds": "time since the last heartbeat the Global Store acknowledged",
    "tc_kv_pages": "KV pages held, homed here or cached copies",
    "tc_kv_page_bytes": "bytes of the KV pages held",
    "tc_kv_page_requests_total": "same-host page requests the native page server answered",
    "tc_kv_page_errors_total": "page requests answered with an error",
    "tc_kv_page_connections": "open same-host page connections",
    "tc_kv_remote_page_requests_total": "page requests from other hosts served on the data port",
    "tc_kv_remote_page_errors_total": "remote page requests answered with an error",
    "tc_kv_remote_page_bytes_total": "page bytes received (put) and sent (read) on the data port",
    "tc_kv_remote_page_connections": "open page connections from other hosts",
    "tc_gpu_tier_loads_total": "contents copied from the pool into the GPU tier",
    "tc_gpu_tier_evictions_total": "contents evicted from the GPU tier to make room",
    "tc_plans_in_flight": "plans this gateway runs, or waits on for a key running elsewhere",
}


def _gpu_samples(gpu: GpuTier | None) -> list[Sample]:
    if gpu is None:
        return []
    stats = gpu.stats()
    return [
        ("tc_pool_bytes", {"tier": "gpu", "kind": "capacity"}, stats.capacity_bytes),
        ("tc_pool_bytes", {"tier": "gpu", "kind": "used"}, stats.used_bytes),
        ("tc_replicas", {"tier": "gpu"}, len(stats.contents)),
        ("tc_gpu_tier_loads_total", {}, stats.loads_total),
        ("tc_gpu_tier_evictions_total", {}, stats.evictions_total),
    ]


def _samples(
    node: WorkerNode,
    transfers: Transfers,
    page_server: Any,
    gpu: GpuTier | None,
    plans: PlanExecutor,
) -> list[Sample]:
    stats = node.pool.stats()
    disk = node.disk.content_ids() if node.disk else []
    pages = node.pages.stats()
    served = page_server.stats()
    remote = transfers.data_server.page_stats()
    return [
        *_gpu_samples(gpu),
        ("tc_pool_bytes", {"tier": "cpu", "kind": "capacity"}, stats.capacity_bytes),
        ("tc_pool_bytes", {"tier": "cpu", "kind": "used"}, stats.used_bytes),
        (
            "tc_pool_bytes",
            {"tier": "disk", "kind": "used"},
            node.disk.used_bytes() if node.disk else 0,
        ),
        ("tc_replicas", {"tier": "cpu"}, stats.num_contents),
        ("tc_replicas", {"tier": "disk"}, len(disk)),
        ("tc_replicas", {"tier": "file"}, len(node.references.content_ids())),
        ("tc_pinned_replicas", {}, len(stats.pinned_content_ids)),
        ("tc_transfer_sent_bytes_total", {}, transfers.data_server.stats()["bytes_sent"]),
        ("tc_transfer_received_bytes_total", {}, transfers.bytes_received_total),
        ("tc_transfers_active", {}, transfers.active()),
        ("tc_file_read_bytes_total", {}, node.references.bytes_read_total),
        ("tc_heartbeat_age_seconds", {}, time.monotonic() - node.last_heartbeat_ok),
        ("tc_kv_pages", {"kind": "home"}, pages["home_pages"]),
        ("tc_kv_pages", {"kind": "cached"}, pages["pages"] - pages["home_pages"]),
        ("tc_kv_page_bytes", {}, pages["bytes"]),
        ("tc_kv_page_requests_total", {}, served["requests"]),
        ("tc_kv_page_errors_total", {}, served["errors_sent"]),
        ("tc_kv_page_connections", {}, served["active_connections"]),
        ("tc_kv_remote_page_requests_total", {}, remote.get("requests", 0)),
        ("tc_kv_remote_page_errors_total", {}, remote.get("errors_sent", 0)),
        ("tc_kv_remote_page_bytes_total", {"direction": "in"}, remote.get("bytes_received", 0)),
        ("tc_kv_remote_page_bytes_total", {"direction": "out"}, remote.get("bytes_sent", 0)),
        ("tc_kv_remote_page_connections", {}, remote.get("active_connections", 0)),
        ("tc_plans_in_flight", {}, plans.in_flight),
    ]


def _health(node: WorkerNode, heartbeat_interval_s: float) -> tuple[bool, dict]:
    """Healthy while the store would count this worker alive (its last beat within the
    TTL the store gave it, less an interval: the store's clock started when it was sent)."""
    age = time.monotonic() - node.last_heartbeat_ok
    ok = age < node.heartbeat_ttl_s - heartbeat_interval_s
    return ok, {"worker_id": node.worker_id, "name": node.name, "heartbeat_age_s": round(age, 3)}


def serve(
    store_addr: str,
    listen: str,
    token: str,
    mem_bytes: int,
    roles: tuple[str, ...],
    name: str,
    heartbeat_interval_s: float,
    rpc_timeout_s: float,
    disk_dir: Path | None = None,
    metrics_listen: str = "127.0.0.1:0",
    on_ready=None,
    stop_event: threading.Event | None = None,
    gpu_mem_bytes: int = 0,
    gpu_device: int = 0,
    tls: TLSFiles | None = None,
) -> None:
    available = psutil.virtual_memory().available
    if mem_bytes > available:
        raise ResourceExhausted(
            f"--mem {mem_bytes} bytes exceeds the {available} bytes of memory available"
        )
    if gpu_mem_bytes:  # fail before allocating anything when there is no such GPU
        from tensorcast.transport import cuda

        try:
            cuda.resolve(f"cuda:{gpu_device}")
        except TensorcastError as e:
            raise type(e)(f"--gpu-mem (a GPU tier on cuda:{gpu_device}): {e}") from None
    pool = Pool(mem_bytes)
    disk = DiskTier(disk_dir) if disk_dir else None
    token = accepted_tokens(token)
    node = WorkerNode(pool, store_addr, token, name, roles, rpc_timeout_s, disk, tls)
    # Attach streams hold a thread each for their lifetime, plans one each for up to their
    # deadline (both bounded); the rest serve every other call.
    server = make_server(token, max_workers=MAX_ATTACHED + MAX_PLANS_IN_FLIGHT + 16)
    host = listen.rpartition(":")[0]
    data_server = native.data_server(host, pool.mm, token, tls=tls)
    faults = fault_injection()
    if faults.corrupt_chunks:
        data_server.inject_corrupt_chunks(faults.corrupt_chunks)
    if faults.close_after_chunks:
        data_server.inject_close_after_chunks(faults.close_after_chunks)
    transfers = Transfers(node, data_server)
    gpu = GpuTier(pool, node.load_and_hold, gpu_mem_bytes, gpu_device) if gpu_mem_bytes else None
    service = WorkerService(node, transfers)
    pb_grpc.add_WorkerServiceServicer_to_server(service, server)
    node.addr = advertised(bind(server, listen, tls))
    node.data_addr = advertised(f"{host}:{data_server.port}")
    server.start()
    local = LocalServer(node, gpu)
    local.start()
    page_server = native.PageServer(
        socket_address(page_socket_name(node.local_socket)),
        node.pages.index,
        token,
        pool.capacity_bytes,
    )
    node.pages.server = page_server
    # Callers on other hosts reach this worker's pages on its data port (page_remote.h).
    data_server.serve_pages(node.pages.index, token, pool.capacity_bytes)
    metrics = MetricsServer(
        metrics_listen,
        lambda: _samples(node, transfers, page_server, gpu, service.plans),
        METRIC_HELP,
        lambda: _health(node, heartbeat_interval_s),
    )
    node.metrics_addr = metrics.addr
    node.register()
    node.adopt_references()
    node.heartbeat_interval_s = heartbeat_interval_s
    node.heartbeat_once()  # the lease table and shard bids at once, not an interval later

    def on_tick() -> None:
        transfers.expire()
        if gpu is not None:
            gpu.sweep()

    node.start_heartbeats(heartbeat_interval_s, on_tick=on_tick)
    stop = stop_event or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    log.info(
        "worker %s (%s) listening on %s, pool %d bytes (shared-memory huge pages: %s), "
        "roles %s, store %s",
        node.name,
        node.worker_id,
        node.addr,
        pool.capacity_bytes,
        shm.shmem_huge_pages(),
        ",".join(roles),
        store_addr,
    )
    if on_ready:
        on_ready(node)
    # Woken now and then: a SIGTERM the kernel hands to another thread sets `stop` from the
    # handler only once this thread runs Python again (a plain wait() may never return).
    while not stop.wait(STOP_POLL_S):
        pass
    log.info("worker %s stopping", node.name)
    if "shard-home" in roles:
        log.info("handed %d shards over", node.hand_over_shards(HAND_OVER_BUDGET_S))
    if disk is not None:
        log.info("wrote %d contents to the disk tier %s", node.persist(), disk_dir)
    page_server.stop()
    local.close()
    node.instances.close()
    metrics.close()
    data_server.stop()
    node.stop()
    server.stop(grace=0.5).wait(5)
    node.pages.close()
    if gpu is not None:
        gpu.close()
