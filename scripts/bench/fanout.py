#!/usr/bin/env python3
"""Fan-out of one artifact to three hosts: pipelined chain against star, against one transfer.

Four hosts = four network namespaces on a bridge (tests/netns.py; needs root), a worker on
each, the Global Store on the bridge. What leaves each host is shaped with `tc qdisc ... tbf`
(`--rate`, default 2gbit), so the links and not this machine's two cores are the limit, as
between real hosts. Per run, each on fresh content (put on the source worker just before):

  one    prefetch to one destination                    (the reference: one transfer)
  star   prefetch to three destinations at once, each pulling from the source
         (what three concurrent `tc prefetch` calls did before chains: the source's link
         carries the bytes three times)
  chain  `prefetch_chain` to the same three: each relays to the next while it receives
         (`tc prefetch ART --to b --to c --to d`)

Figures: wall time of each mode as the caller sees it, and chain / one and star / one. Modes
are interleaved and their order rotates each run; the median of --runs (>= 5), every run listed.
Goal (issue 15): chain <= 1.3x one.

    python scripts/bench/fanout.py                       # 5 runs of 256 MiB at 2 Gbit/s
    python scripts/bench/fanout.py --rate 4gbit --mib 512
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import netns

MIB = 1 << 20
TOKEN = "bench-fanout-token"
MODES = ("one", "star", "chain")


def run_mode(
    rt: Any, mode: str, source: str, dests: list[str], mib: int, tag: str
) -> tuple[float, list[float]]:
    """Seconds for `mode` on a fresh artifact put on `source` (deleted after), and each
    destination's own time (its reply's elapsed_s: from its request to its verified commit)."""
    import torch

    art_id = f"fanout/{tag}-{mode}"
    # Distinct bytes per artifact: nothing is deduplicated against an earlier run.
    data = torch.randint(0, 1 << 30, (mib * MIB // 4,), dtype=torch.int32)
    data[0] = hash(art_id) & 0x3FFFFFFF
    art = rt.put({"w": data}, art_id, worker=source)
    try:
        started = time.perf_counter()
        if mode == "one":
            replies = [art.prefetch(dests[0], timeout_s=300)]
        elif mode == "chain":
            replies = art.prefetch_chain(dests, timeout_s=300)
        else:
            replies = [None] * len(dests)

            def one(i: int) -> None:
                replies[i] = art.prefetch(dests[i], timeout_s=300)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(dests))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        wall = time.perf_counter() - started
        if any(r is None or r.bytes_moved != art.size_bytes for r in replies):
            raise RuntimeError(f"{mode}: a destination did not receive the artifact: {replies}")
        return wall, [round(r.elapsed_s, 3) for r in replies]
    finally:
        rt.delete(art_id)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rate", default="2gbit", help="tbf rate of each host's egress")
    ap.add_argument(
        "--queue-ms",
        type=float,
        default=200,
        help="longest queue of the shaper, in ms of data (a relay's outgoing data delays the "
        "ACKs of its incoming flow by up to this much)",
    )
    args = ap.parse_args()
    reason = netns.unavailable_reason()
    if reason:
        print(json.dumps({"bench": "fanout", "skipped": reason}))
        return 0
    tag = os.getpid() % 100_000
    names = [f"fo{tag}{c}" for c in "abcd"]
    network = netns.Network(names, f"fobr{tag}", 100 + tag % 150)
    source, dests = names[0], names[1:]
    state = Path(tempfile.mkdtemp(prefix="tc-bench-fanout-"))
    network.setup()
    for ns in names:
        network.limit_rate(ns, args.rate, args.queue_ms)
    cluster = netns.NetnsCluster(state, TOKEN, network=network)
    report: dict[str, Any] = {
        "bench": "fanout",
        "bytes": args.mib * MIB,
        "rate": args.rate,
        "destinations": len(dests),
        "runs": [],
        "loadavg_1m_before": round(os.getloadavg()[0], 2),
    }
    try:
        cluster.start(f"{max(1024, 4 * args.mib)}MiB")
        import tensorcast as tc

        with tc.connect(cluster.store_addr, TOKEN, timeout_s=300) as rt:
            deadline = time.monotonic() + 60
            while {w.name for w in rt.workers() if w.alive} < set(names):
                if time.monotonic() > deadline:
                    raise RuntimeError("the workers did not register in 60 s")
                time.sleep(0.1)
            # Unmeasured: every worker connects to the others' data ports once.
            for mode in MODES:
                run_mode(rt, mode, source, dests, 8, f"warm-{tag}")
            for run in range(args.runs):
                order = MODES[run % 3 :] + MODES[: run % 3]
                row: dict[str, Any] = {"run": run, "order": "/".join(order)}
                for mode in order:
                    wall, each = run_mode(rt, mode, source, dests, args.mib, f"{tag}-{run}")
                    row[f"{mode}_s"] = round(wall, 3)
                    row[f"{mode}_each_s"] = each
                row["chain_over_one"] = round(row["chain_s"] / row["one_s"], 3)
                row["star_over_one"] = round(row["star_s"] / row["one_s"], 3)
                row["loadavg_1m"] = round(os.getloadavg()[0], 2)
                report["runs"].append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        cluster.stop()
        network.teardown()
        shutil.rmtree(state, ignore_errors=True)
    runs = report["runs"]
    if runs:
        report["median"] = {
            k: round(statistics.median(r[k] for r in runs), 3)
            for k in ("one_s", "star_s", "chain_s", "chain_over_one", "star_over_one")
        }
        report["one_gbps"] = round(args.mib * MIB / report["median"]["one_s"] / 1e9, 3)
        report["goal_chain_1.3_met"] = report["median"]["chain_over_one"] <= 1.3
    print(json.dumps(report))
    print(
        f"\nfan-out of {args.mib} MiB to {len(dests)} hosts, each host's egress shaped to "
        f"{args.rate}"
    )
    print(
        f"{'run':>3} {'order':>16} {'one s':>7} {'star s':>7} {'chain s':>8} {'star/one':>9} "
        f"{'chain/one':>10}"
    )
    for r in runs:
        print(
            f"{r['run']:>3} {r['order']:>16} {r['one_s']:>7} {r['star_s']:>7} {r['chain_s']:>8} "
            f"{r['star_over_one']:>9} {r['chain_over_one']:>10}"
        )
    if runs:
        m = report["median"]
        print(
            f"median: one {m['one_s']} s ({report['one_gbps']} GB/s), star/one "
            f"{m['star_over_one']}, chain/one {m['chain_over_one']} (goal <= 1.3)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
