"""`TensorCastConnector`: vLLM's KV blocks as TensorCast KV pages, shared by every instance.

    LLM(..., kv_transfer_config={"kv_connector": "TensorCastConnector", "kv_role": "kv_both",
                                 "kv_connector_extra_config": {...}})

Each full KV block becomes one page per attention layer (and tensor-parallel rank), keyed by the
model, the KV layout and the hash chain of the token prefix (`keys.py`), so engines running the
same model find each other's blocks and different models never collide. Extra config (all
optional): `addr`, `token`, `state_dir` (as `tc.connect()`), `ttl_s` (page lease, default
3600; each load renews it, so a prefix in use stays), `model_key` (override the model's
identity), `load` / `save` (false turns a direction off), `load_failure` ("recompute", the
default, or "fail"), `describe_to` (a file where the scheduler side writes what names this
engine's pages: `describe()`).

Scheduler side: `get_num_new_matched_tokens` computes the prefix's chain and asks the shard
homes which pages exist (`exists_pages`: no Global Store on the path; a home on this host answers
from its shared-memory directory); the longest run of complete blocks is a hit, always leaving
one prompt token to compute. `build_connector_meta` hands the worker the blocks to load and the
blocks that this step fills (to save).

Worker side: loads run before the forward that needs them, copying each page straight into its
KV block (`get_pages(into=...)`), checked against the hash its writer recorded. A page missing,
damaged, or of the wrong shape fails its block: it is reported through
`get_block_ids_with_load_errors()` and vLLM recomputes from there (`kv_load_failure_policy` is
set to "recompute" unless `load_failure` says "fail"). Saves never block the forward: after
the step, a background thread puts the newly full blocks straight from the KV cache (a block
is immutable once full); a finished request's blocks stay allocated until its saves are done
(`request_finished` returns True, `get_finished` reports it), and a step that preempts requests
cancels their saves not yet started and waits for theirs in flight, since preemption frees
their blocks for reuse. A step whose loads failed for a request saves nothing of it (its
forward read the damaged block); the recompute saves those blocks.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.logger import init_logger

from tensorcast.errors import InvalidArgument, TensorcastError
from tensorcast.integrations import connection
from tensorcast.integrations.vllm import keys
from tensorcast.integrations.vllm import model as model_mod

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = init_logger("vllm.tensorcast")  # under "vllm": printed with vLLM's own log lines

EXTRA_KEYS = {
    *connection.CONNECTION_KEYS,
    "ttl_s",
    "model_key",
    "load",
    "save",
    "load_failure",
    "describe_to",
}
LOOKUP_TIMEOUT_S = 2.0  # a home slower than this is a miss, not a stalled scheduler
MAX_REWRITES = 65_536  # failed block prefixes remembered until their recompute saves them
STAT_NAMES = (
    "lookups",  # get_num_new_matched_tokens calls that asked the homes
    "hit_blocks",  # blocks those lookups found complete
    "loaded_blocks",
    "failed_blocks",  # promised blocks that could not be loaded (recomputed)
    "loaded_bytes",
    "saved_blocks",
    "skipped_blocks",  # blocks to save that the homes held already
    "saved_bytes",
    "save_errors",
    "dropped_saves",  # saves of a step whose loads failed for the request (recomputed)
    "cancelled_saves",  # saves not started when their request was preempted
    "load_s",
    "save_s",
)


@dataclass
class BlockJob:
    """Blocks of one request: their ids in the KV cache and their page key prefixes."""

    req_id: str
    block_ids: list[int]
    prefixes: list[str]


@dataclass
class TensorCastConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockJob] = field(default_factory=list)
    saves: list[BlockJob] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)  # requests whose blocks this step frees


@dataclass
class TensorCastConnectorStats(KVConnectorStats):
    """Counters since the last report (sums; `load_s`/`save_s` are seconds spent)."""

    def reset(self) -> None:
        self.data.clear()

    def add(self, name: str, value: float) -> None:
        self.data[name] = self.data.get(name, 0) + value

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            if isinstance(value, int | float):
                self.add(name, value)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: round(value, 4) for name, value in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class TensorCastPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per stat: `vllm:tensorcast_<name>` (per engine)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        from prometheus_client import Counter

        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        for name in STAT_NAMES:
            counter = self._counter_cls(
                name=f"vllm:tensorcast_{name}",
                documentation=f"TensorCastConnector: {name.replace('_', ' ')}.",
                labelnames=labelnames,
            )
            assert isinstance(counter, Counter) or hasattr(counter, "labels")
            self.counters[name] = {
                idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()
            }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self.counters.get(name)
            if per_engine is not None and engine_idx in per_engine and value:
                per_engine[engine_idx].inc(value)


def _flag(extra: dict[str, Any], name: str) -> bool:
    value = extra.get(name, True)
    if not isinstance(value, bool):
        raise InvalidArgument(f"kv_connector_extra_config: {name!r} must be true or false")
    return value


class TensorCastConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        unknown = sorted(set(extra) - EXTRA_KEYS)
        if unknown:
            raise InvalidArgument(
                f"kv_connector_extra_config: unknown keys {unknown} for TensorCastConnector "
                f"(known: {sorted(EXTRA_KEYS)})"
            )
        self.connection = connection.connection_options(extra, "kv_connector_extra_config")
        self.ttl_s = float(extra.get("ttl_s", keys.PAGE_TTL_S))
        self.load_enabled = _flag(extra, "load") and self._kv_transfer_config.is_kv_consumer
        self.save_enabled = _flag(extra, "save") and self._kv_transfer_config.is_kv_producer
        failure = extra.get("load_failure", "recompute")
        if failure not in ("recompute", "fail"):
            raise InvalidArgument("kv_connector_extra_config: load_failure is recompute or fail")
        # A page is a cache entry: failing to load one costs a recompute, never a request.
        self._kv_transfer_config.kv_load_failure_policy = failure
        self.block_size = vllm_config.cache_config.block_size
        parallel = vllm_config.parallel_config
        self.tp_size = parallel.tensor_parallel_size
        for option in ("pipeline_parallel_size", "decode_context_parallel_size"):
            if int(getattr(parallel, option, 1) or 1) > 1:
                # Each stage (or context rank) holds other layers (or tokens) of a block under
                # the same rank and layer numbers: their pages would overwrite each other.
                raise InvalidArgument(
                    f"TensorCastConnector does not support {option} > 1 yet (tensor "
                    "parallelism only)"
                )
        self.layer_names = _attention_layers(kv_cache_config)
        self.model_key = str(extra.get("model_key") or _model_key(vllm_config))
        self.layout_key = keys.digest_of(_layout(vllm_config, kv_cache_config, self.layer_names))
        self._stats = TensorCastConnectorStats()
        self._stats_lock = threading.Lock()
        # Scheduler side.
        self._requests: dict[str, _Tracked] = {}
        self._pending_loads: list[BlockJob] = []
        # Worker side.
        self._layers: list[tuple[torch.Tensor, int]] = []  # (KV tensor, its block dimension)
        self._load_errors: set[int] = set()
        self._saver: ThreadPoolExecutor | None = None
        self._in_flight: dict[str, int] = defaultdict(int)  # saves per request
        self._saved_any: set[str] = set()
        self._rewrite: dict[str, None] = {}  # block prefixes whose stored pages failed to load
        self._step_failed = False  # a load of this step failed: its saves are dropped
        self._finished: set[str] = set()
        self._futures: dict[Future, str] = {}  # saves not done yet -> their request
        self._lock = threading.Lock()
        if role == KVConnectorRole.SCHEDULER and self.load_enabled:
            _warm(self._pages("lookup"), write=False)  # an unreachable cluster fails LLM() here
        describe_to = extra.get("describe_to")
        if describe_to and role == KVConnectorRole.SCHEDULER:
            _write_json(str(describe_to), self.describe())
        log.info(
            "TensorCastConnector (%s): model %s, layout %s, block %d tokens, %d layers",
            role.name.lower(),
            self.model_key,
            self.layout_key,
            self.block_size,
            len(self.layer_names),
        )

    # -- shared -----------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """What names this engine's pages: enough for another process to compute every key
        (`extra_config["describe_to"]` writes it to a file when the engine starts)."""
        return {
            "model_key": self.model_key,
            "layout_key": self.layout_key,
            "block_size": self.block_size,
            "layers": len(self.layer_names),
            "tp_size": self.tp_size,
        }

    def _pages(self, role: str):
        """A page client of this process: one connection per role, since the save thread, the
        loads and the scheduler's lookups may run at the same time. Lookups run inside the
        scheduler's loop: they give up sooner (a miss) than loads and saves."""
        timeout_s = LOOKUP_TIMEOUT_S if role == "lookup" else None
        rt = connection.runtime(**self.connection, role=role, timeout_s=timeout_s)
        return rt.pages()

    def _prefix(self, chain: str) -> str:
        return keys.block_prefix(self.model_key, self.layout_key, chain)

    def _count(self, **values: float) -> None:
        with self._stats_lock:
            for name, value in values.items():
                self._stats.add(name, value)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        with self._stats_lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, TensorCastConnectorStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return TensorCastConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return TensorCastPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- scheduler side ---------------------------------------------------------------------

    def _tracked(self, request: Request) -> _Tracked:
        tracked = self._requests.get(request.request_id)
        if tracked is None or tracked.request is not request:
            tracked = self._requests[request.request_id] = _Tracked(request)
        return tracked

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if not self.load_enabled:
            return 0, False
        tracked = self._tracked(request)
        tracked.load_start = tracked.load_blocks = 0
        if tracked.root is None:
            return 0, False
        tokens = request.all_token_ids
        usable = (len(tokens) - 1) // self.block_size  # one token is always computed
        start = num_computed_tokens // self.block_size
        if usable <= start:
            return 0, False
        chains = tracked.chains_to(usable, self.block_size)
        wanted = [
            keys.page_key(self._prefix(chains[b]), rank, layer, 0)
            for b in range(start, usable)
            for rank in range(self.tp_size)
            for layer in range(len(self.layer_names))
        ]
        try:
            found = self._pages("lookup").exists_pages(wanted)
        except TensorcastError as e:  # the cluster is a cache: unreachable means a miss
            log.warning("TensorCast lookup failed, computing the prompt: %s", e)
            return 0, False
        per_block = self.tp_size * len(self.layer_names)
        hit = 0
        while hit < usable - start and all(found[hit * per_block : (hit + 1) * per_block]):
            hit += 1
        self._count(lookups=1, hit_blocks=hit)
        tracked.load_start, tracked.load_blocks = start, hit
        return hit * self.block_size, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        tracked = self._tracked(request)
        if num_external_tokens <= 0:
            return
        count = num_external_tokens // self.block_size
        assert count <= tracked.load_blocks, "vLLM asked for more blocks than were found"
        block_ids = blocks.get_block_ids()[0]
        start = tracked.load_start
        ids = list(block_ids[start : start + count])
        prefixes = [self._prefix(c) for c in tracked.chains[start : start + count]]
        self._pending_loads.append(BlockJob(request.request_id, ids, prefixes))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = TensorCastConnectorMetadata(
            loads=self._pending_loads, preempted=set(scheduler_output.preempted_req_ids or ())
        )
        self._pending_loads = []
        if not self.save_enabled:
            return meta
        steps = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        steps += list(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, computed in steps:
            tracked = self._requests.get(req_id)
            if tracked is None or self._kv_cache_manager is None:
                continue
            if tracked.root is None:
                continue
            scheduled = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            tokens = tracked.request.all_token_ids
            if tracked.saved is None:  # blocks before it came from a cache: stored already
                tracked.saved = computed // self.block_size
            first, end = keys.save_range(
                tracked.saved, computed, scheduled, len(tokens), self.block_size
            )
            if end <= first:
                continue
            (block_ids,) = self._kv_cache_manager.get_block_ids(req_id)[:1]
            end = min(end, len(block_ids))
            chains = tracked.chains_to(end, self.block_size)
            job = BlockJob(
                req_id,
                list(block_ids[first:end]),
                [self._prefix(c) for c in chains[first:end]],
            )
            if job.block_ids:
                tracked.saving = True
                tracked.saved = first + len(job.block_ids)
                meta.saves.append(job)
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks until the worker has saved them (it reports the request in
        `get_finished`) when any save was handed to it."""
        tracked = self._requests.pop(request.request_id, None)
        return bool(tracked and tracked.saving), None

    # -- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise InvalidArgument(f"TensorCastConnector: no KV cache for layers {missing[:3]}")
        num_blocks = self._kv_cache_config.num_blocks
        self._layers = []
        for name in self.layer_names:
            # vLLM hands connectors standardized per-layer views, [blocks, heads, tokens,
            # channels]: blocks at dim 0 (another dim may have as many entries).
            tensor = kv_caches[name]
            if tensor.dim() < 2 or tensor.shape[0] != num_blocks:
                raise InvalidArgument(
                    f"TensorCastConnector: {name}'s KV cache {tuple(tensor.shape)} does not "
                    f"have its {num_blocks} blocks at dim 0"
                )
            self._layers.append((tensor, 0))
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.rank = get_tensor_model_parallel_rank() if self.tp_size > 1 else 0
        # Connect now (and map the homes' pools), not on the first request's clock.
        if self.load_enabled:
            _warm(self._pages("load"), write=True)
        if self.save_enabled:
            _warm(self._pages("save"), write=True)

    def _block(self, layer: int, block_id: int) -> torch.Tensor:
        tensor, dim = self._layers[layer]
        return tensor.select(dim, block_id)

    def _page_keys(self, prefix: str) -> list[str]:
        return [keys.page_key(prefix, self.rank, layer, 0) for layer in range(len(self._layers))]

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, TensorCastConnectorMetadata) or not meta.loads:
            return
        started = time.perf_counter()
        pending: list[tuple[int, str, torch.Tensor]] = []  # block, key, view
        for job in meta.loads:
            for block_id, prefix in zip(job.block_ids, job.prefixes):
                for layer, key in enumerate(self._page_keys(prefix)):
                    pending.append((block_id, key, self._block(layer, block_id)))
        failed: set[int] = set()
        loaded_bytes = 0
        for chunk in _staging_chunks(pending):
            loaded_bytes += self._load_chunk(chunk, failed)
        if failed:
            # This step's forward reads those blocks as they are, and any request may read
            # them (vLLM shares cached blocks): nothing computed in this step is saved
            # (wait_for_save drops every save of it); vLLM recomputes the blocks.
            self._step_failed = True
            log.warning(
                "TensorCast: %d KV blocks were missing or damaged, vLLM recomputes them",
                len(failed),
            )
            self._load_errors |= failed
        blocks = {b for job in meta.loads for b in job.block_ids}
        self._count(
            loaded_blocks=len(blocks - failed),
            failed_blocks=len(failed),
            loaded_bytes=loaded_bytes,
            load_s=time.perf_counter() - started,
        )

    def _load_chunk(self, chunk: list[tuple[int, str, torch.Tensor]], failed: set[int]) -> int:
        """Reads one chunk of pages into their blocks (through staging buffers for strided
        views); adds the blocks that could not be loaded to `failed`; returns bytes loaded."""
        wanted = [key for _, key, _ in chunk]
        try:
            buffers = [_staging(view) for _, _, view in chunk]
            pages = self._pages("load").get_pages(
                wanted, into=[buffer.view(-1).view(torch.uint8) for buffer in buffers]
            )
        except Exception as e:  # no memory to stage, the cluster unreachable: recompute
            log.warning("TensorCast KV load failed, recomputing %d pages: %s", len(wanted), e)
            buffers, pages = [], [None] * len(wanted)
        loaded = 0
        for i, ((block_id, key, view), page) in enumerate(zip(chunk, pages)):
            if page is None or page.shape != tuple(view.shape) or page.dtype != _dtype(view):
                failed.add(block_id)
                if self.save_enabled:
                    with self._lock:  # the recompute saves it again, over what is stored
                        self._rewrite[key.rsplit("/", 1)[0]] = None
                        while len(self._rewrite) > MAX_REWRITES:  # never saved again: forget
                            del self._rewrite[next(iter(self._rewrite))]
                continue
            if buffers[i] is not view:
                view.copy_(buffers[i])
            loaded += view.numel() * view.element_size()
        return loaded

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # whole blocks are saved after the step (wait_for_save)

    def wait_for_save(self) -> None:
        """Hands this step's full blocks to the save thread and returns at once."""
        meta = self._connector_metadata
        step_failed, self._step_failed = self._step_failed, False
        if not isinstance(meta, TensorCastConnectorMetadata) or not meta.saves:
            return
        if self._saver is None:
            self._saver = ThreadPoolExecutor(1, thread_name_prefix="tensorcast-kv-save")
        for job in meta.saves:
            with self._lock:
                # Reported finished by get_finished even when dropped: the scheduler holds
                # the request's blocks until then.
                self._saved_any.add(job.req_id)
            if step_failed:
                # Maybe computed over a block whose load failed: wrong KV under right keys,
                # which every engine would then load. Not stored (a later miss, not an error).
                self._count(dropped_saves=1)
                continue
            with self._lock:
                self._in_flight[job.req_id] += 1
            future = self._saver.submit(self._save, job)
            with self._lock:
                self._futures[future] = job.req_id
            future.add_done_callback(self._futures_discard)

    def _futures_discard(self, future: Future) -> None:
        with self._lock:
            self._futures.pop(future, None)

    def _save(self, job: BlockJob) -> None:
        started = time.perf_counter()
        try:
            pages = {}
            for block_id, prefix in zip(job.block_ids, job.prefixes):
                for layer, key in enumerate(self._page_keys(prefix)):
                    view = self._block(layer, block_id)
                    pages[key] = view if view.is_contiguous() else view.contiguous()
            client = self._pages("save")
            with self._lock:
                rewrite = {p for p in job.prefixes if p in self._rewrite}
                for prefix in rewrite:
                    del self._rewrite[prefix]
            names = list(pages)
            present = client.exists_pages(names)
            todo = {
                k: pages[k]
                for k, there in zip(names, present)
                if not there or k.rsplit("/", 1)[0] in rewrite
            }
            if todo:
                client.put_pages(todo, self.ttl_s)
            per_block = max(1, len(self._layers))
            self._count(
                saved_blocks=len(todo) // per_block,
                skipped_blocks=(len(pages) - len(todo)) // per_block,
                saved_bytes=sum(t.numel() * t.element_size() for t in todo.values()),
                save_s=time.perf_counter() - started,
            )
        except Exception as e:  # a lost save is a future miss, never an engine failure
            log.warning("TensorCast: saving %d KV blocks failed: %s", len(job.block_ids), e)
            self._count(save_errors=1)
        finally:
            with self._lock:
                self._in_flight[job.req_id] -= 1

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Preemption frees the preempted requests' blocks for reuse in this step: their saves
        that have not started are cancelled (a future miss; the request saves its blocks again
        when it is recomputed), one already reading its blocks is waited for. Other requests'
        saves go on in the background."""
        if not isinstance(kv_connector_metadata, TensorCastConnectorMetadata):
            return
        preempted = kv_connector_metadata.preempted
        if not preempted:
            return
        with self._lock:
            theirs = [(f, req_id) for f, req_id in self._futures.items() if req_id in preempted]
        for future, req_id in theirs:
            if future.cancel():  # never runs: its _save's bookkeeping is done here
                with self._lock:
                    self._in_flight[req_id] -= 1
                self._count(cancelled_saves=1)
            else:
                future.result()

    def finish_saves(self) -> None:
        """Blocks until every save handed to the save thread is done (its counts recorded)."""
        with self._lock:
            pending = list(self._futures)
        for future in pending:
            if not future.cancelled():
                future.result()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            self._finished |= finished_req_ids & self._saved_any
            done = {r for r in self._finished if self._in_flight.get(r, 0) == 0}
            for req_id in done:
                self._finished.discard(req_id)
                self._saved_any.discard(req_id)
                self._in_flight.pop(req_id, None)
        return (done or None), None

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._load_errors = self._load_errors, set()
        return failed

    def shutdown(self) -> None:
        if self._saver is not None:
            self._saver.shutdown(wait=True)
            self._saver = None


@dataclass
class _Tracked:
    """What the scheduler side keeps per request."""

    request: Any
    chains: list[str] = field(default_factory=list)
    load_start: int = 0
    load_blocks: int = 0
    saving: bool = False
    saved: int | None = None  # blocks before this one were handed to saving
    # Where the request's chain starts; None: a request the connector leaves alone (prompt
    # embeddings: no token ids name its KV).
    root: str | None = field(init=False)

    def __post_init__(self) -> None:
        self.root = _root_of(self.request)

    def chains_to(self, blocks: int, block_size: int) -> list[str]:
        """Chain hashes of the first `blocks` blocks, extended from those computed before."""
        if len(self.chains) < blocks:
            assert self.root is not None
            tokens = self.request.all_token_ids[: blocks * block_size]
            parent = self.chains[-1] if self.chains else self.root
            self.chains += keys.chain_hashes(tokens, block_size, len(self.chains), parent)
        return self.chains


def _warm(pages: Any, write: bool) -> None:
    """Open this page client's connections to every shard home: a lookup of one key per shard,
    or (`write`) a one-byte page per shard with a one-minute lease, which also maps each
    same-host home's pool (populated: seconds for a large pool, better at startup than in the
    first request's time to first token)."""
    from tensorcast.sharding import shard_of

    table = pages.table()
    keys_by_shard: dict[int, str] = {}
    for i in range(64 * table.num_shards):
        if len(keys_by_shard) == table.num_shards:
            break
        key = f"{keys.KEY_PREFIX}/warmup/{i}"
        keys_by_shard.setdefault(shard_of(key, table.num_shards), key)
    names = list(keys_by_shard.values())
    if write:
        pages.put_pages(dict.fromkeys(names, b"\0"), 60.0)
    else:
        pages.exists_pages(names)


def _root_of(request: Any) -> str | None:
    """The request's chain root (`keys.request_root`): what besides its tokens changes its KV."""
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    lora = getattr(request, "lora_request", None)
    return keys.request_root(
        lora=(str(lora.lora_name), str(lora.lora_path)) if lora else None,
        cache_salt=getattr(request, "cache_salt", None),
        mm=[str(f.identifier) for f in getattr(request, "mm_features", None) or []],
    )


MAX_STAGING_BYTES = 256 << 20  # staging buffers of strided views, at once, per load


def _staging_chunks(
    pending: list[tuple[int, str, torch.Tensor]],
) -> Iterator[list[tuple[int, str, torch.Tensor]]]:
    """`pending` cut so that each chunk's strided views need at most MAX_STAGING_BYTES of
    staging (a long prefix hit on a strided layout would otherwise stage all of it at once,
    beyond vLLM's KV memory budget)."""
    chunk: list[tuple[int, str, torch.Tensor]] = []
    staged = 0
    for item in pending:
        view = item[2]
        size = 0 if view.is_contiguous() else view.numel() * view.element_size()
        if chunk and staged + size > MAX_STAGING_BYTES:
            yield chunk
            chunk, staged = [], 0
        chunk.append(item)
        staged += size
    if chunk:
        yield chunk


def _staging(view: torch.Tensor) -> torch.Tensor:
    """Where a block's page is read: the block itself when contiguous, else a contiguous
    buffer of its shape (copied in after). Not `empty_like`, which keeps a strided view's
    strides (e.g. a per-layer view of vLLM's default GPU layout, heads before tokens)."""
    if view.is_contiguous():
        return view
    return torch.empty(tuple(view.shape), dtype=view.dtype, device=view.device)


def _write_json(path: str, value: Any) -> None:
    import json
    import os

    staging = f"{path}.tmp-{os.getpid()}"
    with open(staging, "w") as f:
        json.dump(value, f)
    os.replace(staging, path)


def _dtype(tensor: torch.Tensor) -> str:
    from tensorcast.tensors import dtype_name

    return dtype_name(tensor.dtype)


def _attention_layers(kv_cache_config: KVCacheConfig) -> list[str]:
    """The layers whose blocks become pages, in layer order. One full-attention group only:
    sliding-window and hybrid models keep blocks that a prefix hit cannot restore."""
    from vllm.model_executor.models.utils import extract_layer_index
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, FullAttentionSpec):
        kinds = sorted({type(g.kv_cache_spec).__name__ for g in groups})
        raise InvalidArgument(
            f"TensorCastConnector supports models whose layers all use full attention (one KV "
            f"cache group); this one has {len(groups)} groups of {kinds}"
        )
    return sorted(groups[0].layer_names, key=lambda n: (extract_layer_index(n), n))


def _layout(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, layer_names: list[str]
) -> dict[str, Any]:
    """What fixes a page's bytes besides the model and the tokens."""
    from vllm.platforms import current_platform

    spec: Any = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    return {
        "spec": type(spec).__name__,
        "block_size": spec.block_size,
        "num_kv_heads": spec.num_kv_heads,
        "head_size": spec.head_size,
        "dtype": str(spec.dtype),
        "page_size_bytes": spec.page_size_bytes,
        "cache_dtype": vllm_config.cache_config.cache_dtype,
        "layers": len(layer_names),
        "tp_size": vllm_config.parallel_config.tensor_parallel_size,
        "device": current_platform.device_type,
    }


def _model_key(vllm_config: VllmConfig) -> str:
    """The weights' identity (the artifact's content id when the model loader takes them from
    TensorCast, else a fingerprint of the model directory: `keys.model_key_of_dir`) with how
    this engine runs them: the dtype, a quantization, config overrides (RoPE scaling changes
    every cached K) and the revision. The same weights run otherwise make other KV."""
    model_config = vllm_config.model_config
    load_config = vllm_config.load_config
    overrides = model_config.hf_overrides
    running = {
        "dtype": str(model_config.dtype),
        "quantization": model_config.quantization,
        "hf_overrides": overrides
        if isinstance(overrides, dict)
        else f"{getattr(overrides, '__module__', '')}.{getattr(overrides, '__qualname__', '')}",
        "revision": model_config.revision,
    }
    weights = ""
    if load_config.load_format == "tensorcast":
        extra = load_config.model_loader_extra_config or {}
        artifact = extra.get("artifact") or model_mod.marker_of(model_config.model).get("artifact")
        if artifact:
            loader_connection = connection.connection_options(extra, "model_loader_extra_config")
            rt = connection.runtime(**loader_connection)
            weights = rt.artifact(str(artifact)).content_id[:32]
    if not weights:
        weights = keys.model_key_of_dir(model_config.model, {"revision": model_config.revision})
    return keys.digest_of([weights, running], 16)
