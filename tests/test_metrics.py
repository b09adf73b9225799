"""Prometheus /metrics and /healthz on the Global Store and workers."""

from __future__ import annotations

import json
import os
import signal
import urllib.error
import urllib.request

import torch
from conftest import wait_until


def _get(addr: str, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{addr}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _parse(text: str) -> dict[str, float]:
    """Prometheus text format -> {'name{labels}': value}; every non-comment line must parse."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        samples[key] = float(value)
    return samples


def test_metrics_follow_the_cluster(fresh_cluster):
    store = next(p for p in fresh_cluster.record.processes if p.role == "store")
    worker = next(p for p in fresh_cluster.record.processes if p.role == "worker")
    with fresh_cluster.connect() as rt:
        rt.put({"w": torch.ones(1024 * 1024)}, "m1")
        rt.register({"k": torch.ones(8)}, "m2", ttl_s=60)
        rt.artifact("m1").tensor_dict()
        rt.pages().put_pages({"kv/m/1": torch.ones(1024), "kv/m/2": torch.ones(1024)})
        assert rt.pages().get_pages(["kv/m/1", "kv/nope"])[1] is None
        status, text = _get(worker.metrics_addr, "/metrics")
    assert status == 200
    w = _parse(text)
    assert w['tc_pool_bytes{kind="capacity",tier="cpu"}'] == 64 * 1024 * 1024
    assert w['tc_pool_bytes{kind="used",tier="cpu"}'] >= 4 * 1024 * 1024
    assert w['tc_replicas{tier="cpu"}'] == 2
    assert w['tc_kv_pages{kind="home"}'] == 2 and w["tc_kv_page_bytes"] == 2 * 4096
    assert w["tc_kv_page_requests_total"] >= 3  # hello, alloc + commit, get
    assert w["tc_kv_page_errors_total"] == 0 and w["tc_kv_page_connections"] == 1
    heartbeats = 'tc_rpc_duration_seconds_count{method="Heartbeat"}'
    s = wait_until(
        lambda: (m := _parse(_get(store.metrics_addr, "/metrics")[1])).get(heartbeats) and m, 30
    )
    assert s['tc_store_artifacts{owner="system"}'] == 1
    assert s['tc_store_artifacts{owner="lease"}'] == 1
    assert s['tc_store_workers{state="alive"}'] == 1
    # The two puts and the lookup: one Batch request each (the worker's, for its callers).
    assert s['tc_rpc_duration_seconds_bucket{method="Batch",le="+Inf"}'] == 3
    status, body = _get(worker.metrics_addr, "/healthz")
    assert status == 200 and json.loads(body)["ok"]
    assert _get(worker.metrics_addr, "/nope")[0] == 404
    # A worker cut off from its store turns unhealthy.
    os.kill(store.pid, signal.SIGKILL)
    wait_until(lambda: _get(worker.metrics_addr, "/healthz")[0] == 503, 30, 0.2)
