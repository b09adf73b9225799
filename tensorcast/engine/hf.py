"""A reference inference engine on Hugging Face transformers whose requests can move between
processes: each request's KV cache leaves as pages and comes back in another engine with the same
weights, and generation continues there token-identically.

Why it is token-identical: decoding is run by hand, one forward per token, always in the same
shape of steps. A request's state is its token list plus a DynamicCache covering all tokens but
the ones still to be fed (after a step, only the last generated token), so "generate N, then M",
"generate N+M" and "export, import elsewhere, continue" all perform the same forwards on the same
inputs.

Locking: `_model_lock` serialises model execution and every change to a request's cache;
`_state_lock` (always taken after it, held briefly) guards the request table and the counters
`load()` reads, so load never waits for a generation.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from tensorcast.adaptors import InstanceAdaptor, InstanceLoad, KVExport
from tensorcast.errors import AlreadyExists, InvalidArgument, NotFound

META_FORMAT = 1
FINGERPRINT_SAMPLES = 4096  # values per parameter in weights_fingerprint


@dataclass
class _Request:
    tokens: list[int]  # prompt + generated so far
    cache: DynamicCache  # keys/values of tokens[:cached]; tokens[cached:] are fed at the next step
    cached: int


def page_spans(
    num_layers: int, cache_tokens: int, page_tokens: int
) -> list[tuple[str, int, str, int, int]]:
    """(name, layer, "k"|"v", start, stop) for every page, in page order.

    Export and import both derive the layout from here, so they cannot disagree.
    """
    return [
        (f"L{layer}.{kind}.{block}", layer, kind, start, min(start + page_tokens, cache_tokens))
        for layer in range(num_layers)
        for kind in ("k", "v")
        for block, start in enumerate(range(0, cache_tokens, page_tokens))
    ]


class HFEngine(InstanceAdaptor):
    """Greedy decoding over a transformers causal LM (built, eval mode), one request per forward.

    Pages are `[num_kv_heads, tokens, head_dim]` slices of one layer's K or V (the batch dim of 1
    is dropped), at most `page_tokens` tokens each.
    """

    engine = "hf-transformers"

    def __init__(self, model: Any, page_tokens: int = 16) -> None:
        if page_tokens < 1:
            raise InvalidArgument(f"page_tokens must be at least 1, not {page_tokens}")
        config = model.config.get_text_config(decoder=True)
        self.model = model
        self.page_tokens = page_tokens
        self.num_layers: int = config.num_hidden_layers
        self.num_kv_heads: int = (
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        )
        self.head_dim: int = (
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.vocab_size: int = config.vocab_size
        self.max_positions: int | None = getattr(config, "max_position_embeddings", None)
        parameter = next(model.parameters())
        self.dtype: torch.dtype = parameter.dtype
        self.device: torch.device = parameter.device
        self.model_name: str = getattr(model, "name_or_path", "") or type(model).__name__
        layers = self._new_cache().layers
        if len(layers) != self.num_layers or any(
            type(layer) is not DynamicLayer for layer in layers
        ):
            raise InvalidArgument(
                f"{type(model).__name__} uses sliding-window or hybrid KV caches, which HFEngine "
                "cannot page: use a model with full attention in every layer"
            )
        self._model_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._waiting = 0
        self._running = 0

    def generate(self, req_id: str, prompt_ids: list[int] | None, max_new_tokens: int) -> list[int]:
        """Greedily decode `max_new_tokens` more tokens; returns only the new ones.

        With `prompt_ids` a new request starts (AlreadyExists if `req_id` is resident); with None
        the resident request continues (NotFound if it is not). The request stays resident. If
        the model itself fails mid-step the request is dropped, since its cache may be half-updated.
        """
        if not _is_int(max_new_tokens) or max_new_tokens < 0:
            raise InvalidArgument(f"max_new_tokens must be an int >= 0, not {max_new_tokens!r}")
        if prompt_ids is not None:
            self._check_tokens(prompt_ids, "prompt_ids")
        with self._turn():
            if prompt_ids is None:
                request = self._resident(req_id)
            else:
                request = _Request(list(prompt_ids), self._new_cache(), 0)
            total = len(request.tokens) + max_new_tokens
            if self.max_positions is not None and total > self.max_positions:
                raise InvalidArgument(
                    f"{total} tokens exceed the model's {self.max_positions} positions: "
                    "ask for fewer new tokens"
                )
            with self._state_lock:
                if prompt_ids is not None and req_id in self._requests:
                    raise AlreadyExists(
                        f"request {req_id!r} is resident: continue it with prompt_ids=None, "
                        "or evict it first"
                    )
                self._requests[req_id] = request
            try:
                return [self._step(request) for _ in range(max_new_tokens)]
            except BaseException:
                with self._state_lock:
                    if self._requests.get(req_id) is request:
                        del self._requests[req_id]
                raise

    def weights_fingerprint(self) -> str:
        """Names, shapes, dtypes and a strided sample of every parameter's values: two models
        with the same architecture but other weights (two fine-tunes) differ here, and KV made
        by one would be accepted by the other as its own. Computed each time (a weight sync
        writes parameters in place); a few thousand values per parameter."""
        digest = hashlib.blake2b(digest_size=16)
        for name, p in sorted(self.model.named_parameters()):
            flat = p.detach().reshape(-1)
            step = max(1, flat.numel() // FINGERPRINT_SAMPLES)
            sample = flat[::step][:FINGERPRINT_SAMPLES].to("cpu", torch.float32)
            digest.update(f"{name}:{list(p.shape)}:{p.dtype}:".encode())
            digest.update(sample.numpy().tobytes())
        return digest.hexdigest()

    def export_kv(self, req_id: str) -> KVExport:
        with self._model_lock:
            request = self._resident(req_id)
            pages: dict[str, torch.Tensor] = {}
            entries = []
            for name, layer_idx, kind, start, stop in page_spans(
                self.num_layers, request.cached, self.page_tokens
            ):
                layer: Any = request.cache.layers[layer_idx]
                full = layer.keys if kind == "k" else layer.values
                assert full is not None and full.shape[-2] == request.cached, "cache out of step"
                pages[name] = full[0, :, start:stop, :].to("cpu").contiguous().clone()
                entries.append({"name": name, "shape": list(pages[name].shape)})
            meta = {
                "format": META_FORMAT,
                "engine": self.engine,
                "model": self.model_name,
                "weights": self.weights_fingerprint(),
                "tokens": list(request.tokens),
                "cache_tokens": request.cached,
                "num_layers": self.num_layers,
                "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim,
                "dtype": _dtype_name(self.dtype),
                "page_tokens": self.page_tokens,
                "pages": entries,
            }
            return KVExport(pages=pages, meta=meta)

    def import_kv(self, req_id: str, export: KVExport) -> None:
        with self._model_lock:
            with self._state_lock:
                if req_id in self._requests:
                    raise AlreadyExists(f"request {req_id!r} is resident here: evict it first")
            request = self._rebuild(export)  # validates everything before any state changes
            with self._state_lock:
                self._requests[req_id] = request

    def evict(self, req_id: str) -> bool:
        """Forget the request; a generation already running on it finishes but leaves no cache."""
        with self._state_lock:
            return self._requests.pop(req_id, None) is not None

    def load(self) -> InstanceLoad:
        with self._state_lock:
            return InstanceLoad(
                waiting=self._waiting,
                running=self._running,
                cached_tokens=sum(r.cached for r in self._requests.values()),
                requests=tuple(sorted(self._requests)),
            )

    def buffers(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in self.model.named_parameters()}

    @contextmanager
    def _turn(self) -> Iterator[None]:
        """Hold the model lock, counted as waiting until it is ours and as running while held."""
        with self._state_lock:
            self._waiting += 1
        try:
            self._model_lock.acquire()
        finally:
            with self._state_lock:
                self._waiting -= 1
        with self._state_lock:
            self._running += 1
        try:
            yield
        finally:
            with self._state_lock:
                self._running -= 1
            self._model_lock.release()

    def _step(self, request: _Request) -> int:
        """Feed the unfed tokens, append the argmax of the last logits (caller holds the lock)."""
        input_ids = torch.tensor([request.tokens[request.cached :]], device=self.device)
        with torch.no_grad():
            # `past_key_values`: the name in every transformers 5 (5.2x also calls it `cache`).
            out = self.model(input_ids=input_ids, past_key_values=request.cache, use_cache=True)
        token = int(out.logits[0, -1].argmax())
        with self._state_lock:
            request.cached = len(request.tokens)
            request.tokens.append(token)
        return token

    def _resident(self, req_id: str) -> _Request:
        with self._state_lock:
            request = self._requests.get(req_id)
        if request is None:
            raise NotFound(
                f"request {req_id!r} is not resident: start it with prompt_ids or import its KV"
            )
        return request

    def _new_cache(self, data: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> Any:
        return DynamicCache(ddp_cache_data=data, config=self.model.config)

    def _check_tokens(self, tokens: Any, what: str) -> None:
        if not isinstance(tokens, list) or not tokens:
            raise InvalidArgument(f"{what} must be a non-empty list of token ids")
        bad = [t for t in tokens if not _is_int(t) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidArgument(
                f"{what} holds ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
            )

    def _rebuild(self, export: KVExport) -> _Request:
        """A request from an export, or InvalidArgument; touches no engine state."""
        meta = export.meta
        if not isinstance(meta, dict) or not isinstance(export.pages, dict):
            raise InvalidArgument("a KV export needs a dict of pages and a meta dict")
        tokens: Any = meta.get("tokens")
        cached: Any = meta.get("cache_tokens")
        page_tokens: Any = meta.get("page_tokens")
        self._check_tokens(tokens, "meta 'tokens'")
        if not _is_int(cached) or not 0 <= cached < len(tokens):
            raise InvalidArgument(
                f"meta 'cache_tokens' must be an int in [0, {len(tokens)}): the last token "
                f"is fed at the next step, got {cached!r}"
            )
        if not _is_int(page_tokens) or page_tokens < 1:
            raise InvalidArgument(f"meta 'page_tokens' must be an int >= 1, got {page_tokens!r}")
        if self.max_positions is not None and len(tokens) > self.max_positions:
            raise InvalidArgument(f"{len(tokens)} tokens exceed the model's {self.max_positions}")
        for field, needed in (
            ("format", META_FORMAT),
            ("engine", self.engine),
            ("weights", self.weights_fingerprint()),
            ("num_layers", self.num_layers),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("dtype", _dtype_name(self.dtype)),
        ):
            if meta.get(field) != needed:
                raise InvalidArgument(
                    f"KV pages have {field}={meta.get(field)!r}, this model needs {needed!r}: "
                    "import into an engine running the same model"
                )
        spans = page_spans(self.num_layers, cached, page_tokens)
        shapes = {
            name: (self.num_kv_heads, stop - start, self.head_dim)
            for name, *_, start, stop in spans
        }
        listed = [{"name": name, "shape": list(shape)} for name, shape in shapes.items()]
        if meta.get("pages") != listed:
            raise InvalidArgument(
                f"meta 'pages' does not list the {len(listed)} pages that {cached} tokens in "
                f"{page_tokens}-token pages need"
            )
        missing = [name for name in shapes if name not in export.pages]
        extra = sorted(set(export.pages) - set(shapes))
        if missing or extra:
            raise InvalidArgument(f"KV pages missing {missing[:5]}, unexpected {extra[:5]}")
        for name, shape in shapes.items():
            page = export.pages[name]
            if not isinstance(page, torch.Tensor) or page.dtype != self.dtype:
                found = getattr(page, "dtype", type(page).__name__)
                raise InvalidArgument(f"page {name!r} is {found}, this model needs {self.dtype}")
            if tuple(page.shape) != shape:
                raise InvalidArgument(
                    f"page {name!r} has shape {tuple(page.shape)}, expected {shape}"
                )
        blocks = -(-cached // page_tokens)

        def joined(layer: int, kind: str) -> torch.Tensor:
            names = [f"L{layer}.{kind}.{block}" for block in range(blocks)]
            return torch.cat([export.pages[n].to(self.device) for n in names], dim=1).unsqueeze(0)

        data = (
            [(joined(i, "k"), joined(i, "v")) for i in range(self.num_layers)] if cached else None
        )
        return _Request(list(tokens), self._new_cache(data), cached)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
