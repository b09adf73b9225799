"""SGLang HiCache storage backend over TensorCast KV pages (paper §6.3).

SGLang's hierarchical cache keeps KV pages in GPU memory, then host memory, then an L3 storage
backend shared by every instance; this is such a backend, so the whole TensorCast cluster holds
the L3 pages. Load it through SGLang's `dynamic` backend (SGLang also ships a built-in backend
*named* `tensorcast`, which imports a different project's `tensorcast.api.store`; it is not this
one):

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "tensorcast",
            "module_path": "tensorcast.integrations.sglang",
            "class_name": "TensorCastHiCacheStorage", "interface_v1": 1}'

Extra config (besides the three names): `addr`, `token`, `state_dir` (as `tc.connect()`),
`ttl_s` (page lease, default 3600), `model_key` (default: SGLang's model name),
`interface_v1` (1: SGLang hands host-pool indices and pages move straight between the host
pool and the shard homes, `batch_get_v1` / `batch_set_v1`).

Keys: SGLang names a page by the hash chain of its tokens; the backend prefixes it with the
model, the tensor-parallel rank (MHA heads are split per rank; an MLA page is the same on every
rank) and, for host-pool pages, the page layout, so different models and layouts never meet. A
page whose bytes fail their hash reads as missing: SGLang recomputes it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from tensorcast.errors import InvalidArgument, TensorcastError
from tensorcast.integrations.connection import connection_options, runtime
from tensorcast.integrations.vllm.keys import digest_of
from tensorcast.tensors import dtype_name

log = logging.getLogger("tensorcast.sglang")
DEFAULT_TTL_S = 3600.0
FACTORY_KEYS = {"backend_name", "module_path", "class_name", "interface_v1"}
EXTRA_KEYS = {"addr", "token", "state_dir", "ttl_s", "model_key"}


def _rank_of(config: HiCacheStorageConfig) -> str:
    """Which share of the model's KV this process holds: its tensor-parallel rank (MHA heads
    are split per rank; an MLA page is the same on every rank), and its pipeline stage and
    context-parallel ranks when there are several (each holds other layers or other tokens)."""
    rank = "mla" if config.is_mla_model else f"{config.tp_rank}of{config.tp_size}"
    for name in ("pp", "attn_cp", "dcp"):
        size = int(getattr(config, f"{name}_size", 1) or 1)
        if size > 1:
            rank += f".{name}{int(getattr(config, f'{name}_rank', 0) or 0)}of{size}"
    return rank


class TensorCastHiCacheStorage(HiCacheStorage):
    """`HiCacheStorage` whose pages are TensorCast KV pages in the cluster's shard homes."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        unknown = sorted(set(extra) - FACTORY_KEYS - EXTRA_KEYS)
        if unknown:
            raise InvalidArgument(
                f"hicache storage extra config: unknown keys {unknown} for the TensorCast "
                f"backend (known: {sorted(EXTRA_KEYS)})"
            )
        self.config = storage_config
        self.ttl_s = float(extra.get("ttl_s", DEFAULT_TTL_S))
        model = str(extra.get("model_key") or storage_config.model_name or "model")
        self.prefix = f"sglang/{digest_of(model)}/{_rank_of(storage_config)}"
        self.is_writer = storage_config.is_storage_writer
        # SGLang moves host-pool pages (batch_*_v1) only with interface_v1; otherwise it stores
        # values by key (batch_set/batch_get) even with a host pool registered.
        self.interface_v1 = bool(extra.get("interface_v1"))
        self._pages = runtime(**connection_options(extra, "hicache storage"), role="sglang").pages()
        self.mem_pool_host: Any = None
        self._layout = ""

    # -- keys -----------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        """A value's page: under the host pool's layout once one is registered (two engines
        whose pools lay a page out differently, or in another dtype, never share it)."""
        if self._layout:
            return f"{self.prefix}/{self._layout}/v/{key}"
        return f"{self.prefix}/{key}"

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        page = mem_pool_host.get_data_page(0, flat=False)
        self._layout = digest_of(
            {
                "layout": getattr(mem_pool_host, "layout", ""),
                "page_size": mem_pool_host.page_size,
                "shape": list(page.shape),
                "dtype": str(page.dtype),
            }
        )

    def _parts(self, index: int) -> list[torch.Tensor]:
        """The host pool page at token `index` as contiguous tensors over the pool's memory
        (one for a page-first MLA page, K and V for a page-first MHA one), or [] when the
        page is scattered (layer-first layouts: copied through a flat staging page)."""
        page = self.mem_pool_host.get_data_page(index, flat=False)
        if page.is_contiguous():
            return [page]
        parts = [page[i] for i in range(page.shape[0])] if page.dim() > 1 else []
        return parts if all(p.is_contiguous() for p in parts) else []

    def _pool_keys(self, key: str, parts: int) -> list[str]:
        return [f"{self.prefix}/{self._layout}/{key}.{i}" for i in range(max(parts, 1))]

    # -- the zero-copy interface (interface_v1) -------------------------------------------

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        if not self.is_writer:
            return [True] * len(keys)
        pages: dict[str, Any] = {}
        size = self.mem_pool_host.page_size
        for i, key in enumerate(keys):
            index = int(host_indices[i * size])
            parts = self._parts(index)
            values = parts or [self.mem_pool_host.get_data_page(index, flat=True)]
            pages.update(zip(self._pool_keys(key, len(values)), values))
        try:
            self._pages.put_pages(pages, self.ttl_s)
        except TensorcastError as e:
            log.warning("TensorCast HiCache: storing %d pages failed: %s", len(keys), e)
            return [False] * len(keys)
        return [True] * len(keys)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Copy each page straight into its host-pool slots; False for a page that is missing
        or fails its hash (SGLang stops its prefetch at the first False)."""
        size = self.mem_pool_host.page_size
        wanted: list[str] = []
        into: list[Any] = []
        staged: dict[int, tuple[int, torch.Tensor]] = {}  # key position -> (index, staging)
        owner: list[int] = []
        for i, key in enumerate(keys):
            index = int(host_indices[i * size])
            parts = self._parts(index)
            if not parts:
                staging = self.mem_pool_host.get_dummy_flat_data_page()
                staged[i] = (index, staging)
                parts = [staging]
            for name, part in zip(self._pool_keys(key, len(parts)), parts):
                wanted.append(name)
                into.append(part.view(-1).view(torch.uint8))
                owner.append(i)
        try:
            found = self._pages.get_pages(wanted, into=into)
        except TensorcastError as e:
            log.warning("TensorCast HiCache: reading %d pages failed: %s", len(keys), e)
            return [False] * len(keys)
        ok = [True] * len(keys)
        for i, page, buffer in zip(owner, found, into):
            if page is None or page.data.nbytes != buffer.numel():
                ok[i] = False
        for i, (index, staging) in staged.items():
            if ok[i]:
                self.mem_pool_host.set_from_flat_data_page(index, staging)
        return ok

    # -- the value interface --------------------------------------------------------------

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        (value,) = self.batch_get([key], None if target_location is None else [target_location])
        return value

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Pages by key; with `target_locations` (tensors, one per key) the bytes land in them
        and they are returned; None where a page is missing or damaged."""
        names = [self._key(k) for k in keys]
        into = None
        if target_locations is not None:
            into = [t.view(-1).view(torch.uint8) for t in target_locations]
        try:
            found = self._pages.get_pages(names, into=into)
        except TensorcastError as e:
            log.warning("TensorCast HiCache: reading %d pages failed: %s", len(keys), e)
            return [None] * len(keys)
        out: list[torch.Tensor | None] = []
        for i, page in enumerate(found):
            if page is None:
                out.append(None)
            elif target_locations is not None:
                target = target_locations[i]
                fits = page.data.nbytes == into[i].numel() and page.dtype in (  # type: ignore[index]
                    dtype_name(target.dtype),
                    "U8",  # stored from raw bytes
                )
                out.append(target if fits else None)
            else:
                out.append(page.tensor())
        return out

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        if values is None or len(values) != len(keys):
            raise InvalidArgument("batch_set needs one value (a CPU tensor) per key")
        if not self.is_writer:
            return True
        pages = {self._key(k): v.contiguous() for k, v in zip(keys, values)}
        try:
            self._pages.put_pages(pages, self.ttl_s)
        except TensorcastError as e:
            log.warning("TensorCast HiCache: storing %d pages failed: %s", len(keys), e)
            return False
        return True

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many of `keys`, from the first, are stored (SGLang's prefix semantics). Host
        pool pages count only when every part is there."""
        if not keys:
            return 0
        if self.interface_v1 and self.mem_pool_host is not None and self._layout:
            parts = max(1, len(self._parts(0)))
            names = [n for k in keys for n in self._pool_keys(k, parts)]
        else:
            parts, names = 1, [self._key(k) for k in keys]
        try:
            flags = self._pages.exists_pages(names)
        except TensorcastError as e:
            log.warning("TensorCast HiCache: lookup failed, treating as a miss: %s", e)
            return 0
        for i in range(len(keys)):
            if not all(flags[i * parts : (i + 1) * parts]):
                return i
        return len(keys)

    def clear(self) -> None:
        """Pages expire with their lease (`ttl_s`); TensorCast has no bulk delete of pages."""

    def get_stats(self) -> None:
        return None
