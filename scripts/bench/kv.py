#!/usr/bin/env python3
"""KV pages: TensorCast's sharded page store against Redis and Mooncake Store, side by side.

Batch put / get / exists of 64 KiB, 256 KiB and 2 MiB pages in batches of 1, 16 and 256, every
system driven by the same `measure` (scripts/bench/kv_baselines.py: distinct keys, warm-up, every
returned page compared byte for byte). TensorCast runs as a local cluster (a Global Store and two
shard-home workers, `tc up` style processes) in two modes:

  tensorcast-shm   the caller is on the homes' host: one Unix-socket round trip per home and
                   batch, bytes copied in place through the shared pool mapping, hashes checked
  tensorcast-shm-into  the same, but gets land in buffers the caller allocated once and reuses
                   (`get_pages(keys, into=...)`, what an engine with a KV block pool does)
  tensorcast-grpc  the caller pretends to be on another host: pages travel through gRPC (the
                   path a remote engine without a worker uses), on loopback like the baselines

All systems run at once and the cells interleave them: each (page size, batch) cell is measured
by every system before the next cell starts, in an order rotated per cell, so a noisy stretch of
the host lands on all of them. The three TensorCast modes share one cluster (3 GiB pools;
pages live 60 s, so they never fill them). It also counts the requests the Global Store served
while the grid ran (its /metrics), other than the workers' own heartbeats and lease bids, per
100k page operations of all modes together.

Goals (issue 5): GS requests independent of the number of pages (<= the number of shards);
>= 2x Redis and >= 1.5x Mooncake Store throughput at >= 256 KiB; p99 of a 64 KiB get <= 2 ms.

    python scripts/bench/kv.py                                # everything (~3 min)
    python scripts/bench/kv.py --sizes 65536 --batches 1,16 --systems tensorcast-shm,redis
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_baselines as kb

from tensorcast.metrics import rpc_counts

SYSTEMS = ("tensorcast-shm", "tensorcast-shm-into", "tensorcast-grpc", "redis", "mooncake-store")
WORKER_MEM = "3GiB"
# Pages outlive their cell (put, get, exists: seconds) but not the run, so the three modes'
# pages never fill the pools (no eviction inside a measurement) and the host keeps its memory.
PAGE_TTL_S = 60.0
SKIPPED_METHODS = {"Heartbeat", "AcquireShards"}  # the workers' own traffic


class TensorCastCluster:
    """One local cluster (a Global Store and two shard-home workers) shared by every TensorCast
    mode of the run, and the Global Store request counter read from its /metrics."""

    def __init__(self, state_dir: Path) -> None:
        os.environ.setdefault("TC_HEARTBEAT_INTERVAL_S", "0.5")
        import tensorcast as tc
        from tensorcast.sdk import local_cluster

        self.state_dir = state_dir
        self._down = local_cluster.down
        self.record = local_cluster.up(state_dir, 2, WORKER_MEM).record
        try:
            with tc.connect(state_dir=state_dir) as rt:
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
        addr = next(p for p in self.record.processes if p.role == "store").metrics_addr
        text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=5).read().decode()
        return rpc_counts(text)

    def gs_requests(self) -> dict[str, int]:
        after = self.store_calls()
        return {
            m: int(after[m] - self.store_before.get(m, 0))
            for m in after
            if m not in SKIPPED_METHODS and after[m] != self.store_before.get(m, 0)
        }

    def close(self) -> None:
        self._down(self.state_dir)


class TensorCastPages:
    def __init__(self, cluster: TensorCastCluster, mode: str) -> None:
        import tensorcast as tc

        self.name = f"tensorcast-{mode}"
        self.into = mode == "shm-into"
        self._buffers: dict[tuple[int, int], list[bytearray]] = {}
        self._sizes: dict[str, int] = {}
        self.rt = tc.connect(state_dir=cluster.state_dir)
        if mode == "grpc":
            self.rt.host_id = "another-host"  # every page operation goes through gRPC
        self.pages = self.rt.pages()
        self._connect_every_home(cluster.num_shards)
        self.page_ops = 0
        self.info = {"workers": 2, "mem": WORKER_MEM, "shards": cluster.num_shards}

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
    for tc_name in ("tensorcast-shm", "tensorcast-shm-into", "tensorcast-grpc"):
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


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", type=kb._int_list, default=list(kb.PAGE_SIZES))
    ap.add_argument("--batches", type=kb._int_list, default=list(kb.BATCHES))
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=", ".join(SYSTEMS))
    ap.add_argument("--total-mib", type=int, default=kb.TOTAL_BYTES_TARGET // kb.MIB)
    ap.add_argument("--max-ops", type=int, default=kb.MAX_OPS)
    args = ap.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if set(systems) - set(SYSTEMS):
        ap.error(f"--systems: unknown {sorted(set(systems) - set(SYSTEMS))}")
    total = args.total_mib * kb.MIB
    started = time.monotonic()
    report: dict[str, Any] = {
        "bench": "kv",
        "meta": kb.meta_info(),
        "sizes": args.sizes,
        "batches": args.batches,
        "systems": {},
    }
    tmp = Path(tempfile.mkdtemp(prefix="tc-kv-bench-"))
    cluster: TensorCastCluster | None = None
    running: dict[str, Any] = {}
    try:
        for name in systems:  # everything up first: the cells interleave the systems
            try:
                if name.startswith("tensorcast"):
                    if cluster is None:
                        cluster = TensorCastCluster(tmp / "state")
                    running[name] = TensorCastPages(cluster, name.removeprefix("tensorcast-"))
                else:
                    running[name] = kb.make_baseline(
                        name, args.sizes, args.batches, total, args.max_ops
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
    print(f"{'tensorcast':<16} {'baseline':<15} {'page':>7} {'batch':>5} {'put':>6} {'get':>6}")
    for r in report["ratios"]:
        print(
            f"{r['tensorcast']:<16} {r['baseline']:<15} {kb.fmt_size(r['page_bytes']):>7} "
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
