#!/usr/bin/env python3
"""KV pages: TensorCast's sharded page store against Redis and Mooncake Store, side by side.

Batch put / get / exists of 64 KiB, 256 KiB and 2 MiB pages in batches of 1, 16 and 256, every
system driven by the same `measure` (scripts/bench/kv_baselines.py: distinct keys, warm-up, every
returned page compared byte for byte). TensorCast runs as a cluster of a Global Store and two
shard-home workers, in these modes:

  tensorcast-shm   the caller is on the homes' host: one Unix-socket round trip per home and
                   batch, bytes copied in place through the shared pool mapping, hashes checked
  tensorcast-shm-into  the same, but gets land in buffers the caller allocated once and reuses
                   (`get_pages(keys, into=...)`, what an engine with a KV block pool does)
  tensorcast-remote  the caller is on another host (`--path loopback`: pretends to be): pages go
                   to the homes' data ports in native page frames, every home in parallel
  tensorcast-remote-into  the same, received straight into the caller's reused buffers

Two paths (`--path`):

  loopback    everything on 127.0.0.1 (`tc up` style processes), all modes (~3 min)
  cross-host  two network namespaces joined by a bridge (tests/netns.py; needs root): the
              caller (this script, re-run inside the caller's namespace) in one, the Global
              Store, both homes, redis-server, mooncake_master and Mooncake's storage process
              in the other; the baselines' clients in the caller's namespace. Remote modes only
              (the caller's host has no worker).

All systems run at once and the cells interleave them: each (page size, batch) cell is measured
by every system before the next cell starts, in an order rotated per cell, so a noisy stretch of
the host lands on all of them. The TensorCast modes share one cluster (3 GiB pools; pages live
60 s, so they never fill them). It also counts the requests the Global Store served while the grid
ran (its /metrics), other than the workers' own heartbeats and lease bids, per 100k page
operations of all modes together.

Goals: GS requests independent of the number of pages (<= the number of shards); >= 2x Redis and
>= 1.5x Mooncake Store throughput at >= 256 KiB (issue 5: same host; issue 15: cross-host);
p99 of a 64 KiB get <= 2 ms (same host) / <= 1 ms (cross-host).

    python scripts/bench/kv.py                                # loopback, everything
    python scripts/bench/kv.py --path cross-host              # caller and servers apart
    python scripts/bench/kv.py --sizes 65536 --batches 1,16 --systems tensorcast-shm,redis
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import kv_baselines as kb

from tensorcast.metrics import rpc_counts

SYSTEMS = (
    "tensorcast-shm",
    "tensorcast-shm-into",
    "tensorcast-remote",
    "tensorcast-remote-into",
    "redis",
    "mooncake-store",
)
REMOTE_SYSTEMS = ("tensorcast-remote", "tensorcast-remote-into", "redis", "mooncake-store")
TC_MODES = ("tensorcast-shm", "tensorcast-shm-into", "tensorcast-remote", "tensorcast-remote-into")
WORKER_MEM = "3GiB"
# Pages outlive their cell (put, get, exists: seconds) but not the run, so the three modes'
# pages never fill the pools (no eviction inside a measurement) and the host keeps its memory.
PAGE_TTL_S = 60.0
SKIPPED_METHODS = {"Heartbeat", "AcquireShards"}  # the workers' own traffic


class TensorCastCluster:
    """One cluster (a Global Store and two shard-home workers) shared by every TensorCast mode of
    the run, and the Global Store request counter read from its /metrics. On this host's
    loopback (`tc up` style), or, given `server`, in the server's network namespace."""

    def __init__(self, state_dir: Path, server: CrossHost | None = None) -> None:
        os.environ.setdefault("TC_HEARTBEAT_INTERVAL_S", "0.5")
        import tensorcast as tc
        from tensorcast.sdk import local_cluster

        self.state_dir = state_dir
        self.server = server
        self._netns: Any = None
        if server is None:
            self._down = local_cluster.down
            record = local_cluster.up(state_dir, 2, WORKER_MEM).record
            self.addr = record.store_addr
            self.token = (state_dir / "token").read_text().strip()
            self.store_metrics = next(p for p in record.processes if p.role == "store").metrics_addr
        else:
            self._start_in(server)
        try:
            with tc.connect(self.addr, self.token) as rt:
                deadline = time.monotonic() + 30
                while not self._settled(rt):
                    if time.monotonic() > deadline:
                        raise kb.Skip("the shard leases did not settle on their homes in 30 s")
                    time.sleep(0.1)
                self.num_shards = rt.shards().num_shards
        except BaseException:
            self.close()
            raise
        self.store_before: dict[str, float] = {}

    def _start_in(self, server: CrossHost) -> None:
        """A store and two workers in the server's namespace (tests/netns.py's launcher)."""
        import netns

        state = self.state_dir
        state.mkdir(parents=True, exist_ok=True)
        self.token = "kv-bench-token"
        self._netns = netns.NetnsCluster(state, self.token)
        try:
            store = self._netns._spawn(
                "store",
                [
                    "store",
                    "start",
                    "--db",
                    str(state / "store.db"),
                    "--listen",
                    f"{server.server_ip}:0",
                    "--metrics-listen",
                    f"{server.server_ip}:0",
                ],
                server.server_ns,
            )
            self.addr, self.store_metrics = store["addr"], store["metrics_addr"]
            for i in (1, 2):
                self._netns._spawn(
                    f"home-{i}",
                    [
                        "worker",
                        "start",
                        "--store",
                        self.addr,
                        "--listen",
                        f"{server.server_ip}:0",
                        "--mem",
                        WORKER_MEM,
                        "--name",
                        f"home-{i}",
                    ],
                    server.server_ns,
                    timeout_s=60,
                )
        except BaseException:
            self._netns.stop()
            raise

    def start_counting(self) -> None:
        """Count Global Store requests from now on (after the callers connected)."""
        self.store_before = self.store_calls()

    @staticmethod
    def _settled(rt: Any) -> bool:
        """Every shard held by the home hashing ranks first: the hand-offs after start-up (the
        first worker takes every shard) are over, so none happens inside the measurement."""
        from tensorcast.sharding import settled

        table = rt.shards()
        return len(table.live_homes) == 2 and settled(table)

    def store_calls(self) -> dict[str, float]:
        url = f"http://{self.store_metrics}/metrics"
        return rpc_counts(urllib.request.urlopen(url, timeout=5).read().decode())

    def gs_requests(self) -> dict[str, int]:
        after = self.store_calls()
        return {
            m: int(after[m] - self.store_before.get(m, 0))
            for m in after
            if m not in SKIPPED_METHODS and after[m] != self.store_before.get(m, 0)
        }

    def close(self) -> None:
        if self._netns is not None:
            self._netns.stop()
        else:
            self._down(self.state_dir)


class TensorCastPages:
    def __init__(self, cluster: TensorCastCluster, mode: str) -> None:
        import tensorcast as tc

        self.name = f"tensorcast-{mode}"
        self.into = mode.endswith("-into")
        self._buffers: dict[tuple[int, int], list[bytearray]] = {}
        self._sizes: dict[str, int] = {}
        self.rt = tc.connect(cluster.addr, cluster.token)
        if mode.startswith("remote") and cluster.server is None:
            self.rt.host_id = "another-host"  # every home is remote: their data ports
        if mode.startswith("shm") and any(w.host_id != self.rt.host_id for w in self.rt.workers()):
            self.rt.close()
            raise kb.Skip("no worker on the caller's host (cross-host path)")
        self.pages = self.rt.pages()
        self._connect_every_home(cluster.num_shards)
        self.page_ops = 0
        self.info = {
            "workers": 2,
            "mem": WORKER_MEM,
            "shards": cluster.num_shards,
            "homes": "this host" if mode.startswith("shm") else "another host",
        }

    def _connect_every_home(self, shards: int) -> None:
        """One small page per shard, untimed: connects to every home (mapping its pool, which
        takes a few hundred ms for 3 GiB) before any cell, whatever keys its warm-up drew."""
        from tensorcast.sharding import shard_of

        first: dict[int, str] = {}
        for i in range(100 * shards):
            first.setdefault(shard_of(f"kvb:connect:{i}", shards), f"kvb:connect:{i}")
        self.pages.put_pages({key: b"\0" * 64 for key in first.values()}, ttl_s=60)

    def put_batch(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        self.page_ops += len(keys)
        if self.into:  # the size of the engine's blocks, known to it in advance
            self._sizes.update((k, len(v)) for k, v in zip(keys, values))
        self.pages.put_pages(dict(zip(keys, values)), ttl_s=PAGE_TTL_S)

    def prepare(self, page_bytes: int, batch: int) -> None:
        """The engine's KV blocks for `get_pages(into=...)`: allocated and touched once per
        cell, before any timed call (an engine allocates its block pool once)."""
        if self.into:
            self._buffers = {
                (batch, page_bytes): [bytearray(b"\1" * page_bytes) for _ in range(batch)]
            }

    def get_batch(self, keys: Sequence[str]) -> list[Any]:
        self.page_ops += len(keys)
        into = None
        if self.into:
            size = self._sizes[keys[0]]
            into = self._buffers.get((len(keys), size))
            if into is None:  # a warm-up batch smaller than the cell's (prepare made those)
                into = [bytearray(b"\1" * size) for _ in keys]
                self._buffers[(len(keys), size)] = into
        got = self.pages.get_pages(keys, into=into)
        missing = [k for k, p in zip(keys, got) if p is None]
        if missing:
            raise KeyError(missing[0])
        return [p.data for p in got]  # type: ignore[union-attr]

    def exists_batch(self, keys: Sequence[str]) -> list[bool]:
        self.page_ops += len(keys)
        return self.pages.exists_pages(keys)

    def close(self) -> None:
        self.rt.close()


def _ratios(report: dict[str, Any]) -> list[dict[str, Any]]:
    """TensorCast throughput / each baseline's, per cell and op (>1: TensorCast is faster)."""

    def cells(name: str) -> dict[tuple[int, int], dict]:
        res = report["systems"].get(name, {})
        return {(c["page_bytes"], c["batch"]): c for c in res.get("cells", []) if "error" not in c}

    rows = []
    for tc_name in TC_MODES:
        ours = cells(tc_name)
        for base in ("redis", "mooncake-store"):
            theirs = cells(base)
            for key in sorted(set(ours) & set(theirs)):
                row = {
                    "tensorcast": tc_name,
                    "baseline": base,
                    "page_bytes": key[0],
                    "batch": key[1],
                }
                for op in ("put", "get"):
                    row[op] = round(ours[key][op]["gbps"] / theirs[key][op]["gbps"], 2)
                rows.append(row)
    return rows


@dataclass(frozen=True)
class CrossHost:
    """The cross-host path's two namespaces: this script runs in the caller's, every server in
    the server's."""

    caller_ns: str
    caller_ip: str
    server_ns: str
    server_ip: str

    def where(self) -> kb.Remote:
        return kb.Remote(("ip", "netns", "exec", self.server_ns), self.server_ip, self.caller_ip)


def cross_host(argv: Sequence[str]) -> int:
    """Set up the two namespaces, run this script again inside the caller's, tear them down."""
    import netns

    reason = netns.unavailable_reason()
    if reason:
        print(json.dumps({"bench": "kv", "path": "cross-host", "skipped": reason}))
        return 0
    tag = os.getpid() % 100_000
    network = netns.Network((f"kvc{tag}", f"kvs{tag}"), f"kvbr{tag}", 100 + tag % 150)
    caller, server = network.hosts
    spec = CrossHost(caller, network.hosts[caller], server, network.hosts[server])
    network.setup()
    try:
        child = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                caller,
                sys.executable,
                os.path.abspath(__file__),
                *argv,
                "--in-caller",
                json.dumps(spec.__dict__),
            ],
            env={k: v for k, v in os.environ.items() if k not in ("TC_ADDR", "TC_STATE_DIR")},
        )
        return child.returncode
    finally:
        network.teardown()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--path", choices=("loopback", "cross-host"), default="loopback")
    ap.add_argument("--sizes", type=kb._int_list, default=list(kb.PAGE_SIZES))
    ap.add_argument("--batches", type=kb._int_list, default=list(kb.BATCHES))
    ap.add_argument(
        "--systems", default="", help=", ".join(SYSTEMS) + " (default: all the path runs)"
    )
    ap.add_argument("--total-mib", type=int, default=kb.TOTAL_BYTES_TARGET // kb.MIB)
    ap.add_argument("--max-ops", type=int, default=kb.MAX_OPS)
    ap.add_argument("--in-caller", help=argparse.SUPPRESS)
    raw = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(raw)
    if args.path == "cross-host" and not args.in_caller:
        return cross_host(raw)
    server = CrossHost(**json.loads(args.in_caller)) if args.in_caller else None
    default = REMOTE_SYSTEMS if server else SYSTEMS
    systems = [s.strip() for s in (args.systems or ",".join(default)).split(",") if s.strip()]
    if set(systems) - set(SYSTEMS):
        ap.error(f"--systems: unknown {sorted(set(systems) - set(SYSTEMS))}")
    total = args.total_mib * kb.MIB
    started = time.monotonic()
    report: dict[str, Any] = {
        "bench": "kv",
        "path": args.path,
        "meta": kb.meta_info(),
        "sizes": args.sizes,
        "batches": args.batches,
        "systems": {},
    }
    if server:
        report["network"] = server.__dict__
    tmp = Path(tempfile.mkdtemp(prefix="tc-kv-bench-"))
    cluster: TensorCastCluster | None = None
    running: dict[str, Any] = {}
    try:
        for name in systems:  # everything up first: the cells interleave the systems
            try:
                if name.startswith("tensorcast"):
                    if cluster is None:
                        cluster = TensorCastCluster(tmp / "state", server)
                    running[name] = TensorCastPages(cluster, name.removeprefix("tensorcast-"))
                else:
                    running[name] = kb.make_baseline(
                        name,
                        args.sizes,
                        args.batches,
                        total,
                        args.max_ops,
                        server.where() if server else kb.LOCAL,
                    )
            except kb.Skip as e:
                report["systems"][name] = {"skipped": e.reason}
        if cluster is not None:
            cluster.start_counting()
        cells = kb.run_interleaved(running, args.sizes, args.batches, total, args.max_ops)
        for name, system in running.items():
            report["systems"][name] = {"info": dict(system.info), "cells": cells[name]}
        if cluster is not None:
            ops = sum(s.page_ops for s in running.values() if isinstance(s, TensorCastPages))
            gs = cluster.gs_requests()
            report["tensorcast_gs"] = {
                "gs_requests": gs,
                "page_ops": ops,
                "gs_requests_per_100k_page_ops": round(sum(gs.values()) * 1e5 / max(1, ops), 3),
            }
    finally:
        for system in running.values():
            system.close()
        if cluster is not None:
            cluster.close()
        shutil.rmtree(tmp, ignore_errors=True)
    report["ratios"] = _ratios(report)
    report["meta"]["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
    from tensorcast.transport.shm import shmem_huge_pages

    # The pool asks for huge pages; the host decides (docs/operators.md).
    report["meta"]["shmem_huge_pages"] = shmem_huge_pages()
    report["total_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(report))
    print(kb.human(report))
    print("\nthroughput ratios, TensorCast / baseline (>1: TensorCast faster)")
    print(f"{'tensorcast':<23} {'baseline':<15} {'page':>7} {'batch':>5} {'put':>6} {'get':>6}")
    for r in report["ratios"]:
        print(
            f"{r['tensorcast']:<23} {r['baseline']:<15} {kb.fmt_size(r['page_bytes']):>7} "
            f"{r['batch']:>5} {r['put']:>6} {r['get']:>6}"
        )
    gs = report.get("tensorcast_gs")
    if gs:
        print(
            f"TensorCast (all modes): Global Store requests {gs['gs_requests']} for "
            f"{gs['page_ops']} page operations ({gs['gs_requests_per_100k_page_ops']} per 100k)"
        )
    print(f"\n(total {report['total_s']}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
