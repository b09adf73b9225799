"""An emulated inference engine for routing experiments: SGLang-like continuous batching with a
calibrated cost model, a bounded local prefix cache with LRU eviction, and real KV bytes that
leave and enter through the `InstanceAdaptor` contract (so a migration moves real bytes through
TensorCast pages, as with the reference engine).

What is emulated, what is real:
- Compute is emulated: the scheduler works out how long each step would take on the modelled
  engine (`CostModel`) and waits that long divided by `time_scale`. No model runs.
- Everything else is real: requests arrive over HTTP (tensorcast/engine/sglang_api.py), queue,
  batch, hit or miss the prefix cache; every cached block holds `page_tokens *
  kv_bytes_per_token` real bytes (derived from the block's key, so an import can verify them);
  export/import copy those bytes; the optional shared prefix store (tensorcast/engine/kv_share.py)
  moves them over the network. Their time is real time, not divided by `time_scale`.

Scheduling (one thread, like SGLang's scheduler loop; prefill first):
- A request arrives with its full context (token ids). Its cached prefix is the run of leading
  full blocks present in the cache (block keys chain-hash the tokens, as vLLM's prefix caching
  and SGLang's paged radix cache do), extended from the shared store when one is configured.
- Each iteration: if requests wait and the batch has room (`max_running`, and cache blocks for
  the request's prompt and output that no running request holds), run one prefill step of up to
  `max_prefill_tokens` uncached tokens (long prompts are chunked over several steps); the step
  that completes a request's prompt produces its first token (TTFT). Otherwise run decode
  steps: every running request gains one token per step. Decode steps run back to back until a
  request finishes or a new one arrives (then the current step completes first).
- Cost of a prefill step: prefill_base_s + prefill_per_token_s * new tokens +
  prefill_per_context_token_s * (new tokens * tokens already in their contexts) / 1000.
  Cost of a decode step: decode_base_s + decode_per_seq_s * batch +
  decode_per_context_token_s * total context tokens of the batch.
- Cache: `cache_tokens` of KV in blocks of `page_tokens`; blocks of running requests are locked;
  the least recently used unlocked block is evicted when room is needed. A request touches its
  blocks tail first, so a session's tail is evicted before its head (what a radix tree's
  leaf-first eviction does), and the prefix shared by all sessions stays.

A *request* in the adaptor sense (what publish/hydrate/evict name) is a session: the KV cache of
its last context (prompt + output of its last turn), resident while its leading block is cached.
"""

from __future__ import annotations

import hashlib
import math
import random
import threading
import time
import uuid
import zlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from tensorcast.adaptors import InstanceAdaptor, InstanceLoad, KVExport, RequestStat, check_part
from tensorcast.buffer_pool import BufferPool
from tensorcast.errors import (
    AlreadyExists,
    DeadlineExceeded,
    IntegrityError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)

META_FORMAT = 1
ENGINE = "sim"
MAX_WAITING = 4096  # requests queued before new ones are refused (ResourceExhausted)
MAX_SESSIONS = 65536  # session records kept; the least recently active are forgotten first
PAGE_BYTES_TARGET = 256 * 1024  # blocks are grouped into pages of about this size on export
KEY_BYTES = 16
MAX_STAGED = 16  # requests whose KV import is waiting for more parts (see PartStaging)
STAGED_TTL_S = 60.0  # a part waits this long for the rest of its request
EXPORT_BUFFERS_KEPT_BYTES = 256 << 20  # idle export page buffers kept for the next export


@dataclass(frozen=True)
class CostModel:
    """Seconds the modelled engine spends per step (before division by `time_scale`).

    Defaults: fitted by least squares to a small Llama measured on this repository's 2-core
    VM (hidden 512, 8 layers, 8 heads, 2 KV heads, random weights, fp32, transformers eager
    attention; fastest of 5 runs per point, while other work shared the cores):
    `python scripts/bench/calibrate_sim.py` (docs/architecture.md decision 46). About 430
    prefill tokens/s and 20-40 ms per decode step: a slow engine, so fewer sessions load it.
    """

    prefill_base_s: float = 0.0114
    prefill_per_token_s: float = 0.00235
    prefill_per_context_token_s: float = 0.00155  # per (new token x 1000 context tokens)
    decode_base_s: float = 0.0
    decode_per_seq_s: float = 0.00083
    decode_per_context_token_s: float = 0.0000269

    def prefill_s(self, new_tokens: int, context_product: float) -> float:
        """`context_product` = sum over the step's requests of new tokens x their context."""
        return (
            self.prefill_base_s
            + self.prefill_per_token_s * new_tokens
            + self.prefill_per_context_token_s * context_product / 1000.0
        )

    def decode_s(self, batch: int, context_tokens: int) -> float:
        return (
            self.decode_base_s
            + self.decode_per_seq_s * batch
            + self.decode_per_context_token_s * context_tokens
        )


@dataclass(frozen=True)
class SimConfig:
    """The emulated engine's shape. `time_scale` divides every modelled duration (use the
    workload's time compression); `kv_bytes_per_token` sizes the real KV bytes."""

    cost: CostModel = field(default_factory=CostModel)
    page_tokens: int = 32
    kv_bytes_per_token: int = 256
    cache_tokens: int = 262_144
    max_running: int = 64
    max_prefill_tokens: int = 8192
    time_scale: float = 1.0
    vocab: int = 32000
    # A prompt plus its new tokens past this is refused (SGLang's context_length): one huge
    # prompt's prefill would hold every other request of the instance for its whole length.
    max_context_tokens: int = 65536

    def __post_init__(self) -> None:
        for name in (
            "page_tokens",
            "kv_bytes_per_token",
            "cache_tokens",
            "max_running",
            "max_context_tokens",
        ):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise InvalidArgument(f"sim {name} must be an int >= 1, not {value!r}")
        if not _is_int(self.max_prefill_tokens) or self.max_prefill_tokens < self.page_tokens:
            raise InvalidArgument("sim max_prefill_tokens must be an int >= page_tokens")
        if not (self.time_scale > 0) or math.isinf(self.time_scale):
            raise InvalidArgument(f"sim time_scale must be > 0, not {self.time_scale!r}")
        if self.cache_tokens < 4 * self.page_tokens:
            raise InvalidArgument("sim cache_tokens must hold at least 4 pages")
        for f in fields(CostModel):
            value = getattr(self.cost, f.name)
            if not isinstance(value, (int, float)) or value < 0 or math.isinf(value):
                raise InvalidArgument(f"sim cost {f.name} must be a number >= 0, not {value!r}")

    @property
    def block_bytes(self) -> int:
        return self.page_tokens * self.kv_bytes_per_token

    def to_json(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "cost"}
        out["cost"] = {f.name: getattr(self.cost, f.name) for f in fields(CostModel)}
        return out


def block_keys(tokens: list[int], page_tokens: int) -> list[bytes]:
    """Chain hashes of the full blocks of `tokens`: key i names tokens[0 : (i+1) * page_tokens]."""
    keys: list[bytes] = []
    previous = b""
    for start in range(0, len(tokens) - page_tokens + 1, page_tokens):
        digest = hashlib.blake2b(previous, digest_size=KEY_BYTES)
        digest.update(array("I", tokens[start : start + page_tokens]).tobytes())
        previous = digest.digest()
        keys.append(previous)
    return keys


def block_data(key: bytes, size: int) -> bytes:
    """The KV bytes of a block: its key repeated (cheap to make, checkable on import)."""
    reps, rest = divmod(size, len(key))
    return key * reps + key[:rest]


def tokenize(text: str, vocab: int) -> list[int]:
    """The emulator's tokenizer: one token per whitespace-separated word; `t<id>` is token id."""
    ids = []
    for word in text.split():
        if word[:1] == "t" and word[1:].isdigit() and int(word[1:]) < vocab:
            ids.append(int(word[1:]))
        else:
            ids.append(zlib.crc32(word.encode()) % vocab)
    return ids


def detokenize(ids: list[int]) -> str:
    return " ".join(f"t{i}" for i in ids)


class PrefixCache:
    """Blocks by key, least recently used first; locked blocks are never evicted. Not
    thread-safe: the engine's lock guards it.

    Each block lives in a buffer the cache owns; an evicted block's buffer is reused by the
    next insert, like the fixed KV block pool of a real engine. Why: memory this process has
    touched before takes a copy at memory speed, while fresh pages fault one by one (here a
    256 MiB import into new allocations took 0.7 s, into reused buffers 0.03 s)."""

    def __init__(self, capacity_blocks: int, block_bytes: int) -> None:
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self._blocks: OrderedDict[bytes, bytearray] = OrderedDict()
        self._spare: list[bytearray] = []  # buffers of evicted blocks, at most capacity in all
        self._locks: dict[bytes, int] = {}
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def match(self, keys: list[bytes]) -> int:
        n = 0
        for key in keys:
            if key not in self._blocks:
                break
            n += 1
        return n

    def touch(self, keys: list[bytes]) -> None:
        """Most recent: the head. Tail blocks become older than head blocks (evicted first)."""
        for key in reversed(keys):
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def get(self, key: bytes) -> bytearray | None:
        """The block's buffer: valid while the block is locked or the engine's lock is held."""
        return self._blocks.get(key)

    def insert(self, key: bytes, data: Any, room_for: int = 0) -> None:
        """Add a copy of `data` (or refresh the block), evicting unlocked LRU blocks so that
        `room_for` more blocks still fit; may exceed capacity when everything is locked."""
        if key in self._blocks:
            self._blocks.move_to_end(key)
            return
        self.make_room(room_for + 1)  # first, so that the victim's buffer takes the bytes
        if self._spare:
            buffer = self._spare.pop()
            buffer[:] = data
        else:
            buffer = bytearray(data)
        self._blocks[key] = buffer

    def take_buffers(self, n: int) -> list[bytearray]:
        """`n` block buffers to fill outside the engine's lock, then `adopt` or `release`."""
        take = min(n, len(self._spare))
        out = self._spare[len(self._spare) - take :]
        del self._spare[len(self._spare) - take :]
        return out + [bytearray(self.block_bytes) for _ in range(n - take)]

    def adopt(self, key: bytes, buffer: bytearray, room_for: int = 0) -> None:
        """`insert` of a buffer from `take_buffers` holding the block's bytes (no copy)."""
        if key in self._blocks:
            self._blocks.move_to_end(key)
            self.release(buffer)
            return
        self.make_room(room_for + 1)
        self._blocks[key] = buffer

    def release(self, buffer: bytearray) -> None:
        if len(self._blocks) + len(self._spare) < self.capacity_blocks:
            self._spare.append(buffer)

    def make_room(self, room_for: int) -> None:
        excess = len(self._blocks) + room_for - self.capacity_blocks
        if excess <= 0:
            return
        victims = []
        for key in self._blocks:
            if excess <= 0:
                break
            if not self._locks.get(key):
                victims.append(key)
                excess -= 1
        for key in victims:
            self.release(self._blocks.pop(key))
        self.evictions += len(victims)

    def lock(self, keys: list[bytes]) -> None:
        for key in keys:
            self._locks[key] = self._locks.get(key, 0) + 1

    def unlock(self, keys: list[bytes]) -> None:
        for key in keys:
            left = self._locks.get(key, 0) - 1
            if left > 0:
                self._locks[key] = left
            else:
                self._locks.pop(key, None)

    @property
    def locked_blocks(self) -> int:
        return len(self._locks)

    def drop(self, keys: list[bytes]) -> int:
        dropped = 0
        for key in keys:
            if not self._locks.get(key) and key in self._blocks:
                self.release(self._blocks.pop(key))
                dropped += 1
        return dropped

    def clear(self) -> int:
        return self.drop(list(self._blocks))


def _part_pages(pages: int, part: int, parts: int) -> tuple[int, int]:
    """The page range [first, last) of part `part` of `parts`: contiguous, as even as can be."""
    return pages * part // parts, pages * (part + 1) // parts


@dataclass
class _Staged:
    parts: int
    tokens: list[int]
    buffers: dict[int, list[bytearray]]  # part -> its blocks' buffers, filled and checked
    expires: float


class PartStaging:
    """Parts of KV imports waiting for the rest of their request. Bounded: at most
    MAX_STAGED requests, each dropped STAGED_TTL_S after its last part arrived (a migration
    that failed half-way must not hold block buffers for ever). Guarded by the engine's lock."""

    def __init__(self) -> None:
        self._staged: dict[str, _Staged] = {}

    def add(
        self,
        req_id: str,
        part: int,
        parts: int,
        tokens: list[int],
        buffers: list[bytearray],
        release: Any,
    ) -> list[bytearray] | None:
        """File a part; all the request's buffers in block order once every part is in."""
        now = time.monotonic()
        for stale in [r for r, s in self._staged.items() if s.expires < now]:
            self.drop(stale, release)
        staged = self._staged.get(req_id)
        if staged is not None and (staged.parts != parts or staged.tokens != tokens):
            self.drop(req_id, release)  # parts of another attempt (or another context): restart
            staged = None
        if staged is None:
            if len(self._staged) >= MAX_STAGED:
                for buffer in buffers:
                    release(buffer)
                raise ResourceExhausted(f"{MAX_STAGED} KV imports are waiting for parts already")
            staged = self._staged[req_id] = _Staged(parts, tokens, {}, 0.0)
        for buffer in staged.buffers.pop(part, []):  # a part sent again replaces its copy
            release(buffer)
        staged.buffers[part] = buffers
        staged.expires = now + STAGED_TTL_S
        if len(staged.buffers) < parts:
            return None
        del self._staged[req_id]
        return [b for p in range(parts) for b in staged.buffers[p]]

    def drop(self, req_id: str, release: Any) -> bool:
        staged = self._staged.pop(req_id, None)
        if staged is None:
            return False
        for buffers in staged.buffers.values():
            for buffer in buffers:
                release(buffer)
        return True


@dataclass
class Job:
    """One generation request inside the engine; handler threads wait on its events."""

    rid: str
    session: str
    tokens: list[int]
    keys: list[bytes]
    max_new_tokens: int
    arrived_at: float
    first: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    cached_tokens: int = 0  # prompt tokens found in the cache at admission
    fetched_tokens: int = 0  # of which brought from the shared store at arrival
    prefilled: int = 0  # prompt tokens with KV so far
    outputs: list[int] = field(default_factory=list)
    first_token_at: float = 0.0
    finished_at: float = 0.0
    locked: list[bytes] = field(default_factory=list)
    reserved_blocks: int = 0
    error: Exception | None = None
    _rng: random.Random | None = None

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.outputs)

    def wait_first(self, timeout_s: float) -> None:
        if not self.first.wait(timeout_s):
            raise DeadlineExceeded(f"request {self.rid} got no first token in {timeout_s:g} s")
        if self.error is not None:
            raise self.error

    def wait_done(self, timeout_s: float) -> None:
        if not self.done.wait(timeout_s):
            raise DeadlineExceeded(f"request {self.rid} did not finish in {timeout_s:g} s")
        if self.error is not None:
            raise self.error

    def meta(self) -> dict:
        return {
            "id": self.rid,
            "session": self.session,
            "prompt_tokens": len(self.tokens),
            "completion_tokens": len(self.outputs),
            "cached_tokens": self.cached_tokens,
            "fetched_tokens": self.fetched_tokens,
            "finish_reason": {"type": "length", "length": self.max_new_tokens}
            if self.done.is_set()
            else None,
            "ttft_s": round(self.first_token_at - self.arrived_at, 6)
            if self.first_token_at
            else None,
            "e2e_latency": round(self.finished_at - self.arrived_at, 6)
            if self.finished_at
            else None,
        }


@dataclass
class _Session:
    tokens: list[int]
    keys: list[bytes]
    last_active: float
    migrations: int = 0
    busy: int = 0  # jobs of it queued or running


class SimEngine(InstanceAdaptor):
    """The emulated engine; `start()` runs its scheduler thread, `close()` stops it."""

    engine = ENGINE

    def __init__(self, config: SimConfig | None = None, kv_store: Any = None) -> None:
        self.config = config or SimConfig()
        self.kv_store = kv_store  # a kv_share.KVStore, or None: no shared prefixes
        c = self.config
        self.cache = PrefixCache(c.cache_tokens // c.page_tokens, c.block_bytes)
        self._cv = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._prefilling: list[Job] = []
        self._running: list[Job] = []
        self._reserved_blocks = 0
        self._arrived = False
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._owners: dict[bytes, int] = {}  # block -> sessions whose context holds it
        self._staging = PartStaging()  # parts of imports not complete yet
        self._export_buffers = BufferPool(EXPORT_BUFFERS_KEPT_BYTES)
        self._lent: dict[int, bytearray] = {}  # block buffers lent by import_buffers, by address
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sim-scheduler", daemon=True)
        self.counters = {
            "requests": 0,
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "fetched_tokens": 0,
            "exported_bytes": 0,
            "imported_bytes": 0,
            "imported_in_place_bytes": 0,  # read straight into lent block buffers (no copy)
            "store_get_s": 0.0,
        }

    def start(self) -> SimEngine:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()
        with self._cv:
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with self._cv:
            for job in [*self._waiting, *self._prefilling, *self._running]:
                job.error = Unavailable("the engine stopped")
                job.first.set()
                job.done.set()

    # -- requests ------------------------------------------------------------------------------

    def submit(
        self, tokens: list[int], max_new_tokens: int, rid: str = "", session: str = ""
    ) -> Job:
        """Queue a request (its full context); returns at once. The shared store, if any, is
        consulted here, on the caller's thread, before the request queues."""
        c = self.config
        if not isinstance(tokens, list) or not tokens:
            raise InvalidArgument("a request needs a non-empty list of token ids")
        bad = [t for t in tokens if not _is_int(t) or not 0 <= t < c.vocab]
        if bad:
            raise InvalidArgument(f"token ids outside [0, {c.vocab}): {bad[:5]}")
        if not _is_int(max_new_tokens) or not 1 <= max_new_tokens <= 1 << 16:
            raise InvalidArgument(
                f"max_new_tokens must be an int in [1, 65536], not {max_new_tokens!r}"
            )
        if len(tokens) + max_new_tokens > c.max_context_tokens:
            raise InvalidArgument(
                f"{len(tokens)} prompt tokens + {max_new_tokens} new ones are over this "
                f"instance's context of {c.max_context_tokens} tokens"
            )
        if self._closed.is_set():
            raise Unavailable("the engine is stopping")
        rid = rid or uuid.uuid4().hex
        job = Job(
            rid,
            session or rid,
            tokens,
            block_keys(tokens, c.page_tokens),
            max_new_tokens,
            time.monotonic(),
        )
        with self._cv:
            if len(self._waiting) >= MAX_WAITING:
                raise ResourceExhausted(f"{MAX_WAITING} requests are queued: retry later")
            record = self._sessions.get(job.session)
            if record is not None:
                record.busy += 1
            else:
                self._sessions[job.session] = _Session([], [], job.arrived_at, busy=1)
            self._sessions.move_to_end(job.session)
            local = self.cache.match(job.keys)
        if self.kv_store is not None and local < len(job.keys):
            self._fetch_shared(job, local)
        with self._cv:
            self._waiting.append(job)
            self._arrived = True
            self._cv.notify_all()
        return job

    def generate(self, req_id: str, prompt_ids: list[int] | None, max_new_tokens: int) -> list[int]:
        """The reference engine's call: `prompt_ids` None continues session `req_id`'s context."""
        if prompt_ids is None:
            with self._cv:
                record = self._sessions.get(req_id)
                if record is None or not record.tokens:
                    raise NotFound(f"session {req_id!r} is not resident: send prompt_ids")
                prompt_ids = list(record.tokens)
        job = self.submit(prompt_ids, max_new_tokens, session=req_id)
        job.wait_done(600.0)
        return job.outputs

    def _fetch_shared(self, job: Job, local: int) -> None:
        """Extend the local prefix with the run of blocks the shared store holds (real I/O)."""
        store = self.kv_store
        started = time.monotonic()
        wanted = job.keys[local:]
        try:
            present = store.exists([store_key(k) for k in wanted])
            n = next((i for i, ok in enumerate(present) if not ok), len(present))
            datas = store.get([store_key(k) for k in wanted[:n]]) if n else []
        except Exception:  # a shared store that fails is a cache miss, never a failed request
            return
        size = self.config.block_bytes
        good = 0
        for key, data in zip(wanted[:n], datas):
            if data is None or len(data) != size or bytes(data[:KEY_BYTES]) != key:
                break
            good += 1
        with self._cv:
            for key, data in zip(wanted[:good], datas[:good]):
                self.cache.insert(key, data, room_for=self._reserved_blocks)
            self.cache.touch(job.keys[: local + good])
            self.counters["store_get_s"] += time.monotonic() - started
        job.fetched_tokens = good * self.config.page_tokens

    # -- the scheduler -------------------------------------------------------------------------

    def _loop(self) -> None:
        scale = self.config.time_scale
        while not self._closed.is_set():
            with self._cv:
                self._arrived = False
                batch = self._admit()
                if batch:
                    cost = self._prefill_cost(batch)
                elif self._running:
                    steps = min(j.remaining for j in self._running)
                    context = sum(len(j.tokens) + len(j.outputs) for j in self._running)
                    step_s = self.config.cost.decode_s(len(self._running), context) / scale
                else:
                    self._cv.wait(0.5)
                    continue
            start = time.monotonic()
            if batch:
                self._closed.wait(cost / scale)
                with self._cv:
                    self._after_prefill(batch)
                continue
            end = start + steps * step_s
            with self._cv:
                while not self._arrived and not self._closed.is_set():
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    self._cv.wait(left)
            now = time.monotonic()
            done = steps if now >= end else min(steps, max(1, math.ceil((now - start) / step_s)))
            self._closed.wait(max(0.0, start + done * step_s - time.monotonic()))
            with self._cv:
                self._decode(done)

    def _admit(self) -> list[tuple[Job, int]]:
        """Chunks of prompt for this prefill step: continuing prompts first, then new requests
        while the batch, the chunk budget and the cache allow."""
        c = self.config
        budget = c.max_prefill_tokens
        batch: list[tuple[Job, int]] = []
        for job in self._prefilling:
            if budget <= 0:
                break
            chunk = min(len(job.tokens) - job.prefilled, budget)
            batch.append((job, chunk))
            budget -= chunk
        while self._waiting and budget > 0:
            if len(self._running) + len(self._prefilling) >= c.max_running:
                break
            job = self._waiting[0]
            matched = self.cache.match(job.keys)
            total_blocks = -(-(len(job.tokens) + job.max_new_tokens) // c.page_tokens)
            need = total_blocks - matched
            free = self.cache.capacity_blocks - self.cache.locked_blocks - self._reserved_blocks
            if need > free and (self._running or self._prefilling):
                break  # wait for running requests to free their blocks
            self._waiting.popleft()
            job.locked = job.keys[:matched]
            self.cache.lock(job.locked)
            self.cache.touch(job.locked)
            job.reserved_blocks = need
            self._reserved_blocks += need
            job.cached_tokens = min(matched * c.page_tokens, len(job.tokens) - 1)
            job.prefilled = job.cached_tokens
            self._prefilling.append(job)
            chunk = min(len(job.tokens) - job.prefilled, budget)
            batch.append((job, chunk))
            budget -= chunk
        return batch

    def _prefill_cost(self, batch: list[tuple[Job, int]]) -> float:
        new = sum(chunk for _, chunk in batch)
        product = sum(chunk * (job.prefilled + chunk / 2) for job, chunk in batch)
        return self.config.cost.prefill_s(new, product)

    def _after_prefill(self, batch: list[tuple[Job, int]]) -> None:
        now = time.monotonic()
        c = self.config
        for job, chunk in batch:
            job.prefilled += chunk
            if job.prefilled < len(job.tokens):
                continue
            self._prefilling.remove(job)
            self._insert_blocks(job, job.keys, len(job.locked))
            job._rng = random.Random(hashlib.blake2b(array("I", job.tokens).tobytes()).digest())
            job.outputs.append(job._rng.randrange(c.vocab))
            job.first_token_at = now
            self.counters["requests"] += 1
            self.counters["prompt_tokens"] += len(job.tokens)
            self.counters["cached_tokens"] += job.cached_tokens
            self.counters["fetched_tokens"] += job.fetched_tokens
            job.first.set()
            if job.remaining > 0:
                self._running.append(job)
            else:
                self._finish(job, now)

    def _decode(self, steps: int) -> None:
        now = time.monotonic()
        vocab = self.config.vocab
        for job in list(self._running):
            assert job._rng is not None
            take = min(steps, job.remaining)
            job.outputs.extend(job._rng.randrange(vocab) for _ in range(take))
            if job.remaining == 0:
                self._running.remove(job)
                self._finish(job, now)

    def _insert_blocks(self, job: Job, keys: list[bytes], start: int) -> None:
        """Cache the job's new blocks, locked as its own (they count against its reservation)."""
        size = self.config.block_bytes
        new = [k for k in keys[start:] if k not in self.cache]
        for key in keys[start:]:
            self.cache.insert(key, block_data(key, size))
        self.cache.lock(keys[start:])
        job.locked = job.locked + keys[start:]
        used = min(job.reserved_blocks, len(keys) - start)
        job.reserved_blocks -= used
        self._reserved_blocks -= used
        self.cache.make_room(self._reserved_blocks)
        if self.kv_store is not None and new:
            self.kv_store.put_async({store_key(k): block_data(k, size) for k in new})

    def _finish(self, job: Job, now: float) -> None:
        context = job.tokens + job.outputs
        keys = block_keys(context, self.config.page_tokens)
        self._insert_blocks(job, keys, len(job.keys))
        self.cache.unlock(job.locked)
        self.cache.touch(keys)
        self._reserved_blocks -= job.reserved_blocks
        job.reserved_blocks = 0
        job.locked = []
        self.cache.make_room(self._reserved_blocks)
        record = self._sessions.get(job.session)
        if record is not None:
            record.busy = max(0, record.busy - 1)
            self._set_context(record, context, keys)
            record.last_active = now
        self._trim_sessions()
        job.finished_at = now
        job.done.set()

    def _set_context(self, record: _Session, tokens: list[int], keys: list[bytes]) -> None:
        same = 0
        for old, new in zip(record.keys, keys):
            if old != new:
                break
            same += 1
        for key in record.keys[same:]:
            self._disown(key)
        for key in keys[same:]:
            self._owners[key] = self._owners.get(key, 0) + 1
        record.tokens, record.keys = tokens, keys

    def _disown(self, key: bytes) -> None:
        left = self._owners.get(key, 0) - 1
        if left > 0:
            self._owners[key] = left
        else:
            self._owners.pop(key, None)

    def _trim_sessions(self) -> None:
        while len(self._sessions) > MAX_SESSIONS:
            sid, record = next(iter(self._sessions.items()))
            if record.busy:
                self._sessions.move_to_end(sid)
                break
            del self._sessions[sid]
            for key in record.keys:
                self._disown(key)

    # -- the adaptor contract ------------------------------------------------------------------

    def _resident(self, record: _Session) -> int:
        """Tokens of the session's context whose KV is cached here (its leading blocks)."""
        return self.cache.match(record.keys) * self.config.page_tokens

    def load(self) -> InstanceLoad:
        with self._cv:
            resident = tuple(
                sorted(s for s, r in self._sessions.items() if r.keys and r.keys[0] in self.cache)
            )
            return InstanceLoad(
                waiting=len(self._waiting),
                running=len(self._prefilling) + len(self._running),
                cached_tokens=len(self.cache) * self.config.page_tokens,
                requests=resident,
            )

    def running_tokens(self) -> int:
        with self._cv:
            return sum(len(j.tokens) + len(j.outputs) for j in self._running + self._prefilling)

    def request_stats(self) -> list[RequestStat]:
        now = time.monotonic()
        with self._cv:
            stats = []
            for sid, record in self._sessions.items():
                tokens = self._resident(record) if record.keys else 0
                if tokens == 0 and not record.busy:
                    continue
                stats.append(
                    RequestStat(
                        sid,
                        tokens,
                        0.0 if record.busy else max(0.0, now - record.last_active),
                        running=record.busy > 0,
                        migrations=record.migrations,
                    )
                )
            return sorted(stats, key=lambda s: s.req_id)

    def export_kv(self, req_id: str) -> KVExport:
        return self.export_kv_part(req_id, 0, 1)

    def export_kv_part(self, req_id: str, part: int, parts: int) -> KVExport:
        import torch

        c = self.config
        check_part(part, parts)
        with self._cv:
            record = self._sessions.get(req_id)
            if record is None or not record.keys or record.keys[0] not in self.cache:
                raise NotFound(f"session {req_id!r} has no KV cache resident here")
            if record.busy:
                raise Unavailable(f"session {req_id!r} is running a turn: retry when it ends")
            blocks = self.cache.match(record.keys)
            per_page = max(1, PAGE_BYTES_TARGET // c.block_bytes)
            first, last = _part_pages(-(-blocks // per_page), part, parts)
            held = record.keys[first * per_page : min(blocks, last * per_page)]
            self.cache.lock(held)  # their buffers stay put while read out of the lock
            datas = [self.cache.get(k) for k in held]
            tokens = list(record.tokens)
            migrations = record.migrations
        self.counters["exported_bytes"] += len(held) * c.block_bytes
        meta = {
            "format": META_FORMAT,
            "engine": ENGINE,
            "tokens": tokens,
            "blocks": blocks,
            "blocks_per_page": per_page,
            "page_tokens": c.page_tokens,
            "kv_bytes_per_token": c.kv_bytes_per_token,
            "migrations": migrations,
        }
        if per_page == 1:  # a page is a block: lend the blocks themselves, locked until release
            pages = {
                f"p{i}": torch.frombuffer(d, dtype=torch.uint8)
                for i, d in zip(range(first, last), datas)
            }
            return KVExport(pages, meta, release=self._unlocker(held))
        size = c.block_bytes
        starts = range(0, len(held), per_page)
        chunks = self._export_buffers.take([min(per_page, len(held) - s) * size for s in starts])
        try:
            pages = {}
            for i, start, chunk in zip(range(first, last), starts, chunks):
                for j, data in enumerate(datas[start : start + per_page]):
                    assert data is not None  # locked: still cached
                    chunk[j * size : (j + 1) * size] = data
                pages[f"p{i}"] = torch.frombuffer(chunk, dtype=torch.uint8)
        finally:
            with self._cv:
                self.cache.unlock(held)
        return KVExport(pages, meta, release=lambda: self._export_buffers.give(chunks))

    def _unlocker(self, keys: list[bytes]) -> Callable[[], None]:
        """Unlocks `keys` once, however often it is called."""
        pending = [keys]

        def unlock() -> None:
            with self._cv:
                if pending:
                    self.cache.unlock(pending.pop())

        return unlock

    def import_kv(self, req_id: str, export: KVExport) -> None:
        self.import_kv_part(req_id, 0, 1, export)

    def import_buffers(
        self, req_id: str, part: int, parts: int, meta: dict[str, Any]
    ) -> KVExport | None:
        """Block buffers for the part's pages when a page is a block (the import then keeps
        them: no copy); None when pages hold several blocks."""
        import torch

        check_part(part, parts)
        _, _, blocks, per_page, _ = self._check_meta(meta)
        if per_page != 1:
            return None
        first, last = _part_pages(blocks, part, parts)
        with self._cv:
            buffers = self.cache.take_buffers(last - first)
            pages = {}
            for i, buffer in zip(range(first, last), buffers):
                pages[f"p{i}"] = page = torch.frombuffer(buffer, dtype=torch.uint8)
                self._lent[page.data_ptr()] = buffer

        def release() -> None:  # those no import kept
            with self._cv:
                for page, buffer in zip(pages.values(), buffers):
                    if self._lent.pop(page.data_ptr(), None) is not None:
                        self.cache.release(buffer)

        return KVExport(pages, meta, release=release)

    def import_kv_part(self, req_id: str, part: int, parts: int, export: KVExport | None) -> bool:
        """Copy and check the part's blocks outside the lock; park them until every part of
        the attempt is in, then make the session resident from all of them at once."""
        c = self.config
        check_part(part, parts)
        if export is None:
            raise InvalidArgument(f"part {part} of {parts} of {req_id!r} carries no KV pages")
        tokens, keys, blocks, per_page, migrations = self._check_meta(export.meta)
        first, last = _part_pages(-(-blocks // per_page), part, parts)
        names = [f"p{i}" for i in range(first, last)]
        if not isinstance(export.pages, dict) or sorted(export.pages) != sorted(names):
            where = "" if parts == 1 else f" of part {part} of {parts}"
            raise InvalidArgument(
                f"KV pages{where} must be exactly {names[:3]}..., got {sorted(export.pages)[:3]}..."
            )
        size = c.block_bytes
        datas: list[memoryview] = []
        addresses: list[int] = []  # a one-block page's address: it may be a lent block buffer
        for i, name in zip(range(first, last), names):
            page = export.pages[name]
            raw = _byte_view(page)
            count = min(per_page, blocks - i * per_page)
            if len(raw) != count * size:
                raise InvalidArgument(f"page {name} has {len(raw)} bytes, expected {count * size}")
            datas.extend(raw[j * size : (j + 1) * size] for j in range(count))
            one_block = count == 1 and hasattr(page, "data_ptr")
            addresses.extend([page.data_ptr() if one_block else 0] * count)
        with self._cv:
            if self._resident_with(req_id, tokens):
                # This KV is resident already: the attempt completed from parts parked before
                # (a retry after a cut-off) while this copy of a part was on its way.
                return True
            self._check_absent(req_id)
            lent = [self._lent.pop(a, None) for a in addresses]  # filled in place
            fresh = iter(self.cache.take_buffers(lent.count(None)))
        buffers = [b if b is not None else next(fresh) for b in lent]
        try:
            for key, data, buffer, own in zip(keys[first * per_page :], datas, buffers, lent):
                if own is None:
                    buffer[:] = data
                if buffer != block_data(key, size):
                    raise IntegrityError(
                        f"a KV block of session {req_id!r} does not match its tokens"
                    )
        except BaseException:
            with self._cv:
                for buffer in buffers:
                    self.cache.release(buffer)
            raise
        self.counters["imported_bytes"] += len(datas) * size
        self.counters["imported_in_place_bytes"] += (len(lent) - lent.count(None)) * size
        with self._cv:
            done = self._staging.add(req_id, part, parts, tokens, buffers, self.cache.release)
        if done is None:
            return False
        try:
            self._make_resident(req_id, tokens, keys, done, migrations)
        except BaseException:
            with self._cv:
                for buffer in done:
                    self.cache.release(buffer)
            raise
        return True

    def _check_meta(self, meta: Any) -> tuple[list[int], list[bytes], int, int, int]:
        c = self.config
        if not isinstance(meta, dict):
            raise InvalidArgument("a KV export needs a meta dict")
        for name, needed in (
            ("format", META_FORMAT),
            ("engine", ENGINE),
            ("page_tokens", c.page_tokens),
            ("kv_bytes_per_token", c.kv_bytes_per_token),
        ):
            if meta.get(name) != needed:
                raise InvalidArgument(
                    f"KV export has {name}={meta.get(name)!r}, this engine needs {needed!r}"
                )
        tokens: Any = meta.get("tokens")
        blocks: Any = meta.get("blocks")
        per_page: Any = meta.get("blocks_per_page")
        if (
            not isinstance(tokens, list)
            or not tokens
            or not all(_is_int(t) and 0 <= t < c.vocab for t in tokens)
        ):
            raise InvalidArgument("meta 'tokens' must be a non-empty list of token ids")
        keys = block_keys(tokens, c.page_tokens)
        if not _is_int(blocks) or not 1 <= blocks <= len(keys):
            raise InvalidArgument(f"meta 'blocks' must be in [1, {len(keys)}], not {blocks!r}")
        if not _is_int(per_page) or per_page < 1:
            raise InvalidArgument("meta 'blocks_per_page' must be an int >= 1")
        migrations = meta.get("migrations", 0)
        if not _is_int(migrations) or migrations < 0:
            raise InvalidArgument("meta 'migrations' must be an int >= 0")
        return tokens, keys, blocks, per_page, migrations

    def _resident_with(self, req_id: str, tokens: list[int]) -> bool:
        record = self._sessions.get(req_id)
        return (
            record is not None
            and not record.busy
            and record.tokens == tokens
            and bool(record.keys)
            and record.keys[0] in self.cache
        )

    def _check_absent(self, req_id: str) -> None:
        record = self._sessions.get(req_id)
        if record is not None and (record.busy or (record.keys and record.keys[0] in self.cache)):
            raise AlreadyExists(f"session {req_id!r} is resident here: evict it first")

    def _make_resident(
        self,
        req_id: str,
        tokens: list[int],
        keys: list[bytes],
        buffers: list[bytearray],
        migrations: int,
    ) -> None:
        with self._cv:
            self._check_absent(req_id)
            record = self._sessions.get(req_id)
            for key, buffer in zip(keys, buffers):
                self.cache.adopt(key, buffer, room_for=self._reserved_blocks)
            self.cache.touch(keys[: len(buffers)])
            if record is None:
                record = self._sessions[req_id] = _Session([], [], 0.0)
            self._set_context(record, tokens, keys)
            record.last_active = time.monotonic()
            record.migrations = migrations + 1
            self._sessions.move_to_end(req_id)
            self._trim_sessions()

    def evict(self, req_id: str) -> bool:
        """Forget the session and drop its blocks that no other session's context holds."""
        with self._cv:
            self._staging.drop(req_id, self.cache.release)  # a half-imported migration too
            record = self._sessions.get(req_id)
            if record is None:
                return False
            if record.busy:
                raise Unavailable(f"session {req_id!r} is running a turn: retry when it ends")
            del self._sessions[req_id]
            resident = bool(record.keys) and record.keys[0] in self.cache
            for key in record.keys:
                self._disown(key)
            self.cache.drop([k for k in record.keys if k not in self._owners])
            return resident

    def flush(self) -> int:
        """Drop every unlocked block (SGLang's /flush_cache)."""
        with self._cv:
            return self.cache.clear()

    def buffers(self) -> dict[str, Any]:
        return {}  # no weights: transform_into fills nothing

    def info(self) -> dict:
        with self._cv:
            return {
                "engine": ENGINE,
                "model_path": "tensorcast-sim",
                "config": self.config.to_json(),
                "cache_blocks": len(self.cache),
                "cache_evictions": self.cache.evictions,
                "counters": dict(self.counters),
                "shared_store": getattr(self.kv_store, "name", None),
                "shared_store_put_bytes": getattr(self.kv_store, "put_bytes", 0),
                "shared_store_dropped_writes": getattr(self.kv_store, "dropped_writes", 0),
            }


def store_key(key: bytes) -> str:
    return f"sim/{key.hex()}"


def _byte_view(page: Any) -> memoryview:
    """The bytes of a page (a tensor or any buffer), without copying a contiguous one."""
    if hasattr(page, "numpy") and hasattr(page, "dtype"):
        page = page.contiguous().view(-1).numpy()
    return memoryview(page).cast("B")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
