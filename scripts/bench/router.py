#!/usr/bin/env python3
"""Routers under multi-turn agent workloads (paper §6.4, Fig. 10/11): TTFT and cache hit rate of
TensorCast's `rebalance` router against the SGLang model gateway.

Setup (all on 127.0.0.1, started in a temporary state dir, always stopped):
  - a TensorCast cluster: Global Store + 2 workers (1 GiB pools);
  - 4 emulated-engine instances (`tc instance start --engine sim`, 2 per worker), started fresh
    for every run (empty caches), `--time-scale C` = the workload's time compression;
  - `--hosts 2` (root): two hosts = two network namespaces joined by a bridge (tests/netns.py),
    a worker and two instances in each; the Global Store, Mooncake's master, Redis, the router
    or gateway and the client on the bridge (the root namespace). Migrations, TensorCast pages
    of the other host's home and Mooncake reads from the other host's segment then cross the
    veth, as KV crosses the network between the paper's nodes; `--rate` shapes each host's
    egress (tbf) so that the link, not these two shared cores, bounds it;
  - one router per run:
      gw-p2c             SGLang gateway (`sglang_router.launch_router`) --policy power_of_two
      gw-cache           SGLang gateway --policy cache_aware
      gw-p2c+mooncake    power_of_two, instances share prefixes through Mooncake Store
                         (mooncake_master over TCP, each instance mounting a 256 MiB segment)
      gw-p2c+tensorcast  power_of_two, instances share prefixes through TensorCast KV pages
      gw-p2c+redis       power_of_two, instances share prefixes through Redis (--routers only)
      tc-rebalance       `tc router start --policy rebalance` (sticky cache-aware placement +
                         Algorithm 1 every --tick seconds, migrations as plans)
      tc-rebalance+tensorcast  the same, instances also sharing prefixes through TensorCast
                         KV pages (a miss on the session's instance reads them from the pages)
  - the client: `--sessions` concurrent sessions (tensorcast.router.workload, preset think times
    divided by C), each turn a streamed /generate with input_ids = the whole context; a finished
    session is replaced by the next one; `--duration` seconds per run, the first `--warmup`
    seconds not counted.

Measured per run: TTFT (request sent -> first streamed token) median and p90 in real ms (time
is compressed by C: multiply by C for the emulated engine's seconds; real transfers are not
compressed), cache hit rate (cached prompt tokens / prompt tokens, from the engine's meta_info),
requests, errors, migrations and bytes moved (router migrations; shared-store bytes read and
written).

Runs are interleaved: repetition r runs every (preset, sessions, router) cell once, routers in
rotating order, with workload seed r for every router of that repetition. Reported: the median
over repetitions and every run.

    scripts/install-baselines.sh                     # SGLang gateway, Mooncake, Redis
    python scripts/bench/router.py --quick           # ~6-7 min: heaviest load per preset
    python scripts/bench/router.py --runs 5 --plots docs/
    python scripts/bench/router.py --replot a.err b.err --plots docs/   # tables/plots of saved runs
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import netns
from kv_baselines import (
    LOOPBACK,
    Skip,
    _accepts,
    _mooncake_master_binary,
    _stop,
    _tail,
    free_port,
)

from tensorcast.router.workload import Workload

ROUTERS = (
    "gw-p2c",
    "gw-cache",
    "gw-p2c+mooncake",
    "gw-p2c+tensorcast",
    "tc-rebalance",
    "tc-rebalance+tensorcast",
)
ALL_ROUTERS = (*ROUTERS, "gw-p2c+redis")
COMPRESSION = {"fast": 8.0, "medium": 20.0, "slow": 60.0}  # think medians ~1 s real
PY = sys.executable


def tc_cmd(*args: str) -> list[str]:
    return [PY, "-m", "tensorcast.cli.main", *args]


@dataclass
class Bench:
    state_dir: Path
    logs: Path
    token_scale: float
    kv_bytes_per_token: int
    cache_tokens: int
    instances: int
    tick_s: float
    procs: list[subprocess.Popen] = field(default_factory=list)
    netns_cluster: netns.NetnsCluster | None = None  # --hosts 2
    router_args: list[str] = field(default_factory=list)  # more `tc router start` options

    @property
    def server_ip(self) -> str:
        """Where the shared servers listen: reachable from every host."""
        return self.netns_cluster.network.bridge_ip if self.netns_cluster else LOOPBACK

    def cluster_args(self) -> list[str]:
        if self.netns_cluster:
            return ["--addr", self.netns_cluster.store_addr]
        return ["--state-dir", str(self.state_dir)]

    def env(self) -> dict[str, str] | None:
        if self.netns_cluster:
            return {**os.environ, "TC_TOKEN": self.netns_cluster.token}
        return None

    def placement(self, i: int) -> tuple[list[str], str, str]:
        """Instance i's command prefix, worker and listen address (2 per worker)."""
        if self.netns_cluster is None:
            return [], f"worker-{i % 2 + 1}", f"{LOOPBACK}:0"
        ns = list(self.netns_cluster.network.hosts)[i % 2]
        return ["ip", "netns", "exec", ns], ns, f"{self.netns_cluster.network.hosts[ns]}:0"


def wait_for(predicate, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


def http_json(addr: str, method: str, path: str, body: Any = None, timeout_s: float = 10.0):
    host, _, port = addr.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        data = None if body is None else json.dumps(body)
        conn.request(method, path, data, {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


def healthy(addr: str) -> bool:
    try:
        return http_json(addr, "GET", "/health", timeout_s=2.0)[0] == 200
    except (OSError, ValueError):
        return False


# -- processes ---------------------------------------------------------------------------------


@contextlib.contextmanager
def started(cmd: list[str], log: Path, env: dict | None = None) -> Iterator[subprocess.Popen]:
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
    try:
        yield proc
    finally:
        _stop(proc)


@contextlib.contextmanager
def sim_instances(b: Bench, compression: float, kv_share: str, tag: str) -> Iterator[list[str]]:
    procs, readies = [], []
    with contextlib.ExitStack() as stack:
        for i in range(b.instances):
            ready = b.state_dir / f"sim-{i + 1}.ready"
            ready.unlink(missing_ok=True)
            readies.append(ready)
            prefix, worker, listen = b.placement(i)
            share = kv_share
            if kv_share.startswith("mooncake://"):  # its segment served from the instance's host
                share += f"&hostname={listen.rpartition(':')[0]}"
            cmd = prefix + tc_cmd(
                "instance",
                "start",
                "--engine",
                "sim",
                "--worker",
                worker,
                "--listen",
                listen,
                "--id",
                f"sim-{i + 1}",
                "--time-scale",
                str(compression),
                "--kv-bytes-per-token",
                str(b.kv_bytes_per_token),
                "--cache-tokens",
                str(b.cache_tokens),
                "--load-interval",
                "0.1",
                "--kv-share",
                share,
                "--ready-file",
                str(ready),
                *b.cluster_args(),
            )
            log = b.logs / f"{tag}-sim-{i + 1}.log"
            procs.append(stack.enter_context(started(cmd, log, b.env())))
        for proc, ready in zip(procs, readies):
            wait_for(lambda p=proc, r=ready: r.exists() or p.poll() is not None, 90, "sims")
            if proc.poll() is not None:
                raise RuntimeError(f"a sim instance exited: {_tail(b.logs / f'{tag}-sim-1.log')}")
        endpoints = [json.loads(r.read_text())["endpoint"] for r in readies]
        yield endpoints


@contextlib.contextmanager
def gateway(b: Bench, policy: str, endpoints: list[str], tag: str) -> Iterator[str]:
    port, metrics = free_port(), free_port()
    cmd = [
        PY,
        "-m",
        "sglang_router.launch_router",
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "--prometheus-host",
        LOOPBACK,
        "--prometheus-port",
        str(metrics),
        "--policy",
        policy,
        "--worker-startup-check-interval",
        "1",
        "--log-level",
        "warn",
        "--worker-urls",
        *[f"http://{e}" for e in endpoints],
    ]
    with started(cmd, b.logs / f"{tag}-gateway.log") as proc:
        addr = f"{LOOPBACK}:{port}"

        def ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"gateway exited: {_tail(b.logs / f'{tag}-gateway.log')}")
            try:
                body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
                return http_json(addr, "POST", "/generate", body, 5.0)[0] == 200
            except (OSError, ValueError):
                return False

        wait_for(ready, 120, "the SGLang gateway")
        yield addr


@contextlib.contextmanager
def tc_router(b: Bench, tag: str) -> Iterator[str]:
    ready = b.state_dir / "router.ready"
    ready.unlink(missing_ok=True)
    cmd = tc_cmd(
        "router",
        "start",
        "--policy",
        "rebalance",
        "--tick",
        str(b.tick_s),
        "--wait-for-instances",
        "30",
        "--ready-file",
        str(ready),
        *b.cluster_args(),
        *b.router_args,
    )
    with started(cmd, b.logs / f"{tag}-router.log", b.env()) as proc:
        wait_for(lambda: ready.exists() or proc.poll() is not None, 60, "tc router")
        if proc.poll() is not None:
            raise RuntimeError(f"tc router exited: {_tail(b.logs / f'{tag}-router.log')}")
        addr = json.loads(ready.read_text())["addr"]
        wait_for(
            lambda: len(http_json(addr, "GET", "/router/state")[1]["instances"]) == b.instances,
            30,
            "the router to see every instance",
        )
        yield addr


@contextlib.contextmanager
def mooncake(b: Bench, tag: str) -> Iterator[str]:
    master_bin = _mooncake_master_binary()
    ip = b.server_ip
    rpc, http_port, metrics = free_port(), free_port(), free_port()
    cmd = [
        master_bin,
        f"--rpc_address={ip}",
        f"--rpc_port={rpc}",
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_host={ip}",
        f"--http_metadata_server_port={http_port}",
        f"--metrics_host={ip}",
        f"--metrics_port={metrics}",
        "--logtostderr",
    ]
    env = {**os.environ, "GLOG_minloglevel": "1"}
    with started(cmd, b.logs / f"{tag}-mooncake.log", env) as proc:
        wait_for(
            lambda: proc.poll() is not None or (_accepts(ip, rpc) and _accepts(ip, http_port)),
            30,
            "mooncake_master",
        )
        if proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited: {_tail(b.logs / f'{tag}-mooncake.log')}")
        yield (
            f"mooncake://{ip}:{rpc}?metadata=http://{ip}:{http_port}/metadata"
            f"&segment_bytes={256 << 20}"
        )


@contextlib.contextmanager
def redis_server(b: Bench, tag: str) -> Iterator[str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise Skip("redis-server missing: scripts/install-baselines.sh")
    port = free_port()
    cmd = [
        binary,
        "--bind",
        b.server_ip,
        "--port",
        str(port),
        "--save",
        "",
        "--appendonly",
        "no",
        "--maxmemory",
        "1gb",
        "--maxmemory-policy",
        "allkeys-lru",
    ]
    with started(cmd, b.logs / f"{tag}-redis.log"):
        wait_for(lambda: _accepts(b.server_ip, port), 20, "redis-server")
        yield f"redis://{b.server_ip}:{port}"


# -- the client ----------------------------------------------------------------------------------


@dataclass
class Sample:
    started: float
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int


def stream_generate(addr: str, body: dict, timeout_s: float) -> tuple[float, dict]:
    host, _, port = addr.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        sent = time.monotonic()
        conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
        first = 0.0
        last: dict = {}
        while True:
            line = response.readline()
            if not line:
                break
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            event = json.loads(payload)
            if "error" in event:
                raise RuntimeError(str(event["error"]))
            if not first:
                first = time.monotonic()
            last = event
        if not first:
            raise RuntimeError("no token streamed")
        return first - sent, last
    finally:
        conn.close()


def drive(
    addr: str, workload: Workload, sessions: int, duration_s: float, warmup_s: float
) -> tuple[list[Sample], int]:
    stop = threading.Event()
    lock = threading.Lock()
    samples: list[Sample] = []
    errors = [0]
    next_session = [0]
    t0 = time.monotonic()
    system = workload.system_ids()

    def runner() -> None:
        while not stop.is_set():
            with lock:
                k = next_session[0]
                next_session[0] += 1
            session = workload.session(k)
            context = list(system)
            for t in session.turns:
                if stop.wait(t.think_s):
                    return
                context += session.append_ids(t.index, workload.vocab)
                body = {
                    "input_ids": context,
                    "rid": f"{session.session_id}/{t.index}",
                    "sampling_params": {"max_new_tokens": t.output_tokens},
                    "session_params": {"id": session.session_id},
                    "stream": True,
                }
                started_at = time.monotonic()
                try:
                    ttft, last = stream_generate(addr, body, 300.0)
                except Exception:
                    with lock:
                        errors[0] += 1
                    break  # the session is lost to this client; start the next one
                meta = last.get("meta_info", {})
                context += list(last.get("output_ids", []))
                if started_at - t0 >= warmup_s and not stop.is_set():
                    with lock:
                        samples.append(
                            Sample(
                                started_at - t0,
                                ttft,
                                int(meta.get("prompt_tokens", len(body["input_ids"]))),
                                int(meta.get("cached_tokens", 0)),
                            )
                        )

    threads = [threading.Thread(target=runner, daemon=True) for _ in range(sessions)]
    for th in threads:
        th.start()
    stop.wait(duration_s)
    stop.set()
    for th in threads:
        th.join(320)
    return samples, errors[0]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def scaled_workload(preset: str, seed: int, compression: float, scale: float) -> Workload:
    import math

    from tensorcast.router.workload import LogNormal

    w = Workload(preset=preset, seed=seed, time_compression=compression)
    if scale == 1.0:
        return w

    def shrink(d: LogNormal) -> LogNormal:
        return LogNormal(d.mu + math.log(scale), d.sigma, max(1, d.low * scale), d.high * scale)

    return Workload(
        preset=preset,
        seed=seed,
        time_compression=compression,
        system_tokens=max(1, round(w.system_tokens * scale)),
        max_context_tokens=round(w.max_context_tokens * scale),
        task_tokens=shrink(w.task_tokens),
        observation_tokens=shrink(w.observation_tokens),
        output_tokens=shrink(w.output_tokens),
    )


def one_run(
    b: Bench, router: str, preset: str, sessions: int, seed: int, args: argparse.Namespace
) -> dict:
    compression = COMPRESSION[preset] * args.compression_factor
    tag = f"{preset}-{sessions}-{router}-r{seed}"
    workload = scaled_workload(preset, seed, compression, b.token_scale)
    with contextlib.ExitStack() as stack:
        share = "none"
        if router.endswith("+mooncake"):
            share = stack.enter_context(mooncake(b, tag))
        elif router.endswith("+tensorcast"):
            # Pages outlive a run in the cluster: each run its own keys, as each run of the
            # other stores gets a fresh server (the same seed repeats the same prompts).
            share = f"tensorcast?prefix={tag}/"
        elif router.endswith("+redis"):
            share = stack.enter_context(redis_server(b, tag))
        endpoints = stack.enter_context(sim_instances(b, compression, share, tag))
        if router.startswith("tc-rebalance"):
            addr = stack.enter_context(tc_router(b, tag))
        else:
            policy = "cache_aware" if router == "gw-cache" else "power_of_two"
            addr = stack.enter_context(gateway(b, policy, endpoints, tag))
        started_at = time.monotonic()
        samples, errors = drive(addr, workload, sessions, args.duration, args.warmup)
        wall = time.monotonic() - started_at
        infos = [http_json(e, "GET", "/server_info")[1] for e in endpoints]
        migrations, migrated = 0, 0
        if router.startswith("tc-rebalance"):
            state = http_json(addr, "GET", "/router/state")[1]
            migrations, migrated = state["migrations_ok"], state["migrated_bytes"]
    ttfts = [s.ttft_s * 1000 for s in samples]
    prompt = sum(s.prompt_tokens for s in samples)
    fetched = sum(i["counters"]["fetched_tokens"] for i in infos) * b.kv_bytes_per_token
    return {
        "router": router,
        "preset": preset,
        "sessions": sessions,
        "seed": seed,
        "compression": compression,
        "requests": len(samples),
        "errors": errors,
        "ttft_p50_ms": round(percentile(ttfts, 0.5), 2),
        "ttft_p90_ms": round(percentile(ttfts, 0.9), 2),
        "hit_rate": round(sum(s.cached_tokens for s in samples) / prompt, 4) if prompt else 0.0,
        "migrations": migrations,
        "migrated_bytes": migrated,
        "store_read_bytes": fetched,
        "store_written_bytes": sum(i.get("shared_store_put_bytes", 0) for i in infos),
        "wall_s": round(wall, 1),
    }


def summarize(runs: list[dict]) -> list[dict]:
    cells: dict[tuple, list[dict]] = {}
    for r in runs:
        cells.setdefault((r["preset"], r["sessions"], r["router"]), []).append(r)
    out = []
    for (preset, sessions, router), rs in sorted(cells.items()):
        out.append(
            {
                "preset": preset,
                "sessions": sessions,
                "router": router,
                "runs": len(rs),
                "ttft_p50_ms": round(statistics.median(r["ttft_p50_ms"] for r in rs), 2),
                "ttft_p90_ms": round(statistics.median(r["ttft_p90_ms"] for r in rs), 2),
                "hit_rate": round(statistics.median(r["hit_rate"] for r in rs), 4),
                "migrations": statistics.median(r["migrations"] for r in rs),
                "moved_mib": round(
                    statistics.median(
                        (r["migrated_bytes"] + r["store_read_bytes"]) / (1 << 20) for r in rs
                    ),
                    2,
                ),
                "requests": statistics.median(r["requests"] for r in rs),
                "errors": sum(r["errors"] for r in rs),
            }
        )
    return out


def plot(summary: list[dict], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = sorted({s["preset"] for s in summary}, key=list(COMPRESSION).index)
    routers = [r for r in ALL_ROUTERS if any(s["router"] == r for s in summary)]
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for metric, ylabel, name in (
        ("ttft_p50_ms", "TTFT p50 (ms, compressed time)", "router-ttft.png"),
        ("hit_rate", "cache hit rate", "router-hit-rate.png"),
    ):
        fig, axes = plt.subplots(1, len(presets), figsize=(4.5 * len(presets), 3.6), squeeze=False)
        for ax, preset in zip(axes[0], presets):
            for router in routers:
                pts = sorted(
                    (s["sessions"], s[metric])
                    for s in summary
                    if s["preset"] == preset and s["router"] == router
                )
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=router)
            ax.set_xscale("log", base=2)
            if metric == "ttft_p50_ms":
                ax.set_yscale("log")
            ax.set_title(f"agent {preset}")
            ax.set_xlabel("sessions")
            ax.set_ylabel(ylabel)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    return written


def print_table(summary: list[dict]) -> None:
    head = f"{'preset':7} {'sess':>4} {'router':23} {'p50 ms':>9} {'p90 ms':>9} {'hit':>6} "
    print(head + f"{'migr':>5} {'moved MiB':>9} {'reqs':>5} {'err':>4}")
    for s in summary:
        print(
            f"{s['preset']:7} {s['sessions']:4d} {s['router']:23} {s['ttft_p50_ms']:9.1f} "
            f"{s['ttft_p90_ms']:9.1f} {s['hit_rate']:6.3f} {s['migrations']:5} "
            f"{s['moved_mib']:9.2f} {s['requests']:5} {s['errors']:4}"
        )


def saved_runs(paths: list[Path]) -> list[dict]:
    """Runs saved by earlier invocations: per-run lines (stderr) or final records (stdout).
    A run found twice (a record and its own stderr line) counts once."""
    runs: dict[str, dict] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            if not line.startswith("{"):
                continue
            data = json.loads(line)
            for run in data.get("runs", [data]):
                if {"router", "preset", "sessions", "seed", "ttft_p50_ms"} <= run.keys():
                    runs[json.dumps(run, sort_keys=True)] = run
    return list(runs.values())


def replot(paths: list[Path], plots: Path | None) -> None:
    runs = saved_runs(paths)
    if not runs:
        sys.exit(f"no router runs in {', '.join(map(str, paths))}")
    summary = summarize(runs)
    record: dict[str, Any] = {"bench": "router", "replot": [str(p) for p in paths]}
    record["summary"] = summary
    if plots is not None:
        record["plots"] = plot(summary, plots)
    print(json.dumps(record, default=str))
    print_table(summary)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="heaviest load per preset, 1 run")
    parser.add_argument("--presets", default="fast,medium,slow")
    parser.add_argument("--sessions", default="8,16,32")
    parser.add_argument("--routers", default=",".join(ROUTERS))
    parser.add_argument("--runs", type=int, default=1, help="interleaved repetitions")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds per run")
    parser.add_argument("--warmup", type=float, default=10.0)
    parser.add_argument("--token-scale", type=float, default=0.1)
    parser.add_argument("--compression-factor", type=float, default=1.0)
    parser.add_argument("--kv-bytes-per-token", type=int, default=4096)
    parser.add_argument("--cache-tokens", type=int, default=12288)
    parser.add_argument("--tick", type=float, default=0.25, help="rebalance tick, seconds")
    parser.add_argument("--plots", type=Path, default=None, help="write PNG plots here")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--hosts", type=int, choices=(1, 2), default=1, help="2: two netns hosts")
    parser.add_argument("--rate", default="", help="--hosts 2: tbf rate of each host's egress")
    parser.add_argument(
        "--replot",
        nargs="+",
        type=Path,
        default=None,
        metavar="FILE",
        help="run nothing: summarize (and with --plots draw) the runs saved in FILEs (a run's "
        "stderr lines or its final JSON record), e.g. several sets of cold runs together",
    )
    parser.add_argument(
        "--router-arg",
        action="append",
        default=[],
        help="one more `tc router start` option for tc-rebalance (repeatable), e.g. "
        "--router-arg=--theta-abs=4",
    )
    args = parser.parse_args()
    if args.replot is not None:
        replot(args.replot, args.plots)
        return
    presets = args.presets.split(",")
    loads = [int(x) for x in args.sessions.split(",")]
    routers = args.routers.split(",")
    unknown = [r for r in routers if r not in ALL_ROUTERS]
    if unknown or any(p not in COMPRESSION for p in presets):
        parser.error(f"unknown router or preset: {unknown or presets}")
    if args.quick:
        loads = [max(loads)]
        args.duration, args.warmup = min(args.duration, 16.0), min(args.warmup, 5.0)

    from tensorcast.sdk import local_cluster

    tmp = Path(tempfile.mkdtemp(prefix="bench-router-"))
    logs = tmp / "logs"
    logs.mkdir()
    b = Bench(
        tmp / "state",
        logs,
        args.token_scale,
        args.kv_bytes_per_token,
        args.cache_tokens,
        4,
        args.tick,
        router_args=args.router_arg,
    )
    runs: list[dict] = []
    skipped: dict[str, str] = {}
    if args.hosts == 2:
        reason = netns.unavailable_reason()
        if reason:
            print(json.dumps({"bench": "router", "skipped": f"--hosts 2: {reason}"}))
            return
        tag = os.getpid() % 100_000
        network = netns.Network((f"rta{tag}", f"rtb{tag}"), f"rtbr{tag}", 100 + tag % 150)
        network.setup()
        b.state_dir.mkdir(parents=True)
        b.netns_cluster = netns.NetnsCluster(b.state_dir, "bench-router-token", network=network)
    try:
        if b.netns_cluster is not None:
            for ns in b.netns_cluster.network.hosts if args.rate else ():
                b.netns_cluster.network.limit_rate(ns, args.rate)
            b.netns_cluster.start("1GiB")  # the store on the bridge, a worker on each host
        else:
            local_cluster.up(b.state_dir, 2, "1GiB")
        for rep in range(args.runs):
            seed = args.seed + rep
            for preset in presets:
                for sessions in loads:
                    order = routers[rep % len(routers) :] + routers[: rep % len(routers)]
                    for router in order:
                        if router in skipped:
                            continue
                        try:
                            result = one_run(b, router, preset, sessions, seed, args)
                        except Skip as e:
                            skipped[router] = str(e)
                            continue
                        runs.append(result)
                        print(json.dumps(result), file=sys.stderr, flush=True)
    finally:
        if b.netns_cluster is not None:
            b.netns_cluster.stop()
            b.netns_cluster.network.teardown()
        else:
            local_cluster.down(b.state_dir)
    summary = summarize(runs)
    heaviest = {
        p: {
            s["router"]: s["ttft_p50_ms"]
            for s in summary
            if s["preset"] == p and s["sessions"] == max(loads)
        }
        for p in presets
    }
    record = {
        "bench": "router",
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "quick": args.quick,
        "heaviest_sessions": max(loads),
        "heaviest_ttft_p50_ms": heaviest,
        "config": {k: v for k, v in vars(args).items() if k not in ("plots",)}
        | {"compression": COMPRESSION, "instances": 4, "workers": 2, "hosts": args.hosts},
        "skipped": skipped,
        "summary": summary,
        "runs": runs,
    }
    if args.plots is not None and summary:
        record["plots"] = plot(summary, args.plots)
    print(json.dumps(record, default=str))
    print_table(summary)
    for router, why in skipped.items():
        print(f"skipped {router}: {why}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
