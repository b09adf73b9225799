"""Global Store operations per second and latency: sqlite against etcd (1 and 3 members), side by
side in one run, and how many Global Store requests KV page operations cause on an etcd cluster.

For each backend a real `tc store start` process (gRPC on 127.0.0.1) serves a client that runs,
one after the other: add replica (a new content each time), create artifact (naming such a
content), lease renewal (RenewLease of a leased artifact); each op type `--ops` times in a row
from one caller (latency: p50, p99, ops/s), then create artifact from `--threads` callers at
once (throughput). Backends are interleaved round-robin over `--runs` runs, and each run's
order rotates, so a slow stretch of the machine hits all of them. etcd members are local
processes (Debian's etcd-server), each with its own data dir on this disk.

The page path: `tc up --ha` (3 etcd members, 2 stores, 2 workers), then `--page-ops` same-host
page puts and gets through the SDK; the Global Store requests they caused (every RPC both
stores served, minus the workers' own heartbeats and lease bids) must stay <= the shard count.

    python scripts/bench/store.py                 # 5 runs, 300 ops per type
    python scripts/bench/store.py --runs 1 --ops 50 --page-ops 2000   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from tensorcast.metrics import rpc_counts
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.sdk import local_etcd
from tensorcast.sdk.runtime import Runtime

TOKEN = "bench-token"
BACKENDS = ("sqlite", "etcd-1", "etcd-3")
SKIPPED = {"Heartbeat", "AcquireShards", "RegisterWorker", "Status", "ListShards", "HandOffShard"}


class Backend:
    """A store process on the named backend (and its etcd members), in `root`."""

    def __init__(self, name: str, root: Path) -> None:
        self.name = name
        self.procs: list[subprocess.Popen] = []
        root.mkdir(parents=True, exist_ok=True)
        args = ["--db", str(root / "store.db")]
        if name.startswith("etcd"):
            members = local_etcd.plan_members(int(name[5:]), "127.0.0.1", root / "etcd")
            token = local_etcd.cluster_token()
            log = root / "etcd.log"
            etcd = [local_etcd.spawn(m, members, token, log, root) for m in members]
            self.procs += etcd
            local_etcd.wait_healthy(members, etcd, log)
            endpoints = ",".join(m.client_addr for m in members)
            args = ["--backend", "etcd", "--etcd-endpoints", endpoints]
        ready = root / "store.json"
        store = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tensorcast.cli.main",
                "store",
                "start",
                *args,
                "--listen",
                "127.0.0.1:0",
                "--ready-file",
                str(ready),
                "--state-dir",
                str(root),
            ],
            env={**os.environ, "TC_TOKEN": TOKEN},
            stdout=subprocess.DEVNULL,
            stderr=open(root / "store.log", "w"),  # noqa: SIM115
        )
        self.procs.append(store)
        deadline = time.monotonic() + 60
        while not ready.exists():
            if store.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((root / "store.log").read_text()[-2000:])
            time.sleep(0.05)
        self.addr = json.loads(ready.read_text())["addr"]

    def close(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def _tensors(tag: str) -> list[pb.TensorMeta]:
    return [
        pb.TensorMeta(
            name="w",
            dtype="F32",
            shape=[16],
            size_bytes=64,
            offset_bytes=0,
            hash=f"{abs(hash(tag)):032x}"[:32],
        )
    ]


def _latencies(fn, count: int) -> list[float]:
    out = []
    for i in range(count):
        start = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - start)
    return out


def _summary(lat: list[float]) -> dict:
    lat = sorted(lat)
    return {
        "ops_per_s": round(len(lat) / sum(lat), 1),
        "p50_ms": round(1000 * lat[len(lat) // 2], 3),
        "p99_ms": round(1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))], 3),
    }


def measure(backend: Backend, run: int, ops: int, threads: int) -> dict:
    rt = Runtime(backend.addr, TOKEN, 30.0)
    wid = f"bench-w{run}"
    rt.store.call(
        "RegisterWorker",
        pb.RegisterWorkerRequest(
            worker=pb.Worker(
                worker_id=wid,
                name=wid,
                addr="127.0.0.1:1",
                host_id="h",
                local_socket="s",
                roles=["basic"],
                mem_cap_bytes=1 << 30,
                pid=1,
            )
        ),
    )
    tag = f"r{run}-{backend.name}"

    def add(i: int) -> None:
        rt.store.call(
            "AddReplica",
            pb.AddReplicaRequest(
                worker_id=wid,
                content_id=f"c-{tag}-{i}",
                size_bytes=64,
                tensors=_tensors(f"{tag}{i}"),
            ),
        )

    def create(i: int) -> None:
        rt.store.call(
            "CreateArtifact",
            pb.CreateArtifactRequest(
                art_id=f"a-{tag}-{i}", content_id=f"c-{tag}-{i}", owner="system"
            ),
        )

    def renew(i: int) -> None:
        rt.store.call("RenewLease", pb.RenewLeaseRequest(art_id=f"lease-{tag}", ttl_s=600))

    result = {
        "add_replica": _summary(_latencies(add, ops)),
        "create_artifact": _summary(_latencies(create, ops)),
    }
    rt.store.call(
        "CreateArtifact",
        pb.CreateArtifactRequest(
            art_id=f"lease-{tag}", content_id=f"c-{tag}-0", owner="lease", ttl_s=600
        ),
    )
    result["lease_renewal"] = _summary(_latencies(renew, ops))
    # Throughput: `threads` callers creating artifacts at once (contents added beforehand).
    for i in range(ops, ops * (1 + threads)):
        add(i)
    done = []

    def caller(k: int) -> None:
        own = Runtime(backend.addr, TOKEN, 30.0)
        for i in range(ops + k * ops, ops + (k + 1) * ops):
            own.store.call(
                "CreateArtifact",
                pb.CreateArtifactRequest(
                    art_id=f"a-{tag}-{i}", content_id=f"c-{tag}-{i}", owner="system"
                ),
            )
        done.append(ops)
        own.close()

    start = time.perf_counter()
    workers = [threading.Thread(target=caller, args=(k,)) for k in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    result[f"create_artifact_{threads}_callers_ops_per_s"] = round(
        sum(done) / (time.perf_counter() - start), 1
    )
    rt.close()
    return result


def page_path(root: Path, page_ops: int) -> dict:
    """Store requests caused by page operations on an --ha cluster."""
    import torch

    import tensorcast as tc
    from tensorcast.sdk import local_cluster

    state = root / "ha"
    up = local_cluster.up(state, 2, "256MiB", ha=True)
    try:
        stores = [p for p in up.record.processes if p.role == "store"]

        def calls() -> dict[str, float]:
            total: dict[str, float] = {}
            for s in stores:
                text = urllib.request.urlopen(f"http://{s.metrics_addr}/metrics", timeout=5).read()
                for m, v in rpc_counts(text.decode()).items():
                    total[m] = total.get(m, 0) + v
            return total

        with tc.connect(state_dir=state) as rt:
            pages = rt.pages()
            num_shards = pages.table(refresh=True).num_shards
            data = {f"bench/{i}": torch.full((1024,), float(i)) for i in range(64)}
            pages.put_pages(data, ttl_s=600)  # connections, lease table: before counting
            before = calls()
            start = time.perf_counter()
            done = 0
            keys = list(data)
            while done < page_ops:
                if done % 2:
                    pages.get_pages(keys[:16])
                else:
                    pages.put_pages({k: data[k] for k in keys[:16]}, ttl_s=600)
                done += 16
            elapsed = time.perf_counter() - start
            after = calls()
        requests = {
            m: int(after[m] - before.get(m, 0))
            for m in after
            if m not in SKIPPED and after[m] != before.get(m, 0)
        }
        return {
            "page_ops": done,
            "seconds": round(elapsed, 2),
            "gs_requests": sum(requests.values()),
            "gs_requests_by_method": requests,
            "num_shards": num_shards,
            "gs_requests_per_100k_page_ops": round(sum(requests.values()) * 100_000 / done, 2),
        }
    finally:
        local_cluster.down(state)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--ops", type=int, default=300)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--page-ops", type=int, default=100_000)
    ap.add_argument("--backends", default=",".join(BACKENDS))
    args = ap.parse_args()
    names = args.backends.split(",")
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="tc-bench-store-") as tmp:
        root = Path(tmp)
        for run in range(args.runs):
            order = names[run % len(names) :] + names[: run % len(names)]
            figures = {}
            for name in order:
                backend = Backend(name, root / f"r{run}-{name}")
                try:
                    figures[name] = measure(backend, run, args.ops, args.threads)
                finally:
                    backend.close()
            runs.append(figures)
            print(f"run {run + 1}/{args.runs} done ({', '.join(order)})", file=sys.stderr)
        pages = page_path(root, args.page_ops) if args.page_ops else None
    ops = ("add_replica", "create_artifact", "lease_renewal")
    medians = {
        name: {
            op: {
                k: statistics.median(r[name][op][k] for r in runs)
                for k in ("ops_per_s", "p50_ms", "p99_ms")
            }
            for op in ops
        }
        | {
            "create_artifact_callers_ops_per_s": statistics.median(
                r[name][f"create_artifact_{args.threads}_callers_ops_per_s"] for r in runs
            )
        }
        for name in names
    }
    print(
        json.dumps(
            {
                "bench": "store",
                "runs": runs,
                "median": medians,
                "page_path": pages,
                "meta": {"ops": args.ops, "threads": args.threads, "cpus": os.cpu_count()},
            }
        )
    )
    print(
        f"\nGlobal Store, median of {args.runs} interleaved runs "
        f"({args.ops} ops per type, one caller)"
    )
    print(
        f"{'backend':<9} {'op':<16} {'ops/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'x sqlite ops/s':>15}"
    )
    for name in names:
        for op in ops:
            m = medians[name][op]
            base = medians.get("sqlite", {}).get(op, {}).get("ops_per_s")
            ratio = f"{m['ops_per_s'] / base:.2f}" if base else "-"
            print(
                f"{name:<9} {op:<16} {m['ops_per_s']:>8.0f} {m['p50_ms']:>8.2f} "
                f"{m['p99_ms']:>8.2f} {ratio:>15}"
            )
        print(
            f"{name:<9} {'create, ' + str(args.threads) + ' callers':<16} "
            f"{medians[name]['create_artifact_callers_ops_per_s']:>8.0f}"
        )
    if pages:
        print(
            f"\npage path on etcd (--ha): {pages['gs_requests']} Global Store requests for "
            f"{pages['page_ops']} page ops = {pages['gs_requests_per_100k_page_ops']} per 100k "
            f"(shards: {pages['num_shards']}; goal <= shards)"
        )


if __name__ == "__main__":
    main()
