#!/usr/bin/env python3
"""Heartbeats of a worker holding many contents, full inventories against deltas (issue 20,
architecture.md decision 85), on the sqlite Global Store in-process (no RPC: the store's side).

A store (a temporary sqlite file, WAL, fsync on every commit) with one worker holding
`--contents` contents, each named by an artifact. Per run, for each mode in a rotating order:

  beat     `--beats` heartbeats one after the other, each timed: `full` reports all the contents
           (what every beat did before), `delta` the changes since the acknowledged inventory
           (`--changes` contents pinned or unpinned per beat). The store holds its one writer
           for the whole beat.
  writes   a small write (`put_artifacts` of one new 64-byte content) in a loop for `--seconds`
           while a heartbeat of that mode lands every `--interval` seconds: p50, p99 and max
           latency of the writes (what a `put` behind a beat waits).

Runs are interleaved (`--runs`, default 5); medians over runs are reported and every run is
listed in the JSON line.

    python scripts/bench/heartbeat.py              # 5 runs, ~1 min
    python scripts/bench/heartbeat.py --runs 1 --contents 1000 --seconds 1   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from tensorcast.store.base import Inventory, NewArtifact, NewReplica, WorkerRegistration
from tensorcast.store.sqlite_store import SqliteStore
from tensorcast.types import TensorMeta

MODES = ("full", "delta")


def _replica(content_id: str) -> NewReplica:
    return NewReplica(content_id, 64, (TensorMeta("w", "F32", (16,), 64, 0, "0" * 64),))


class Worker:
    """One worker's inventory and epochs, as worker/inventory.py keeps them."""

    def __init__(self, store: SqliteStore, contents: list[str], changes: int) -> None:
        self.store = store
        self.contents = contents
        self.changes = changes
        self.pinned: set[str] = set()
        self.epoch = 0
        self.acked = 0
        self.lock = threading.Lock()

    def beat(self, mode: str) -> float:
        """One heartbeat; returns its time in the store (seconds)."""
        with self.lock:
            toggled = self.contents[self.epoch % 50 * self.changes :][: self.changes]
            self.pinned ^= set(toggled)
            self.epoch += 1
            if mode == "full" or not self.acked:
                inventory = Inventory.of(self.contents, self.pinned, epoch=self.epoch)
            else:
                held = {(c, "cpu"): c in self.pinned for c in toggled}
                inventory = Inventory(self.epoch, held, frozenset(), self.acked)
            start = time.perf_counter()
            result = self.store.heartbeat("w", 0, inventory, time.time())
            took = time.perf_counter() - start
            assert not result.resync and not result.drop_content_ids, result
            self.acked = self.epoch
            return took


def _writes_during_beats(
    store: SqliteStore, worker: Worker, mode: str, seconds: float, interval: float, tag: str
) -> list[float]:
    stop = threading.Event()

    def beats() -> None:
        while not stop.wait(interval):
            worker.beat(mode)

    thread = threading.Thread(target=beats, daemon=True)
    thread.start()
    latencies = []
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        content_id = f"{tag}-{i}"
        start = time.perf_counter()
        store.put_artifacts(
            "v",  # another worker: the beating one's inventory stays the same
            [_replica(content_id)],
            [NewArtifact(f"x/{content_id}", content_id, "system")],
            time.time(),
        )
        latencies.append(time.perf_counter() - start)
        i += 1
    stop.set()
    thread.join()
    return latencies


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--contents", type=int, default=10_000)
    parser.add_argument("--changes", type=int, default=10)
    parser.add_argument("--beats", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--interval", type=float, default=0.05)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = SqliteStore(Path(tmp) / "store.db", heartbeat_ttl_s=30.0)
        for worker_id in ("w", "v"):
            store.register_worker(
                WorkerRegistration(worker_id, worker_id, "", "h", "", ("basic",), 1 << 30, 1),
                time.time(),
            )
        contents = [f"c{i:06d}" for i in range(args.contents)]
        for start in range(0, len(contents), 1000):
            part = contents[start : start + 1000]
            store.put_artifacts(
                "w",
                [_replica(c) for c in part],
                [NewArtifact(f"a/{c}", c, "system") for c in part],
                time.time(),
            )
        worker = Worker(store, contents, args.changes)
        worker.beat("full")
        runs = []
        for run in range(args.runs):
            row: dict = {"run": run + 1}
            for mode in MODES[run % 2 :] + MODES[: run % 2]:
                beats = [worker.beat(mode) for _ in range(args.beats)]
                writes = _writes_during_beats(
                    store, worker, mode, args.seconds, args.interval, f"r{run}{mode}"
                )
                row[mode] = {
                    "beat_ms": round(statistics.median(beats) * 1e3, 3),
                    "write_p50_ms": round(_pct(writes, 0.5) * 1e3, 3),
                    "write_p99_ms": round(_pct(writes, 0.99) * 1e3, 3),
                    "write_max_ms": round(max(writes) * 1e3, 3),
                    "writes": len(writes),
                }
            runs.append(row)
        store.close()
    keys = ("beat_ms", "write_p50_ms", "write_p99_ms", "write_max_ms")
    medians = {
        mode: {k: round(statistics.median(r[mode][k] for r in runs), 3) for k in keys}
        for mode in MODES
    }
    print(
        json.dumps(
            {
                "bench": "heartbeat",
                "contents": args.contents,
                "changes": args.changes,
                "interval_s": args.interval,
                "medians": medians,
                "runs": runs,
            }
        )
    )
    print(
        f"\n{args.contents} contents, {args.changes} changes per delta, beats every "
        f"{args.interval * 1e3:.0f} ms during the writes; medians of {args.runs} runs (ms)"
    )
    print(f"{'mode':<6} {'beat':>8} {'write p50':>10} {'write p99':>10} {'write max':>10}")
    for mode in MODES:
        m = medians[mode]
        print(
            f"{mode:<6} {m['beat_ms']:>8.2f} {m['write_p50_ms']:>10.3f} "
            f"{m['write_p99_ms']:>10.3f} {m['write_max_ms']:>10.2f}"
        )
    print("every run (full / delta): beat ms, write p99 ms, write max ms")
    for r in runs:
        print(
            f"  run {r['run']}: "
            + "  ".join(
                f"{mode} {r[mode]['beat_ms']:.2f} / {r[mode]['write_p99_ms']:.2f} / "
                f"{r[mode]['write_max_ms']:.2f}"
                for mode in MODES
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
