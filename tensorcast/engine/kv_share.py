"""Shared prefix stores for the emulated engine: instances that miss a prefix locally look its
blocks up in a store every instance writes to (what SGLang's HiCache storage backends and
Mooncake's KV store do for real engines).

Three backends, one interface (`KVStore`):
  tensorcast  TensorCast KV pages (`rt.pages()`: shard homes, same-host shared memory, leased
              with a TTL)
  redis       a Redis server (`redis://HOST:PORT`; size it with maxmemory + an LRU policy)
  mooncake    Mooncake Store (`mooncake_master` + `MooncakeDistributedStore` over TCP; each
              instance mounts a segment of `segment_bytes`)

Reads happen on the request's thread (their time is the request's time). Writes go through a
bounded queue to one writer thread: a full queue drops the write (the store is a cache), so a
slow store never stalls the engine's scheduler.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Sequence
from typing import Any

from tensorcast.errors import InvalidArgument, Unavailable

log = logging.getLogger("tensorcast.engine.kv_share")

MAX_QUEUED_WRITES = 256  # batches
MAX_BATCH = 512  # keys per store call


class KVStore:
    """exists/get read synchronously; put_async queues. Subclasses implement the _ methods."""

    name = "?"

    def __init__(self) -> None:
        self._writes: queue.Queue[dict[str, bytes] | None] = queue.Queue(MAX_QUEUED_WRITES)
        self._writer = threading.Thread(target=self._write_loop, name="kv-share", daemon=True)
        self._writer.start()
        self.dropped_writes = 0
        self.put_bytes = 0

    def exists(self, keys: Sequence[str]) -> list[bool]:
        out: list[bool] = []
        for start in range(0, len(keys), MAX_BATCH):
            out.extend(self._exists(list(keys[start : start + MAX_BATCH])))
        return out

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for start in range(0, len(keys), MAX_BATCH):
            out.extend(self._get(list(keys[start : start + MAX_BATCH])))
        return out

    def put_async(self, items: dict[str, bytes]) -> None:
        try:
            self._writes.put_nowait(items)
        except queue.Full:
            self.dropped_writes += len(items)

    def _write_loop(self) -> None:
        while True:
            items = self._writes.get()
            if items is None:
                return
            keys = list(items)
            try:
                for start in range(0, len(keys), MAX_BATCH):
                    part = keys[start : start + MAX_BATCH]
                    self._put({k: items[k] for k in part})
                    self.put_bytes += sum(len(items[k]) for k in part)
            except Exception as e:  # a cache write that fails is dropped, never fatal
                log.warning("shared KV store %s: put failed: %s", self.name, e)

    def close(self) -> None:
        with contextlib.suppress(queue.Full):
            self._writes.put(None, timeout=1.0)
        self._writer.join(timeout=5)

    def _exists(self, keys: list[str]) -> list[bool]:
        raise NotImplementedError

    def _get(self, keys: list[str]) -> list[bytes | None]:
        raise NotImplementedError

    def _put(self, items: dict[str, bytes]) -> None:
        raise NotImplementedError


class TensorCastKVStore(KVStore):
    """Blocks as TensorCast KV pages (U8), leased for `ttl_s`, under `prefix` (instances share
    what they write under the same prefix; a benchmark gives each run its own, so that a run
    never reads what an earlier run of the same workload left in the cluster)."""

    name = "tensorcast"

    def __init__(self, rt: Any, ttl_s: float = 600.0, prefix: str = "") -> None:
        self.pages = rt.pages()
        self.ttl_s = ttl_s
        self.prefix = prefix
        super().__init__()

    def _exists(self, keys: list[str]) -> list[bool]:
        return list(self.pages.exists_pages([self.prefix + k for k in keys]))

    def _get(self, keys: list[str]) -> list[bytes | None]:
        pages = self.pages.get_pages([self.prefix + k for k in keys])
        return [None if p is None else bytes(p.data) for p in pages]

    def _put(self, items: dict[str, bytes]) -> None:
        self.pages.put_pages({self.prefix + k: v for k, v in items.items()}, self.ttl_s)


class RedisKVStore(KVStore):
    name = "redis"

    def __init__(self, url: str) -> None:
        try:
            import redis
        except ImportError as e:
            raise Unavailable("the redis package is missing: scripts/install-baselines.sh") from e
        self.client = redis.Redis.from_url(url, socket_timeout=10)
        self.client.ping()
        super().__init__()

    def _exists(self, keys: list[str]) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return [bool(n) for n in pipe.execute()]

    def _get(self, keys: list[str]) -> list[bytes | None]:
        return list(self.client.mget(keys))  # type: ignore[arg-type]

    def _put(self, items: dict[str, bytes]) -> None:
        self.client.mset(items)  # type: ignore[arg-type]


class MooncakeKVStore(KVStore):
    """Mooncake Store over TCP; this instance mounts `segment_bytes` of the global pool."""

    name = "mooncake"

    def __init__(
        self,
        master: str,
        metadata: str,
        segment_bytes: int = 256 << 20,
        local_buffer_bytes: int = 64 << 20,
        hostname: str = "127.0.0.1",
    ) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise Unavailable(
                f"mooncake.store is not importable ({e}): scripts/install-baselines.sh"
            ) from e
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(
            hostname, metadata, segment_bytes, local_buffer_bytes, "tcp", "", master
        )
        if rc != 0:
            raise Unavailable(f"Mooncake Store setup returned {rc} (master {master})")
        super().__init__()

    def _exists(self, keys: list[str]) -> list[bool]:
        return [n == 1 for n in self.store.batch_is_exist(keys)]

    def _get(self, keys: list[str]) -> list[bytes | None]:
        return [v or None for v in self.store.get_batch(keys)]

    def _put(self, items: dict[str, bytes]) -> None:
        rc = self.store.put_batch(list(items), list(items.values()))
        if rc != 0:
            raise Unavailable(f"Mooncake put_batch returned {rc}")

    def close(self) -> None:
        super().close()
        with contextlib.suppress(Exception):
            self.store.close()


def _query(query: str) -> dict[str, str]:
    return dict(p.split("=", 1) for p in query.split("&") if "=" in p)


def open_store(spec: str, rt: Any = None) -> KVStore | None:
    """`none`, `tensorcast` (`tensorcast?prefix=P`: keys under P), `redis://HOST:PORT`, or
    `mooncake://MASTER?metadata=URL` (also `&segment_bytes=N`, `&hostname=IP`: the address
    this instance serves its segment on)."""
    if spec in ("", "none"):
        return None
    if spec == "tensorcast" or spec.startswith("tensorcast?"):
        if rt is None:
            raise InvalidArgument("the tensorcast shared store needs a cluster runtime")
        params = _query(spec.partition("?")[2])
        return TensorCastKVStore(rt, prefix=params.get("prefix", ""))
    if spec.startswith("redis://"):
        return RedisKVStore(spec)
    if spec.startswith("mooncake://"):
        rest = spec.removeprefix("mooncake://")
        master, _, query = rest.partition("?")
        params = _query(query)
        if "metadata" not in params:
            raise InvalidArgument("mooncake://MASTER?metadata=URL needs the metadata server URL")
        return MooncakeKVStore(
            master,
            params["metadata"],
            int(params.get("segment_bytes", 256 << 20)),
            hostname=params.get("hostname", "127.0.0.1"),
        )
    raise InvalidArgument(
        f"unknown shared KV store {spec!r}: use none, tensorcast, redis://HOST:PORT or "
        "mooncake://MASTER?metadata=URL"
    )
