#!/usr/bin/env python3
"""KV-page baselines: batched put / get / exists of fixed-size pages in Redis and Mooncake Store.

The baseline half of the KV-page benchmark (scripts/bench/kv.py adds TensorCast's own figures,
measured with the same `measure`). Every system is driven through one interface:

    put_batch(keys, values)         store len(keys) pages in one batch call
    get_batch(keys) -> list[bytes]  the values of all keys; KeyError if any is missing
    exists_batch(keys) -> list[bool]
    delete_batch(keys)              drop the keys (untimed; frees the store between cells)
    close()                         stop whatever the baseline started
    name                            the system's name in the report

What is measured, per (page size, batch) cell of PAGE_SIZES x BATCHES (64 KiB, 256 KiB, 2 MiB x
1, 16, 256 pages per call):

  - `calls` = min(max_ops, total_bytes_target // (page * batch)), at least 1, batch calls of
    distinct, never-before-used keys (a store may silently keep the old value of a key that is
    put again: Mooncake Store does);
  - unmeasured warm-up first: 3 put / get / exists calls of up to 32 MiB each on their own keys,
    and one exists of a key never put (must say False);
  - then all timed puts, then all timed gets (every returned page is compared byte for byte
    with what was put, outside the timed region: a wrong or missing page raises), then all
    timed exists (all must say True), each call timed on its own with perf_counter;
  - per op kind: GB/s (1e9 bytes/s, over the sum of the call times; none for exists), pages/s,
    p50 / p99 / mean latency per batch call in ms and p50 / p99 divided by the batch (latency
    per page). p99 interpolates linearly, so with few calls it is close to the slowest one.

Payloads: one os.urandom(page) per cell, each page a copy of it with its index written into its
first and last 8 bytes and into 8 bytes in the middle, so every page differs.

Systems (both on 127.0.0.1 unless told otherwise, started in a temporary directory and stopped at
close(); scripts/bench/kv.py --path cross-host starts their servers in another network namespace
through `Remote`, with the clients in this process):

  redis           redis-server --save "" --appendonly no (no persistence), redis-py with the
                  hiredis parser: put = one MSET, get = one MGET, exists = a non-transactional
                  pipeline of one EXISTS per key (a single multi-key EXISTS only returns a count)
  mooncake-store  mooncake_master with its embedded HTTP metadata server, a storage process (a
                  MooncakeDistributedStore client that mounts the global segment and does
                  nothing else) and the benchmark's own client with no segment, so every page
                  crosses a TCP connection as with Redis; protocol "tcp". put = put_batch, get =
                  get_batch, exists = batch_is_exist, delete = batch_remove(force=True).
                  `--systems mooncake-local` instead mounts the segment in the benchmark's own
                  process (Mooncake then copies with memcpy, no TCP).

Extra packages (not TensorCast dependencies); a missing one is reported as skipped:

    apt-get install redis-server libibverbs1   # Mooncake's wheel links libibverbs
    pip install redis hiredis mooncake-transfer-engine-non-cuda

Prints one JSON line with every figure, then a human-readable table.

    python scripts/bench/kv_baselines.py                               # full grid
    python scripts/bench/kv_baselines.py --sizes 65536,262144 --batches 1,16
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import json
import os
import platform
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
PAGE_SIZES = (64 * 1024, 256 * 1024, 2 * 1024 * 1024)
BATCHES = (1, 16, 256)
TOTAL_BYTES_TARGET = 256 * MIB  # timed data per cell and op kind (at least one batch call)
MAX_OPS = 256  # timed batch calls per cell and op kind
WARM_CALLS = 3
WARM_BYTES = 32 * MIB  # per warm-up call
LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 20.0

PutBatch = Callable[[Sequence[str], Sequence[bytes]], None]
GetBatch = Callable[[Sequence[str]], Sequence[bytes]]
ExistsBatch = Callable[[Sequence[str]], Sequence[bool]]
DeleteBatch = Callable[[Sequence[str]], None]


class Skip(Exception):
    """A baseline cannot run here; `reason` says why and what to install."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class WrongValue(RuntimeError):
    """A store returned bytes that differ from what was put, or said a key is (not) there."""


# ------------------------------------------------------------------------------------------------
# the measurement


@dataclass(frozen=True)
class CellPlan:
    calls: int  # timed batch calls per op kind
    warm_calls: int
    warm_batch: int  # pages per warm-up call

    def stored_bytes(self, page_bytes: int, batch: int) -> int:
        """The most bytes the cell holds in the store at once (timed + warm-up pages)."""
        return page_bytes * (self.calls * batch + self.warm_calls * self.warm_batch)


def plan(page_bytes: int, batch: int, total_bytes_target: int, max_ops: int) -> CellPlan:
    calls = max(1, min(max_ops, total_bytes_target // (page_bytes * batch)))
    warm_batch = min(batch, max(1, WARM_BYTES // page_bytes))
    return CellPlan(calls=calls, warm_calls=WARM_CALLS, warm_batch=warm_batch)


class Pages:
    """Distinct pages from one os.urandom: page i is the template with i stamped in 3 places."""

    def __init__(self, page_bytes: int) -> None:
        if page_bytes < 24:
            raise ValueError("page_bytes must be at least 24")
        self.page_bytes = page_bytes
        self.salt = int.from_bytes(os.urandom(8), "little")
        self._template = bytearray(os.urandom(page_bytes))
        self._offsets = (0, (page_bytes // 2) & ~7, page_bytes - 8)

    def page(self, i: int) -> bytes:
        for n, off in enumerate(self._offsets):
            struct.pack_into("<Q", self._template, off, (self.salt + i * 3 + n) & (2**64 - 1))
        return bytes(self._template)


def _pct(sorted_xs: list[float], q: float) -> float:
    """Percentile q (0..100) of sorted values, linear interpolation (numpy's default)."""
    if len(sorted_xs) == 1:
        return sorted_xs[0]
    pos = (len(sorted_xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def summarize(times_s: list[float], batch: int, page_bytes: int | None) -> dict[str, Any]:
    """Throughput and latency of one op kind from the durations of its batch calls.

    `page_bytes` None: no bytes moved (exists), so no GB/s."""
    total_s = sum(times_s)
    pages = len(times_s) * batch
    xs = sorted(times_s)
    p50_ms = _pct(xs, 50) * 1e3
    p99_ms = _pct(xs, 99) * 1e3
    return {
        "gbps": pages * page_bytes / total_s / 1e9 if page_bytes and total_s > 0 else None,
        "pages_per_s": pages / total_s if total_s > 0 else 0.0,
        "p50_ms": p50_ms,
        "p99_ms": p99_ms,
        "mean_ms": total_s / len(times_s) * 1e3,
        "p50_ms_per_page": p50_ms / batch,
        "p99_ms_per_page": p99_ms / batch,
        "calls": len(times_s),
        "total_s": total_s,
    }


def _verify(keys: Sequence[str], got: Sequence[bytes], want: list[bytes]) -> None:
    if len(got) != len(want):
        raise WrongValue(f"get_batch of {len(keys)} keys returned {len(got)} values")
    for key, g, w in zip(keys, got, want):
        if g != w:
            glen = len(g) if isinstance(g, (bytes, bytearray, memoryview)) else type(g).__name__
            raise WrongValue(
                f"get_batch returned wrong bytes for {key!r} (len {glen}, want {len(w)})"
            )


def measure(
    put_batch: PutBatch,
    get_batch: GetBatch,
    exists_batch: ExistsBatch,
    page_bytes: int,
    batch: int,
    total_bytes_target: int = TOTAL_BYTES_TARGET,
    max_ops: int = MAX_OPS,
    *,
    delete_batch: DeleteBatch | None = None,
    key_prefix: str = "",
) -> dict[str, Any]:
    """Time batched put, get and exists of `batch` pages of `page_bytes` each (see the module
    docstring for the procedure). Raises WrongValue when a store returns other bytes than were
    put (or a missing key), or when exists is wrong. With `delete_batch`, every key the cell put
    is deleted before returning (also on failure), untimed."""
    p = plan(page_bytes, batch, total_bytes_target, max_ops)
    prefix = key_prefix or f"kvb:{uuid.uuid4().hex[:8]}"
    pages = Pages(page_bytes)

    def keys_of(tag: str, call: int, n: int) -> list[str]:
        return [f"{prefix}:{page_bytes}:{batch}:{tag}{call}:{j}" for j in range(n)]

    def values_of(first: int, n: int) -> list[bytes]:
        return [pages.page(first + j) for j in range(n)]

    put_keys: list[list[str]] = []
    started = time.perf_counter()
    gc_was_enabled = gc.isenabled()
    try:
        # warm-up: connections, allocations, first touches; page indices after the timed ones
        base = p.calls * batch
        for c in range(p.warm_calls):
            keys = keys_of("w", c, p.warm_batch)
            values = values_of(base + c * p.warm_batch, p.warm_batch)
            put_keys.append(keys)
            put_batch(keys, values)
            _verify(keys, get_batch(keys), values)
            if not all(exists_batch(keys)):
                raise WrongValue(
                    f"exists_batch says a warm-up key put just before is missing: {keys[0]!r}"
                )
        missing = [f"{prefix}:never-put"]
        if list(exists_batch(missing)) != [False]:
            raise WrongValue(f"exists_batch says {missing[0]!r}, never put, exists")
        del values

        put_s: list[float] = []
        get_s: list[float] = []
        exists_s: list[float] = []
        timed_keys = [keys_of("t", c, batch) for c in range(p.calls)]
        gc.disable()
        for c, keys in enumerate(timed_keys):
            values = values_of(c * batch, batch)
            put_keys.append(keys)
            t0 = time.perf_counter()
            put_batch(keys, values)
            put_s.append(time.perf_counter() - t0)
        del values
        for c, keys in enumerate(timed_keys):
            t0 = time.perf_counter()
            got = get_batch(keys)
            get_s.append(time.perf_counter() - t0)
            _verify(keys, got, values_of(c * batch, batch))
            del got
        for keys in timed_keys:
            t0 = time.perf_counter()
            found = exists_batch(keys)
            exists_s.append(time.perf_counter() - t0)
            if len(found) != len(keys) or not all(found):
                raise WrongValue(
                    f"exists_batch says a key that was put is missing (of {keys[0]!r}...)"
                )
    finally:
        if gc_was_enabled:
            gc.enable()
        if delete_batch is not None:
            for keys in put_keys:
                with contextlib.suppress(Exception):
                    delete_batch(keys)
    return {
        "page_bytes": page_bytes,
        "batch": batch,
        "calls": p.calls,
        "pages": p.calls * batch,
        "bytes": p.calls * batch * page_bytes,
        "warm_calls": p.warm_calls,
        "warm_batch": p.warm_batch,
        "verified": True,
        "put": summarize(put_s, batch, page_bytes),
        "get": summarize(get_s, batch, page_bytes),
        "exists": summarize(exists_s, batch, None),
        "wall_s": time.perf_counter() - started,
    }


# ------------------------------------------------------------------------------------------------
# helpers for the baselines


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Remote:
    """Where a baseline's servers run when not on this host's loopback: `prefix` runs a command
    there (`ip netns exec NS`), `host` is their address, `client_host` this process's address
    as they see it (Mooncake's transfer engine connects back to it)."""

    prefix: tuple[str, ...] = ()
    host: str = LOOPBACK
    client_host: str = LOOPBACK

    def free_port(self) -> int:
        if not self.prefix:
            return free_port(self.host)
        code = f"import socket; s = socket.socket(); s.bind(({self.host!r}, 0)); "
        code += "print(s.getsockname()[1])"
        out = subprocess.run(
            [*self.prefix, sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        return int(out.stdout.strip())


LOCAL = Remote()


def _accepts(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        try:
            s.connect((host, port))
        except OSError:
            return False
        return True


def _tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


def _stop(proc: subprocess.Popen | None, timeout_s: float = 10.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """Send fd 2 to `path` for a while (native libraries log there, glog's noise included)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(path, "ab") as f:
            os.dup2(f.fileno(), 2)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


# ------------------------------------------------------------------------------------------------
# Redis


class RedisBaseline:
    """redis-server on a free loopback port (no persistence), redis-py + hiredis.

    put = MSET, get = MGET, exists = a non-transactional pipeline of EXISTS (one per key),
    delete = DEL. Redis refuses bulk strings over 512 MB (proto-max-bulk-len) and commands over
    1 GB (client-query-buffer-limit): a batch call must stay under 1 GB."""

    name = "redis"

    def __init__(self, server: str | None = None, where: Remote = LOCAL) -> None:
        self.where = where
        server = server or shutil.which("redis-server") or "/usr/bin/redis-server"
        if not os.access(server, os.X_OK):
            raise Skip("redis-server not found (apt-get install redis-server)")
        try:
            import redis
            from redis.utils import HIREDIS_AVAILABLE
        except ImportError as e:
            raise Skip(f"redis-py not importable: {e}; pip install redis hiredis") from e
        if not HIREDIS_AVAILABLE:
            raise Skip(
                "hiredis not importable (pip install hiredis): without it redis-py's "
                "pure-Python parser would understate Redis"
            )
        self._proc: subprocess.Popen | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="bench-kv-redis-"))
        version = subprocess.run([server, "--version"], capture_output=True, text=True).stdout
        self.info: dict[str, Any] = {
            "server": f"{server} --save '' --appendonly no",
            "version": version.split()[2].removeprefix("v=") if version.count(" ") >= 2 else "?",
            "redis_py": redis.__version__,
            "parser": "hiredis",
            "put": "MSET",
            "get": "MGET",
            "exists": "pipeline(transaction=False) of EXISTS, one per key",
        }
        try:
            self._start(server, redis)
        except BaseException:
            self.close()
            raise

    def _start(self, server: str, redis: Any) -> None:
        last = ""
        for _attempt in range(3):  # the free port may be taken between probe and bind
            port = self.where.free_port()
            log = self._dir / "redis.log"
            self._proc = subprocess.Popen(
                [
                    *self.where.prefix,
                    server,
                    "--bind",
                    self.where.host,
                    "--port",
                    str(port),
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--protected-mode",
                    "no",
                    "--dir",
                    str(self._dir),
                    "--logfile",
                    str(log),
                    "--loglevel",
                    "warning",
                ],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            client = redis.Redis(host=self.where.host, port=port, socket_timeout=120)
            deadline = time.monotonic() + START_TIMEOUT_S
            while time.monotonic() < deadline and self._proc.poll() is None:
                try:
                    client.ping()
                except redis.ConnectionError:
                    time.sleep(0.05)
                    continue
                self.port = port
                self.info["port"] = port
                self._client = client
                return
            last = f"exit {self._proc.poll()}: {_tail(log)}"
            _stop(self._proc)
        raise RuntimeError(f"redis-server did not answer PING ({last})")

    def put_batch(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        self._client.mset(dict(zip(keys, values)))

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        values = self._client.mget(keys)
        if None in values:
            raise KeyError([k for k, v in zip(keys, values) if v is None][:5])
        return values

    def exists_batch(self, keys: Sequence[str]) -> list[bool]:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return [bool(n) for n in pipe.execute()]

    def delete_batch(self, keys: Sequence[str]) -> None:
        self._client.delete(*keys)

    def close(self) -> None:
        client = getattr(self, "_client", None)
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
            self._client = None
        _stop(self._proc)
        self._proc = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisBaseline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------------------
# Mooncake Store


def _mooncake_master_binary() -> str:
    """The real mooncake_master inside the wheel (the console script only exec()s it)."""
    import importlib.util

    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.submodule_search_locations:
        for d in spec.submodule_search_locations:
            path = os.path.join(d, "mooncake_master")
            if os.path.isfile(path):
                if not os.access(path, os.X_OK):
                    raise Skip(f"{path} is not executable")
                return path
    found = shutil.which("mooncake_master")
    if found:
        return found
    raise Skip("mooncake_master not found; pip install mooncake-transfer-engine-non-cuda")


def _mooncake_setup(
    store: Any, metadata: str, master: str, segment: int, local_buf: int, host: str = LOOPBACK
) -> int:
    return int(store.setup(host, metadata, segment, local_buf, "tcp", "", master))


def mooncake_segment_child(a: dict[str, Any]) -> None:
    """The storage process: a client that mounts the global segment, then waits for stdin EOF."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = _mooncake_setup(
        store, a["metadata"], a["master"], a["segment_bytes"], 16 * MIB, a.get("host", LOOPBACK)
    )
    sys.stdout.write(json.dumps({"rc": rc}) + "\n")
    sys.stdout.flush()
    if rc != 0:
        return
    with contextlib.suppress(Exception):
        sys.stdin.read()
    store.close()


class MooncakeStoreBaseline:
    """Mooncake Store over TCP on loopback: mooncake_master (embedded HTTP metadata server), a
    storage process holding the global segment (remote_segment=True) and this process's
    MooncakeDistributedStore client.

    put = put_batch (one rc for the batch), get = get_batch (b"" for a missing key), exists =
    batch_is_exist (1 / 0 / -1 per key), delete = batch_remove(force=True) (without force, keys
    are leased for --default_kv_lease_ttl, 10 s). Every put or get stages the whole batch in
    the client's registered local buffer, so `max_batch_bytes` sizes it; `segment_bytes` must
    hold a whole cell (the master evicts above 90 % of it)."""

    def __init__(
        self,
        segment_bytes: int = 3 * GIB // 2,
        max_batch_bytes: int = 512 * MIB,
        remote_segment: bool = True,
        where: Remote = LOCAL,
    ) -> None:
        self.name = "mooncake-store" if remote_segment else "mooncake-local"
        self.where = where
        os.environ.setdefault("GLOG_minloglevel", "1")  # read when the library loads: no INFO
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            hint = " (apt-get install libibverbs1)" if "libibverbs" in str(e) else ""
            raise Skip(
                f"mooncake.store not importable: {e}{hint}; "
                "pip install mooncake-transfer-engine-non-cuda"
            ) from e
        master_bin = _mooncake_master_binary()
        self._dir = Path(tempfile.mkdtemp(prefix="bench-kv-mooncake-"))
        self._master: subprocess.Popen | None = None
        self._segment: subprocess.Popen | None = None
        self._store: Any = None
        self.segment_bytes = segment_bytes
        self.local_buffer_bytes = max_batch_bytes + 16 * MIB
        version = "?"
        with contextlib.suppress(Exception):
            from importlib.metadata import version as _version

            version = _version("mooncake-transfer-engine-non-cuda")
        self.info: dict[str, Any] = {
            "package": f"mooncake-transfer-engine-non-cuda {version}",
            "master": "mooncake_master --enable_http_metadata_server=true "
            + ("(loopback)" if where == LOCAL else f"({where.host})"),
            "protocol": "tcp",
            "segment": "separate storage process" if remote_segment else "this process",
            "segment_bytes": segment_bytes,
            "local_buffer_bytes": self.local_buffer_bytes,
            "put": "put_batch",
            "get": "get_batch",
            "exists": "batch_is_exist",
        }
        try:
            self._start(master_bin, MooncakeDistributedStore, remote_segment)
        except BaseException:
            self.close()
            raise

    def _start(self, master_bin: str, store_cls: Any, remote_segment: bool) -> None:
        level = os.environ.get("GLOG_minloglevel", "1")  # noqa: SIM112 (glog's spelling)
        env = {**os.environ, "GLOG_minloglevel": level}
        log = self._dir / "master.log"
        last = ""
        host = self.where.host
        for _attempt in range(3):
            rpc, http, metrics = (self.where.free_port() for _ in range(3))
            with open(log, "ab") as out:  # the child keeps its own copy of the descriptor
                self._master = subprocess.Popen(
                    [
                        *self.where.prefix,
                        master_bin,
                        f"--rpc_address={host}",
                        f"--rpc_port={rpc}",
                        "--enable_http_metadata_server=true",
                        f"--http_metadata_server_host={host}",
                        f"--http_metadata_server_port={http}",
                        f"--metrics_host={host}",
                        f"--metrics_port={metrics}",
                        "--logtostderr",
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            deadline = time.monotonic() + START_TIMEOUT_S
            while time.monotonic() < deadline and self._master.poll() is None:
                if _accepts(host, rpc) and _accepts(host, http):
                    break
                time.sleep(0.05)
            if self._master.poll() is None and _accepts(host, rpc):
                break
            last = f"exit {self._master.poll()}: {_tail(log)}"
            _stop(self._master)
            self._master = None
        else:
            raise RuntimeError(f"mooncake_master did not start ({last})")
        metadata = f"http://{host}:{http}/metadata"
        master = f"{host}:{rpc}"
        self.info.update(master_rpc_port=rpc, metadata_server=metadata)

        if remote_segment:
            seg_log = self._dir / "segment.log"
            args = {
                "metadata": metadata,
                "master": master,
                "segment_bytes": self.segment_bytes,
                "host": host,
            }
            with open(seg_log, "ab") as err:
                self._segment = subprocess.Popen(
                    [
                        *self.where.prefix,
                        sys.executable,
                        os.path.abspath(__file__),
                        "--mooncake-segment-child",
                        json.dumps(args),
                    ],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=err,
                    env=env,
                    text=True,
                )
            assert self._segment.stdout is not None
            ready, _, _ = select.select([self._segment.stdout], [], [], START_TIMEOUT_S)
            line = self._segment.stdout.readline() if ready else ""
            try:
                rc = json.loads(line)["rc"]
            except (ValueError, KeyError):
                rc = None
            if rc != 0:
                raise RuntimeError(f"Mooncake storage process: setup rc={rc} ({_tail(seg_log)})")
        store = store_cls()
        client_log = self._dir / "client.log"
        with _stderr_to(client_log):  # glog writes straight to fd 2
            rc = _mooncake_setup(
                store,
                metadata,
                master,
                0 if remote_segment else self.segment_bytes,
                self.local_buffer_bytes,
                self.where.client_host,
            )
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup rc={rc} ({_tail(client_log)})")
        self._store = store

    def put_batch(self, keys: Sequence[str], values: Sequence[bytes]) -> None:
        rc = self._store.put_batch(list(keys), list(values))
        if rc != 0:
            raise RuntimeError(f"Mooncake put_batch of {len(keys)} keys returned {rc}")

    def get_batch(self, keys: Sequence[str]) -> list[bytes]:
        values = self._store.get_batch(list(keys))
        if b"" in values:
            raise KeyError([k for k, v in zip(keys, values) if not v][:5])
        return values

    def exists_batch(self, keys: Sequence[str]) -> list[bool]:
        found = self._store.batch_is_exist(list(keys))
        if -1 in found:
            raise RuntimeError(f"Mooncake batch_is_exist failed for {found.count(-1)} keys")
        return [n == 1 for n in found]

    def delete_batch(self, keys: Sequence[str]) -> None:
        self._store.batch_remove(list(keys), force=True)

    def close(self) -> None:
        if self._store is not None:
            with contextlib.suppress(Exception), _stderr_to(self._dir / "client.log"):
                self._store.close()
            self._store = None
        if self._segment is not None:
            with contextlib.suppress(Exception):
                assert self._segment.stdin is not None
                self._segment.stdin.close()
            try:
                self._segment.wait(10)
            except subprocess.TimeoutExpired:
                _stop(self._segment)
            self._segment = None
        _stop(self._master)
        self._master = None
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> MooncakeStoreBaseline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------------------
# the grid


SYSTEMS = ("redis", "mooncake-store", "mooncake-local")


def grid_needs(
    sizes: Sequence[int], batches: Sequence[int], total_bytes_target: int, max_ops: int
) -> tuple[int, int]:
    """(largest batch call in bytes, most bytes one cell stores at once) over the grid."""
    max_batch = max(s * b for s in sizes for b in batches)
    max_cell = max(
        plan(s, b, total_bytes_target, max_ops).stored_bytes(s, b) for s in sizes for b in batches
    )
    return max_batch, max_cell


def make_baseline(
    name: str,
    sizes: Sequence[int],
    batches: Sequence[int],
    total_bytes_target: int,
    max_ops: int,
    where: Remote = LOCAL,
) -> Any:
    """Start one baseline, sized for the grid, its servers `where` told. Raises Skip when it
    cannot run here."""
    if name == "redis":
        return RedisBaseline(where=where)
    max_batch, max_cell = grid_needs(sizes, batches, total_bytes_target, max_ops)
    segment = int(max_cell / 0.8) + 64 * MIB  # the master evicts above 90 % of the segment
    return MooncakeStoreBaseline(
        segment_bytes=segment,
        max_batch_bytes=max_batch,
        remote_segment=name != "mooncake-local",
        where=where,
    )


def run_grid(
    baseline: Any,
    sizes: Sequence[int],
    batches: Sequence[int],
    total_bytes_target: int = TOTAL_BYTES_TARGET,
    max_ops: int = MAX_OPS,
) -> list[dict[str, Any]]:
    cells = []
    for size in sizes:
        for batch in batches:
            prepare = getattr(baseline, "prepare", None)  # untimed per-cell set-up, if any
            if prepare is not None:
                prepare(size, batch)
            try:
                cell = measure(
                    baseline.put_batch,
                    baseline.get_batch,
                    baseline.exists_batch,
                    size,
                    batch,
                    total_bytes_target,
                    max_ops,
                    delete_batch=getattr(baseline, "delete_batch", None),
                )
            except WrongValue:
                raise
            except Exception as e:
                cell = {"page_bytes": size, "batch": batch, "error": f"{type(e).__name__}: {e}"}
            cells.append(cell)
    return cells


def run_interleaved(
    systems: dict[str, Any],
    sizes: Sequence[int],
    batches: Sequence[int],
    total_bytes_target: int = TOTAL_BYTES_TARGET,
    max_ops: int = MAX_OPS,
) -> dict[str, list[dict[str, Any]]]:
    """run_grid for several systems at once, cell by cell: every system measures a cell before
    any goes on to the next, in an order rotated each cell, so a noisy minute of the host hits
    all of them instead of one. Returns each system's cells."""
    cells: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
    names = list(systems)
    for i, (size, batch) in enumerate((s, b) for s in sizes for b in batches):
        for name in names[i % len(names) :] + names[: i % len(names)] if names else []:
            cells[name] += run_grid(systems[name], [size], [batch], total_bytes_target, max_ops)
    return cells


def meta_info() -> dict[str, Any]:
    now = _dt.datetime.now(_dt.timezone.utc)
    return {
        "date": now.strftime("%Y-%m-%d"),
        "time_utc": now.isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def fmt_size(n: int) -> str:
    if n >= MIB and n % MIB == 0:
        return f"{n // MIB} MiB"
    if n >= KIB and n % KIB == 0:
        return f"{n // KIB} KiB"
    return f"{n} B"


def _f(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def human(report: dict[str, Any]) -> str:
    lines = [
        f"KV pages, {report.get('path', 'loopback')}: GB/s = 1e9 B/s over the sum of call "
        "times; latency per batch call (ms); exists in k keys/s",
        f"{'system':<15} {'page':>7} {'batch':>5} {'calls':>5} | {'put GB/s':>8} {'p50':>7} "
        f"{'p99':>7} | {'get GB/s':>8} {'p50':>7} {'p99':>7} | {'exists k/s':>10} {'p50':>7} "
        f"{'p99':>7}",
    ]
    for name, res in report["systems"].items():
        if "skipped" in res or "error" in res:
            lines.append(
                f"{name:<15} {'skipped' if 'skipped' in res else 'error'}: "
                f"{res.get('skipped') or res.get('error')}"
            )
            continue
        for c in res["cells"]:
            head = f"{name:<15} {fmt_size(c['page_bytes']):>7} {c['batch']:>5}"
            if "error" in c:
                lines.append(f"{head} error: {c['error']}")
                continue
            put, get, ex = c["put"], c["get"], c["exists"]
            lines.append(
                f"{head} {c['calls']:>5} | {_f(put['gbps']):>8} {_f(put['p50_ms'], 3):>7} "
                f"{_f(put['p99_ms'], 3):>7} | {_f(get['gbps']):>8} {_f(get['p50_ms'], 3):>7} "
                f"{_f(get['p99_ms'], 3):>7} | {_f(ex['pages_per_s'] / 1e3, 1):>10} "
                f"{_f(ex['p50_ms'], 3):>7} {_f(ex['p99_ms'], 3):>7}"
            )
        lines.append(f"{name:<15} ({json.dumps(res['info'])})")
    return "\n".join(lines)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from e
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"need positive integers: {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--sizes", type=_int_list, default=list(PAGE_SIZES), help="comma list of page sizes, bytes"
    )
    ap.add_argument(
        "--batches", type=_int_list, default=list(BATCHES), help="comma list of pages per call"
    )
    ap.add_argument(
        "--systems",
        default="redis,mooncake-store",
        help=f"comma list of {', '.join(SYSTEMS)} (default redis,mooncake-store)",
    )
    ap.add_argument(
        "--total-mib",
        type=int,
        default=TOTAL_BYTES_TARGET // MIB,
        help="timed data per cell and op kind, MiB (at least one batch call)",
    )
    ap.add_argument("--max-ops", type=int, default=MAX_OPS, help="most timed batch calls per cell")
    ap.add_argument("--json-out", type=Path, help="also write the JSON document here")
    ap.add_argument("--mooncake-segment-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.mooncake_segment_child:
        mooncake_segment_child(json.loads(args.mooncake_segment_child))
        return 0
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if set(systems) - set(SYSTEMS):
        ap.error(f"--systems: unknown {sorted(set(systems) - set(SYSTEMS))}")
    total = args.total_mib * MIB
    started = time.monotonic()
    report: dict[str, Any] = {
        "bench": "kv_baselines",
        "meta": meta_info(),
        "sizes": args.sizes,
        "batches": args.batches,
        "total_bytes_target": total,
        "max_ops": args.max_ops,
        "systems": {},
    }
    for name in systems:
        t0 = time.monotonic()
        try:
            baseline = make_baseline(name, args.sizes, args.batches, total, args.max_ops)
        except Skip as e:
            report["systems"][name] = {"skipped": e.reason}
            continue
        except Exception as e:
            report["systems"][name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        try:
            cells = run_grid(baseline, args.sizes, args.batches, total, args.max_ops)
        finally:
            baseline.close()
        report["systems"][name] = {
            "info": baseline.info,
            "cells": cells,
            "wall_s": round(time.monotonic() - t0, 2),
        }
    report["meta"]["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
    report["total_s"] = round(time.monotonic() - started, 1)
    doc = json.dumps(report)
    print(doc)
    if args.json_out:
        args.json_out.write_text(doc + "\n")
    print(human(report))
    print(f"\n(total {report['total_s']}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
