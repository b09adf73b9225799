#!/usr/bin/env python3
"""Control-plane throughput (issue 20): small puts, metadata lookups and deletes per second and
their latency, TensorCast against Redis and Mooncake Store side by side in one run, plus the
metadata time of a 700-tensor weight-sync publish.

Systems (all on 127.0.0.1, started once for the whole run, stopped at the end):

  tensorcast   `tc up --workers 1` in a temporary state dir: a Global Store on sqlite (WAL,
               fsync on every commit: a put is durable and visible cluster-wide when it returns)
               and one worker. put = `rt.put({"w": tensor}, key)` (hashes computed and checked),
               get-metadata = `rt.info(key)`, get = `rt.artifact(key).tensor_dict()` (the bytes,
               zero-copy), delete = `rt.delete(key)`.
  redis        redis-server without persistence (--save "" --appendonly no), redis-py + hiredis:
               SET / GET / DEL.
  redis-aof    the same with --appendonly yes --appendfsync always: every write fsynced before
               the reply, the durability TensorCast's put has.
  mooncake     Mooncake Store over TCP: mooncake_master (HTTP metadata server), a storage process
               holding the segment, a client without one: put / get / remove(force=True).

Every payload is 16 float32 (64 bytes), as in the issue; each key is put once (never reused).

Per run, for each system in a rotating order:
  latency    one client, `--ops` puts of new keys, then a get-metadata (TensorCast) / get of
             each, then a delete of each; every call timed on its own (p50, p99, mean).
  8 clients  `--clients` processes (spawned, connected before the clock starts) loop
             put k; get(-metadata) k (checked); delete k for `--seconds`: total operations/s
             and the p50 of each kind under that load; errors and wrong values counted.
  publish    TensorCast: `WeightPublisher.publish` of a `--publish-tensors`-tensor state dict
             (16 floats each, new values every run so every tensor is new content): its wall
             time is metadata (45 KB of bytes); then an unchanged republish under a new version.
             Redis: one MULTI/EXEC of MSET of as many keys + a manifest; Mooncake: one
             put_batch of as many keys + a manifest (neither checks hashes nor versions).
  commands   TensorCast only: the wall time of `tc ls --json` over `--list-artifacts` artifacts
             (created once with put_many before the first run), `tc ls --limit 100 --json`, and
             `tc show --json` of a `--show-tensors`-tensor artifact, each a fresh `tc` process
             (interpreter start and imports included: what an operator's shell waits for).

`--runs` runs (default 5) are interleaved: every run measures every system, so a noisy stretch
of the shared machine hits all of them; medians over runs are reported, and every run is listed
(with the 1-minute load average before it) in the JSON line.

    scripts/install-baselines.sh                 # redis-server, redis-py + hiredis, Mooncake
    python scripts/bench/control.py              # 5 runs, ~6 min on 2 cores
    python scripts/bench/control.py --runs 1 --ops 300 --seconds 3     # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kv_baselines as kb

SYSTEMS = ("tensorcast", "redis", "redis-aof", "mooncake")
PAYLOAD_FLOATS = 16
START_SLACK_S = 1.0  # client processes start this long after the last one is ready


# ------------------------------------------------------------------------------------------------
# clients: one interface per system, built in any process from picklable parameters


class Client:
    """put(key, i), get_meta(key, i) -> checked, get(key, i) -> checked, delete(key)."""

    def put(self, key: str, i: int) -> None: ...
    def get_meta(self, key: str, i: int) -> None: ...
    def get(self, key: str, i: int) -> None: ...
    def delete(self, key: str) -> None: ...
    def close(self) -> None: ...


def _payload(i: int) -> bytes:
    import struct

    return struct.pack(f"<{PAYLOAD_FLOATS}f", *([float(i)] * PAYLOAD_FLOATS))


class WrongValue(RuntimeError):
    pass


class TensorCastClient(Client):
    def __init__(self, params: dict[str, Any]) -> None:
        import torch

        import tensorcast as tc

        self.torch = torch
        self.rt = tc.connect(state_dir=params["state_dir"])
        self.hashes: dict[str, str] = {}

    def put(self, key: str, i: int) -> None:
        art = self.rt.put({"w": self.torch.full((PAYLOAD_FLOATS,), float(i))}, key)
        self.hashes[key] = art.info.tensors[0].hash_hex

    def get_meta(self, key: str, i: int) -> None:
        if self.rt.info(key).tensors[0].hash_hex != self.hashes[key]:
            raise WrongValue(key)

    def get(self, key: str, i: int) -> None:
        w = self.rt.artifact(key).tensor_dict()["w"]
        if float(w[0]) != float(i) or w.numel() != PAYLOAD_FLOATS:
            raise WrongValue(key)

    def delete(self, key: str) -> None:
        self.rt.delete(key)
        self.hashes.pop(key, None)

    def close(self) -> None:
        self.rt.close()


class RedisClient(Client):
    def __init__(self, params: dict[str, Any]) -> None:
        import redis

        self.r = redis.Redis(host=kb.LOOPBACK, port=params["port"], socket_timeout=60)

    def put(self, key: str, i: int) -> None:
        self.r.set(key, _payload(i))

    def get_meta(self, key: str, i: int) -> None:
        self.get(key, i)

    def get(self, key: str, i: int) -> None:
        if self.r.get(key) != _payload(i):
            raise WrongValue(key)

    def delete(self, key: str) -> None:
        self.r.delete(key)

    def close(self) -> None:
        self.r.close()


class MooncakeClient(Client):
    def __init__(self, params: dict[str, Any]) -> None:
        os.environ.setdefault("GLOG_minloglevel", "1")
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        log = Path(params["dir"]) / f"client-{os.getpid()}.log"
        with kb._stderr_to(log):
            rc = kb._mooncake_setup(
                self.store, params["metadata"], params["master"], 0, 16 * kb.MIB
            )
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup rc={rc} ({kb._tail(log)})")

    def put(self, key: str, i: int) -> None:
        rc = self.store.put(key, _payload(i))
        if rc != 0:
            raise RuntimeError(f"put {key}: {rc}")

    def get_meta(self, key: str, i: int) -> None:
        self.get(key, i)

    def get(self, key: str, i: int) -> None:
        if self.store.get(key) != _payload(i):
            raise WrongValue(key)

    def delete(self, key: str) -> None:
        rc = self.store.remove(key, True)
        if rc != 0:
            raise RuntimeError(f"remove {key}: {rc}")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.store.close()


def make_client(system: str, params: dict[str, Any]) -> Client:
    if system == "tensorcast":
        return TensorCastClient(params)
    if system.startswith("redis"):
        return RedisClient(params)
    return MooncakeClient(params)


# ------------------------------------------------------------------------------------------------
# servers


class TensorCastServer:
    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="bench-control-tc-")
        self._tc("up", "--workers", "1", "--mem", "1GiB")
        self.params = {"state_dir": self.dir}
        self.info = {"backend": "sqlite (WAL, synchronous=FULL)", "workers": 1}

    def _tc(self, *args: str) -> None:
        subprocess.run(
            [sys.executable, "-m", "tensorcast.cli.main", *args, "--state-dir", self.dir],
            check=True,
            capture_output=True,
            timeout=120,
        )

    def fill(self, artifacts: int, tensors: int) -> None:
        """The artifacts the commands list (1,000 per put_many) and one many-tensor artifact."""
        import torch

        import tensorcast as tc

        one = torch.zeros(PAYLOAD_FLOATS)
        with tc.connect(state_dir=self.dir) as rt:
            for start in range(0, artifacts, 1000):
                ids = range(start, min(start + 1000, artifacts))
                rt.put_many({f"list/{i:06d}": {"w": one + i} for i in ids})
            rt.put({f"layers.{i}.weight": one + i for i in range(tensors)}, "model@v1")

    def command_s(self, *args: str) -> float:
        """Wall time of one `tc` process, its JSON checked to parse."""
        t0 = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-m", "tensorcast.cli.main", *args, "--json", "--state-dir", self.dir],
            check=True,
            capture_output=True,
            timeout=120,
        ).stdout
        took = time.perf_counter() - t0
        json.loads(out)
        return took

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._tc("down")
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisServer:
    def __init__(self, fsync: bool) -> None:
        server = shutil.which("redis-server")
        if server is None:
            raise kb.Skip("redis-server not found (scripts/install-baselines.sh)")
        import redis

        self.dir = tempfile.mkdtemp(prefix="bench-control-redis-")
        persistence = (
            ["--appendonly", "yes", "--appendfsync", "always"] if fsync else ["--appendonly", "no"]
        )
        self.port = kb.free_port()
        self.proc = subprocess.Popen(
            [
                server,
                "--bind",
                kb.LOOPBACK,
                "--port",
                str(self.port),
                "--save",
                "",
                *persistence,
                "--protected-mode",
                "no",
                "--dir",
                self.dir,
                "--loglevel",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(host=kb.LOOPBACK, port=self.port)
        deadline = time.monotonic() + kb.START_TIMEOUT_S
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        client.close()
        self.params = {"port": self.port}
        self.info = {"server": "redis-server " + " ".join(persistence)}

    def close(self) -> None:
        kb._stop(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)


class MooncakeServer:
    """kv_baselines' Mooncake Store (master + storage process); clients connect separately."""

    def __init__(self) -> None:
        self.base = kb.MooncakeStoreBaseline(
            segment_bytes=512 * kb.MIB, max_batch_bytes=16 * kb.MIB
        )
        info = self.base.info
        self.params = {
            "metadata": info["metadata_server"],
            "master": f"{kb.LOOPBACK}:{info['master_rpc_port']}",
            "dir": str(self.base._dir),
        }
        self.info = {k: info[k] for k in ("package", "master", "protocol", "segment")}

    def close(self) -> None:
        self.base.close()


def start_server(system: str) -> Any:
    if system == "tensorcast":
        return TensorCastServer()
    if system == "redis":
        return RedisServer(fsync=False)
    if system == "redis-aof":
        return RedisServer(fsync=True)
    return MooncakeServer()


# ------------------------------------------------------------------------------------------------
# measurements


def _pct(xs: list[float], q: float) -> float:
    return kb._pct(sorted(xs), q) if xs else float("nan")


def _lat(xs: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(_pct(xs, 50) * 1e3, 4),
        "p99_ms": round(_pct(xs, 99) * 1e3, 4),
        "mean_ms": round(statistics.fmean(xs) * 1e3, 4),
        "ops": len(xs),
    }


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def latency(client: Client, system: str, run: int, ops: int) -> dict[str, Any]:
    keys = [f"lat/{run}/{i}" for i in range(ops)]
    for i in range(20):  # warm-up: connections, caches
        client.put(f"warm/{run}/{i}", i)
        client.get_meta(f"warm/{run}/{i}", i)
        client.delete(f"warm/{run}/{i}")
    out: dict[str, Any] = {}
    out["put"] = _lat([_timed(lambda k=k, i=i: client.put(k, i)) for i, k in enumerate(keys)])
    out["get_meta"] = _lat(
        [_timed(lambda k=k, i=i: client.get_meta(k, i)) for i, k in enumerate(keys)]
    )
    if system == "tensorcast":  # the bytes too (others' get is their only lookup)
        out["get"] = _lat([_timed(lambda k=k, i=i: client.get(k, i)) for i, k in enumerate(keys)])
    out["delete"] = _lat([_timed(lambda k=k: client.delete(k)) for k in keys])
    return out


def client_process(
    system: str, params: dict[str, Any], index: int, run: int, seconds: float, ready, go, results
) -> None:
    """One of the concurrent clients: connect, say ready, wait for the start time, loop."""
    try:
        client = make_client(system, params)
        client.put(f"mix-warm/{run}/{index}", 1)
        client.get_meta(f"mix-warm/{run}/{index}", 1)
        client.delete(f"mix-warm/{run}/{index}")
    except BaseException as e:  # reported, not raised: the parent waits for every client
        ready.put(f"{type(e).__name__}: {e}")
        return
    ready.put("")
    start_at = go.get()
    time.sleep(max(0.0, start_at - time.time()))
    end = time.perf_counter() + seconds
    lat: dict[str, list[float]] = {"put": [], "get_meta": [], "delete": []}
    errors = wrong = 0
    i = 0
    began = time.perf_counter()
    cpu_began = time.process_time()
    while time.perf_counter() < end:
        key = f"mix/{run}/{index}/{i}"
        try:
            t0 = time.perf_counter()
            client.put(key, i)
            t1 = time.perf_counter()
            client.get_meta(key, i)
            t2 = time.perf_counter()
            client.delete(key)
            t3 = time.perf_counter()
            lat["put"].append(t1 - t0)
            lat["get_meta"].append(t2 - t1)
            lat["delete"].append(t3 - t2)
        except WrongValue:
            wrong += 1
        except Exception:
            errors += 1
        i += 1
    elapsed = time.perf_counter() - began
    cpu_s = time.process_time() - cpu_began
    client.close()
    results.put(
        {
            "ops": sum(len(v) for v in lat.values()),
            "elapsed_s": elapsed,
            "cpu_s": cpu_s,
            "errors": errors,
            "wrong": wrong,
            "lat": {k: (_pct(v, 50), len(v)) for k, v in lat.items()},
        }
    )


def concurrent(
    system: str, params: dict[str, Any], run: int, clients: int, seconds: float
) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ready, go, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(
            target=client_process,
            args=(system, params, k, run, seconds, ready, go, results),
            daemon=True,
        )
        for k in range(clients)
    ]
    for p in procs:
        p.start()
    problems = [ready.get(timeout=120) for _ in procs]
    if any(problems):
        for p in procs:
            p.kill()
        raise RuntimeError(f"{system} clients failed to start: {[x for x in problems if x]}")
    start_at = time.time() + START_SLACK_S
    for _ in procs:
        go.put(start_at)
    done = [results.get(timeout=seconds + 120) for _ in procs]
    for p in procs:
        p.join(30)
    ops = sum(d["ops"] for d in done)
    wall = max(d["elapsed_s"] for d in done)
    out: dict[str, Any] = {
        "clients": clients,
        "ops": ops,
        "ops_per_s": round(ops / wall, 1),
        "errors": sum(d["errors"] for d in done),
        "wrong": sum(d["wrong"] for d in done),
        "client_cpu_us_per_op": round(sum(d["cpu_s"] for d in done) / max(ops, 1) * 1e6, 1),
    }
    for kind in ("put", "get_meta", "delete"):
        # the median of the clients' medians (each client saw the same mix)
        out[f"{kind}_p50_ms"] = round(statistics.median(d["lat"][kind][0] for d in done) * 1e3, 4)
    return out


def publish(system: str, server: Any, run: int, tensors: int) -> dict[str, Any]:
    if system == "tensorcast":
        import torch

        import tensorcast as tc

        with tc.connect(state_dir=server.params["state_dir"]) as rt:
            publisher = tc.WeightPublisher(rt, f"bench-{run}", keep_last=2)
            state = {
                f"layers.{i}.weight": torch.full((PAYLOAD_FLOATS,), float(run * 100_000 + i))
                for i in range(tensors)
            }
            first = _timed(lambda: publisher.publish(state, "v1"))
            again = _timed(lambda: publisher.publish(state, "v2"))  # unchanged content
            collect = _timed(lambda: publisher.publish(state, "v3"))  # v1 collected
            got = rt.artifact(f"weights/bench-{run}@v3/layers.{tensors - 1}.weight").tensor_dict()
            if float(next(iter(got.values()))[0]) != float(run * 100_000 + tensors - 1):
                raise WrongValue("publish")
        return {
            "publish_s": round(first, 4),
            "republish_unchanged_s": round(again, 4),
            "publish_with_gc_s": round(collect, 4),
        }
    keys = [f"pub/{run}/{i}" for i in range(tensors)] + [f"pub/{run}/manifest"]
    values = [_payload(i) for i in range(tensors)] + [b"x" * (tensors * 120)]
    if system.startswith("redis"):
        import redis

        r = redis.Redis(host=kb.LOOPBACK, port=server.params["port"])

        def put_all() -> None:
            pipe = r.pipeline(transaction=True)
            pipe.mset(dict(zip(keys, values)))
            pipe.execute()

        took = _timed(put_all)
        r.delete(*keys)
        r.close()
        return {"publish_s": round(took, 4)}
    client = MooncakeClient(server.params)
    took = _timed(lambda: client.store.put_batch(keys, values))
    client.store.batch_remove(keys, True)
    client.close()
    return {"publish_s": round(took, 4)}


def commands(server: TensorCastServer, artifacts: int) -> dict[str, Any]:
    return {
        f"ls_{artifacts}_s": round(server.command_s("ls"), 4),
        "ls_limit_100_s": round(server.command_s("ls", "--limit", "100"), 4),
        "show_model_s": round(server.command_s("show", "model@v1"), 4),
    }


# ------------------------------------------------------------------------------------------------
# the run


def summarize(runs: list[dict[str, Any]], systems: list[str]) -> dict[str, Any]:
    med: dict[str, Any] = {}
    for system in systems:
        rows = [r[system] for r in runs if system in r and "error" not in r[system]]
        if not rows:
            continue
        m: dict[str, Any] = {}
        for kind in rows[0]["latency"]:
            for stat in ("p50_ms", "p99_ms", "mean_ms"):
                m[f"{kind}_{stat}"] = round(
                    statistics.median(r["latency"][kind][stat] for r in rows), 4
                )
        for key in rows[0]["concurrent"]:
            if key != "clients":
                m[f"c{rows[0]['concurrent']['clients']}_{key}"] = round(
                    statistics.median(r["concurrent"][key] for r in rows), 4
                )
        for section in ("publish", "commands"):
            for key in rows[0].get(section, {}):
                m[key] = round(statistics.median(r[section][key] for r in rows), 4)
        med[system] = m
    return med


def table(report: dict[str, Any]) -> str:
    med = report["median"]
    cols = [
        ("put p50 ms", "put_p50_ms"),
        ("put p99", "put_p99_ms"),
        ("get-meta p50", "get_meta_p50_ms"),
        ("get p50", "get_p50_ms"),
        ("delete p50", "delete_p50_ms"),
        ("ops/s x8", f"c{report['meta']['clients']}_ops_per_s"),
        ("errors", f"c{report['meta']['clients']}_errors"),
        ("publish s", "publish_s"),
    ]
    rows = [["system", *(c for c, _ in cols)]]
    for system, m in med.items():
        rows.append([system, *(str(m.get(k, "-")) for _, k in cols)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    if "tensorcast" in med and "redis" in med:
        t, r = med["tensorcast"], med["redis"]
        lines.append(
            f"tensorcast put p50 / redis SET p50: {t['put_p50_ms'] / r['put_p50_ms']:.2f}x"
        )
    if "tensorcast" in med and "mooncake" in med:
        t, m = med["tensorcast"], med["mooncake"]
        lines.append(
            f"tensorcast put p50 / mooncake put p50: {t['put_p50_ms'] / m['put_p50_ms']:.2f}x"
        )
    if "tensorcast" in med:
        t = med["tensorcast"]
        lines.append(
            "tc commands (s): "
            + ", ".join(f"{k[:-2]} {v}" for k, v in t.items() if k.startswith(("ls_", "show_")))
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--ops", type=int, default=1000, help="latency: ops per kind per run")
    parser.add_argument("--seconds", type=float, default=10.0, help="concurrent loop length")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--publish-tensors", type=int, default=700)
    parser.add_argument("--list-artifacts", type=int, default=10_000)
    parser.add_argument("--show-tensors", type=int, default=1000)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    args = parser.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    servers: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    report: dict[str, Any] = {
        "bench": "control",
        "meta": {
            "runs": args.runs,
            "ops": args.ops,
            "seconds": args.seconds,
            "clients": args.clients,
            "publish_tensors": args.publish_tensors,
            "list_artifacts": args.list_artifacts,
            "show_tensors": args.show_tensors,
            "payload_bytes": PAYLOAD_FLOATS * 4,
            "cpus": os.cpu_count(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "runs": [],
    }
    try:
        for system in systems:
            try:
                servers[system] = start_server(system)
            except kb.Skip as e:
                skipped[system] = e.reason
        live = [s for s in systems if s in servers]
        if "tensorcast" in servers:
            servers["tensorcast"].fill(args.list_artifacts, args.show_tensors)
        report["meta"]["systems"] = {s: servers[s].info for s in live}
        report["meta"]["skipped"] = skipped
        for run in range(args.runs):
            order = live[run % len(live) :] + live[: run % len(live)]
            result: dict[str, Any] = {"order": order, "loadavg_1m": round(os.getloadavg()[0], 2)}
            for system in order:
                print(f"run {run + 1}/{args.runs}: {system}", file=sys.stderr, flush=True)
                try:
                    client = make_client(system, servers[system].params)
                    try:
                        lat = latency(client, system, run, args.ops)
                    finally:
                        client.close()
                    conc = concurrent(
                        system, servers[system].params, run, args.clients, args.seconds
                    )
                    pub = publish(system, servers[system], run, args.publish_tensors)
                    result[system] = {"latency": lat, "concurrent": conc, "publish": pub}
                    if system == "tensorcast":
                        result[system]["commands"] = commands(servers[system], args.list_artifacts)
                except Exception as e:  # reported in the run, the others go on
                    result[system] = {"error": f"{type(e).__name__}: {e}"}
            report["runs"].append(result)
    finally:
        for server in servers.values():
            server.close()
    report["median"] = summarize(report["runs"], systems)
    report["meta"]["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
    print(json.dumps(report, separators=(",", ":")))
    print(table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
