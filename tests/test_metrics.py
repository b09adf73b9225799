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


def test_the_text_format_keeps_each_metric_together_and_escapes_label_values():
    """A metric's samples under one HELP/TYPE block, whatever order they were collected in
    (a GPU tier's lines split tc_pool_bytes in two, which the format forbids); label values
    with a quote, backslash or newline stay one line."""
    from tensorcast.metrics import render

    page = render(
        [
            ("tc_a", {"k": "x"}, 1),
            ("tc_b", {}, 2),
            ("tc_a", {"k": 'line\nbreak "quoted" \\'}, 3),
        ],
        {},
    )
    lines = page.splitlines()
    assert lines[:4] == [
        "# HELP tc_a tc_a",
        "# TYPE tc_a gauge",
        'tc_a{k="x"} 1',
        'tc_a{k="line\\nbreak \\"quoted\\" \\\\"} 3',
    ]
    assert lines[4:7] == ["# HELP tc_b tc_b", "# TYPE tc_b gauge", "tc_b 2"]


def test_a_stalled_scraper_lets_go_and_the_threads_are_bounded(monkeypatch):
    """The metrics port has no authentication: a client that connects and sends nothing is
    dropped after SCRAPE_TIMEOUT_S, and past MAX_SCRAPES connections at once more are closed
    unanswered (each held a thread for good). A scrape after them is answered."""
    import socket

    from tensorcast import metrics

    monkeypatch.setattr(metrics, "SCRAPE_TIMEOUT_S", 1.0)
    server = metrics.MetricsServer("127.0.0.1:0", lambda: [], {}, lambda: (True, {}))
    try:
        host, port = server.addr.rsplit(":", 1)
        idle = [
            socket.create_connection((host, int(port)), 5) for _ in range(metrics.MAX_SCRAPES + 4)
        ]
        for sock in idle:  # each is closed by the server: past the cap at once, else timed out
            sock.settimeout(15)
            assert sock.recv(1) == b""
            sock.close()
        with urllib.request.urlopen(f"http://{server.addr}/healthz", timeout=10) as reply:
            assert reply.status == 200
    finally:
        server.close()


def test_a_failing_scrape_is_answered_503_with_the_error():
    from tensorcast import metrics

    def broken() -> list:
        raise RuntimeError("the backend is gone")

    server = metrics.MetricsServer("127.0.0.1:0", broken, {}, lambda: (True, {}))
    try:
        try:
            urllib.request.urlopen(f"http://{server.addr}/metrics", timeout=10)
            raise AssertionError("a broken scrape answered 200")
        except urllib.error.HTTPError as e:
            assert e.code == 503 and "the backend is gone" in e.read().decode()
    finally:
        server.close()


def test_store_metrics_survive_odd_frame_methods_and_restarted_worker_names(fresh_cluster):
    """Any caller with the token may name any method on the frame port: the name became a
    label as sent (a quote and newline in it broke the page, each new name added series for
    good). A worker killed and started again under its name (a new id) was listed twice:
    one series per name now, pools of live workers only."""
    import socket

    from tensorcast.rpc import frames
    from tensorcast.transport.unix import recv_exact

    store = next(p for p in fresh_cluster.record.processes if p.role == "store")
    with fresh_cluster.connect() as rt:
        port = rt.store_status().frame_port
        token = rt.token.encode()
        with socket.create_connection((rt.store_addr.rpartition(":")[0], port), 5) as sock:
            sock.sendall(frames.HELLO.pack(frames.MAGIC, frames.VERSION, len(token)) + token)
            assert recv_exact(sock, frames.HELLO_REPLY.size) == frames.HELLO_REPLY.pack(0, 0)
            name = b'evil"} 1\npwned_metric 42\n#'
            sock.sendall(frames.REQUEST.pack(0, len(name)) + name)
            size, status = frames.REPLY.unpack(recv_exact(sock, frames.REPLY.size))
            assert status == 1 and b"no unary method" in recv_exact(sock, size)
        with fresh_cluster.extra_worker("twice") as proc:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            wait_until(lambda: not any(w.alive for w in rt.workers() if w.name == "twice"), 30)
        with fresh_cluster.extra_worker("twice"):
            wait_until(lambda: any(w.alive for w in rt.workers() if w.name == "twice"), 30)
            status, text = _get(store.metrics_addr, "/metrics")
    assert status == 200
    assert "pwned_metric" not in text and 'method="unknown"' in text
    s = _parse(text)  # every line parses
    ages = [k for k in s if k.startswith("tc_store_worker_heartbeat_age_seconds") and "twice" in k]
    assert len(ages) == 1
    pools = [k for k in s if k.startswith("tc_store_worker_pool_bytes") and "twice" in k]
    assert sorted(pools) == [
        'tc_store_worker_pool_bytes{kind="capacity",worker="twice"}',
        'tc_store_worker_pool_bytes{kind="used",worker="twice"}',
    ]


def test_the_store_is_unhealthy_while_its_sweeps_fail(tmp_path):
    """The store's /healthz said ok whatever happened to its backend: an etcd that stops
    answering (SIGSTOP) fails the sweeps, and /healthz says so (503) until they work again."""
    import json as jsonlib
    import subprocess
    import sys

    from tensorcast.sdk import local_etcd

    (member,) = local_etcd.plan_members(1, "127.0.0.1", tmp_path)
    log = tmp_path / "etcd.log"
    etcd = local_etcd.spawn(member, [member], local_etcd.cluster_token(), log, tmp_path)
    ready = tmp_path / "store.json"
    store = None
    try:
        local_etcd.wait_healthy([member], [etcd], log)
        args = ["store", "start", "--backend", "etcd", "--etcd-endpoints", member.client_addr]
        args += ["--listen", "127.0.0.1:0", "--token", "t", "--ready-file", str(ready)]
        store = subprocess.Popen(
            [sys.executable, "-m", "tensorcast.cli.main", *args, "--state-dir", str(tmp_path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(ready.exists, 30)
        addr = jsonlib.loads(ready.read_text())["metrics_addr"]
        assert _get(addr, "/healthz")[0] == 200
        os.kill(etcd.pid, signal.SIGSTOP)
        try:
            _, body = wait_until(
                lambda: (r := _get(addr, "/healthz"))[0] == 503 and r, 60, interval_s=0.5
            )
            assert "failing" in jsonlib.loads(body)["sweeps"]
        finally:
            os.kill(etcd.pid, signal.SIGCONT)
        wait_until(lambda: _get(addr, "/healthz")[0] == 200, 60, interval_s=0.5)
    finally:
        if store is not None:
            store.terminate()
            store.wait(30)
        etcd.terminate()
        etcd.wait(10)
