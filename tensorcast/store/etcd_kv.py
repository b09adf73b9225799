"""etcd v3 for the Global Store: JSON records under one key prefix, endpoint failover, and
optimistic transactions (read, decide, commit only if nothing read has changed).

Talks to etcd's gRPC gateway (HTTP/JSON, `etcd3gw`), which every etcd v3.4+ serves on its client
port. Every call is bounded by a timeout; an endpoint that cannot be reached is skipped for the
next one. etcd itself (Raft) makes each committed transaction durable and linearizable.
"""

from __future__ import annotations

import base64
import json
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, TypeVar

from tensorcast.config import TLSFiles, parse_host_port
from tensorcast.errors import InvalidArgument, ResourceExhausted, Unavailable

T = TypeVar("T")

MAX_TXN_OPS = 100  # etcd refuses transactions of more than 128 operations (--max-txn-ops)
CONFLICT_ATTEMPTS = 32
RANGE_PAGE = 5000
HEALTH_TIMEOUT_S = 1.0
HEALTH_CACHE_S = 2.0


class Conflict(Exception):
    """A transaction's comparison failed: something it read changed meanwhile. Retry."""


@dataclass(frozen=True)
class Item:
    value: Any  # the decoded JSON record
    mod_revision: int


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode()


def _raise_final(detail: str) -> None:
    """Errors every member would answer the same: no point trying the next one."""
    if "database space exceeded" in detail:
        raise ResourceExhausted(
            "the etcd cluster is out of space (its --quota-backend-bytes): compact and "
            "defragment it (etcdctl compact, etcdctl defrag), then etcdctl alarm disarm"
        )
    if "request is too large" in detail or "received message larger than max" in detail:
        raise InvalidArgument(
            "a Global Store record is larger than etcd takes in one request "
            "(its --max-request-bytes): " + detail[:200]
        )


def _range_end(prefix: str) -> str:
    """The first key after every key starting with `prefix`."""
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return base64.b64encode(bytes(raw)).decode()


class EtcdKV:
    def __init__(
        self,
        endpoints: list[str],
        prefix: str = "/tensorcast/",
        timeout_s: float = 5.0,
        tls: TLSFiles | None = None,
    ) -> None:
        from etcd3gw.client import Etcd3Client

        if not endpoints:
            raise InvalidArgument("--etcd-endpoints: name at least one HOST:PORT")
        self.endpoints = endpoints
        self.prefix = prefix
        self._health_lock = threading.Lock()
        self._health: tuple[float, list[tuple[str, bool, str]]] = (float("-inf"), [])
        self._clients = []
        for endpoint in endpoints:
            host, port = parse_host_port(endpoint)
            if port == 0:
                raise InvalidArgument(f"bad etcd endpoint {endpoint!r}: use HOST:PORT")
            self._clients.append(
                Etcd3Client(
                    host=host,
                    port=port,
                    protocol="https" if tls else "http",
                    ca_cert=tls.ca if tls else None,
                    cert_cert=(tls.cert or None) if tls else None,
                    cert_key=(tls.key or None) if tls else None,
                    timeout=timeout_s,
                    api_path="/v3/",
                )
            )
        self._current = 0

    def describe(self) -> str:
        return "etcd://" + ",".join(self.endpoints) + self.prefix

    # -- transport ------------------------------------------------------------------------------

    def _post(self, path: str, body: dict) -> dict:
        """POST to the first endpoint that answers (the last one that did is tried first)."""
        from etcd3gw import exceptions

        errors = []
        for i in range(len(self._clients)):
            k = (self._current + i) % len(self._clients)
            client = self._clients[k]
            try:
                reply = client.post(client.get_url(path), json=body)
            except (exceptions.ConnectionFailedError, exceptions.ConnectionTimeoutError) as e:
                errors.append(f"{self.endpoints[k]}: {str(e)[:200]}")
                continue
            except exceptions.Etcd3Exception as e:
                _raise_final(e.detail_text or "")
                # A member without a quorum or leader answers with an error: try another.
                errors.append(f"{self.endpoints[k]}: {str(e)[:200]} {(e.detail_text or '')[:200]}")
                continue
            self._current = k
            return reply
        raise Unavailable("no etcd endpoint answered: " + "; ".join(errors))

    def compact(self, keep_revisions: int) -> int:
        """Forget the history of every key but its last `keep_revisions` revisions: etcd keeps
        every revision until compacted and stops taking writes at its space quota (heartbeats
        alone write ~15 revisions a second). Returns the revision compacted to, 0 if none."""
        reply = self._post("/kv/range", {"key": _b64(self.prefix), "keys_only": True, "limit": 1})
        target = int(reply["header"]["revision"]) - keep_revisions
        if target <= 0:
            return 0
        try:
            self._post("/kv/compaction", {"revision": target})
        except Unavailable as e:
            if "compacted" in str(e):  # another store compacted as far or further
                return 0
            raise
        return target

    # -- reads ----------------------------------------------------------------------------------

    def get(self, key: str) -> Item | None:
        reply = self._post("/kv/range", {"key": _b64(self.prefix + key)})
        kvs = reply.get("kvs") or []
        return self._item(kvs[0]) if kvs else None

    def range(self, prefix: str, keys_only: bool = False) -> dict[str, Item]:
        """Every record whose key starts with `prefix` (keys without the store's prefix)."""
        items: dict[str, Item] = {}
        start = _b64(self.prefix + prefix)
        end = _range_end(self.prefix + prefix)
        while True:
            body = {"key": start, "range_end": end, "limit": RANGE_PAGE, "keys_only": keys_only}
            reply = self._post("/kv/range", body)
            kvs = reply.get("kvs") or []
            for kv in kvs:
                key = _unb64(kv["key"])[len(self.prefix) :]
                items[key] = Item(None, int(kv["mod_revision"])) if keys_only else self._item(kv)
            if not reply.get("more"):
                return items
            last = base64.b64decode(kvs[-1]["key"]) + b"\x00"
            start = base64.b64encode(last).decode()

    def read_many(
        self,
        keys: list[str],
        prefixes: list[str] = (),  # type: ignore[assignment]
    ) -> tuple[dict[str, Item | None], dict[str, dict[str, Item]]]:
        """Many records in few requests: each read-only transaction carries up to MAX_TXN_OPS
        reads, all at one revision (records read by different requests may be from different
        revisions; callers that decide on them commit with comparisons). Returns the records of
        `keys` (None when absent) and, per prefix, every record under it."""
        wanted = [(k, False) for k in dict.fromkeys(keys)]
        wanted += [(p, True) for p in dict.fromkeys(prefixes)]
        got: dict[str, Item | None] = {}
        ranges: dict[str, dict[str, Item]] = {}
        for start in range(0, len(wanted), MAX_TXN_OPS):
            part = wanted[start : start + MAX_TXN_OPS]
            reads = []
            for key, is_prefix in part:
                body = {"key": _b64(self.prefix + key)}
                if is_prefix:
                    body["range_end"] = _range_end(self.prefix + key)
                reads.append({"request_range": body})
            reply = self._post("/kv/txn", {"compare": [], "success": reads})
            for (key, is_prefix), response in zip(part, reply.get("responses") or []):
                found = (response.get("response_range") or {}).get("kvs") or []
                if is_prefix:
                    if (response.get("response_range") or {}).get("more"):
                        ranges[key] = self.range(key)  # larger than one reply: read it whole
                    else:
                        ranges[key] = {
                            _unb64(kv["key"])[len(self.prefix) :]: self._item(kv) for kv in found
                        }
                else:
                    got[key] = self._item(found[0]) if found else None
        return got, ranges

    def range_page(self, prefix: str, start: str, limit: int) -> tuple[dict[str, Item], bool]:
        """Up to `limit` records under `prefix` whose key (without the store's prefix) is >=
        `start`, in key order; and whether more follow."""
        body = {
            "key": _b64(self.prefix + max(start, prefix)),
            "range_end": _range_end(self.prefix + prefix),
            "limit": limit,
        }
        reply = self._post("/kv/range", body)
        items = {
            _unb64(kv["key"])[len(self.prefix) :]: self._item(kv) for kv in reply.get("kvs") or []
        }
        return items, bool(reply.get("more"))

    def count(self, prefix: str) -> int:
        body = {
            "key": _b64(self.prefix + prefix),
            "range_end": _range_end(self.prefix + prefix),
            "count_only": True,
        }
        return int(self._post("/kv/range", body).get("count", 0))

    @staticmethod
    def _item(kv: dict) -> Item:
        return Item(json.loads(_unb64(kv.get("value", ""))), int(kv["mod_revision"]))

    # -- writes ---------------------------------------------------------------------------------

    def unchanged(self, key: str, item: Item | None) -> dict:
        """A comparison: `key` is as read (absent if `item` is None)."""
        if item is None:
            return {
                "key": _b64(self.prefix + key),
                "target": "CREATE",
                "result": "EQUAL",
                "create_revision": 0,
            }
        return {
            "key": _b64(self.prefix + key),
            "target": "MOD",
            "result": "EQUAL",
            "mod_revision": item.mod_revision,
        }

    def exists(self, key: str) -> dict:
        return {
            "key": _b64(self.prefix + key),
            "target": "CREATE",
            "result": "GREATER",
            "create_revision": 0,
        }

    def put(self, key: str, value: Any) -> dict:
        return {
            "request_put": {
                "key": _b64(self.prefix + key),
                "value": _b64(json.dumps(value, separators=(",", ":"))),
            }
        }

    def delete(self, key: str) -> dict:
        return {"request_delete_range": {"key": _b64(self.prefix + key)}}

    def txn(self, compares: list[dict], ops: list[dict]) -> None:
        """Apply `ops` atomically if every comparison holds, else raise Conflict."""
        if len(compares) + len(ops) > MAX_TXN_OPS:
            raise InvalidArgument(f"one etcd transaction holds at most {MAX_TXN_OPS} operations")
        reply = self._post("/kv/txn", {"compare": compares, "success": ops})
        if not reply.get("succeeded"):
            raise Conflict()

    def apply(self, ops: list[dict]) -> None:
        """Unconditional operations, in transactions of at most MAX_TXN_OPS (each atomic, the
        whole not): for idempotent bookkeeping such as replica rows of a heartbeat."""
        for start in range(0, len(ops), MAX_TXN_OPS):
            self.txn([], ops[start : start + MAX_TXN_OPS])

    def optimistic(self, attempt: Callable[[], T]) -> T:
        """Run `attempt` (reads, then one `txn`) until it commits without a Conflict; bounded,
        with jittered backoff between tries."""
        for i in range(CONFLICT_ATTEMPTS):
            try:
                return attempt()
            except Conflict:
                time.sleep(random.uniform(0, min(0.05, 0.001 * 2**i)))
        raise Unavailable(
            f"the Global Store is too contended: {CONFLICT_ATTEMPTS} tries conflicted"
        )

    def member_health(self) -> list[tuple[str, bool, str]]:
        """(endpoint, healthy, detail) of every configured endpoint, asked all at once and
        each given HEALTH_TIMEOUT_S (the store's Status, which every new client calls, waited
        5 s for each silent member in turn); remembered for HEALTH_CACHE_S."""
        with self._health_lock:
            cached_at, cached = self._health
            if time.monotonic() - cached_at < HEALTH_CACHE_S:
                return cached

        def ask(client: Any) -> str:
            return f"leader {client.status()['leader']}"

        pool = ThreadPoolExecutor(max_workers=len(self._clients))
        asked = [pool.submit(ask, client) for client in self._clients]
        pool.shutdown(wait=False)  # a silent member's thread ends at its own timeout
        done, _ = wait(asked, timeout=HEALTH_TIMEOUT_S)
        out = []
        for endpoint, future in zip(self.endpoints, asked):
            if future not in done:
                out.append((endpoint, False, f"no answer within {HEALTH_TIMEOUT_S:.0f}s"))
            elif future.exception() is not None:  # an unhealthy member is reported, not raised
                out.append((endpoint, False, str(future.exception())[:200]))
            else:
                out.append((endpoint, True, future.result()))
        with self._health_lock:
            self._health = (time.monotonic(), out)
        return out
