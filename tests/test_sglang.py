"""SGLang HiCache storage backend (tensorcast/integrations/sglang.py) against SGLang's own
`HiCacheStorage` base class and storage factory (sglang 0.5.23 installed without its GPU
dependencies) and a real cluster: loaded through `dynamic`, pages shared between instances,
the zero-copy `batch_get_v1/batch_set_v1` with host-pool indices, damaged pages read as misses.

SGLang's host KV pool module imports torchvision (a CUDA build here), so the pools below are
stand-ins with the same page layouts and methods as its `MHATokenToKVPoolHost` (page_first:
`[2, tokens, layers, heads, dim]`; layer_first: `[2, layers, tokens, heads, dim]`).
"""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("CI"):  # CI installs sglang (scripts/setup-engines.sh): never skip there
    import sglang  # noqa: F401
else:
    pytest.importorskip("sglang", reason="sglang is not installed: run scripts/setup.sh")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from tensorcast.integrations.sglang import TensorCastHiCacheStorage
from tensorcast.sharding import shard_of

PAGE = 4  # tokens per page
LAYERS, HEADS, DIM = 2, 2, 8


class HostPool:
    """The host KV pool's page interface, laid out as SGLang's MHA host pool lays it out."""

    def __init__(self, tokens: int, layout: str = "page_first", seed: int = 0) -> None:
        self.page_size, self.layout, self.size = PAGE, layout, tokens
        shape = (
            (2, tokens, LAYERS, HEADS, DIM)
            if layout == "page_first"
            else (2, LAYERS, tokens, HEADS, DIM)
        )
        generator = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.randn(shape, generator=generator).to(torch.bfloat16)

    def _page(self, index: int) -> torch.Tensor:
        if self.layout == "page_first":
            return self.kv_buffer[:, index : index + PAGE]
        return self.kv_buffer[:, :, index : index + PAGE]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self._page(index)
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(2 * LAYERS * PAGE * HEADS * DIM, dtype=torch.bfloat16)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self._page(index)[...] = data_page.reshape(self._page(index).shape)


def _backend(
    cluster,
    model: str = "tiny",
    rank: int = 0,
    size: int = 1,
    v1: bool = True,
    pp: tuple[int, int] = (0, 1),
) -> HiCacheStorage:
    config = HiCacheStorageConfig(
        tp_rank=rank,
        tp_size=size,
        pp_rank=pp[0],
        pp_size=pp[1],
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=model,
        extra_config={
            "backend_name": "tensorcast",
            "module_path": "tensorcast.integrations.sglang",
            "class_name": "TensorCastHiCacheStorage",
            **({"interface_v1": 1} if v1 else {}),
            "state_dir": str(cluster.state_dir),
        },
    )
    return StorageBackendFactory.create_backend("dynamic", config, None)


def test_loaded_by_sglangs_factory_and_shared_between_instances(cluster):
    writer, reader = _backend(cluster), _backend(cluster)
    assert isinstance(writer, HiCacheStorage)
    assert isinstance(writer, TensorCastHiCacheStorage)
    values = [torch.arange(64, dtype=torch.float32) + i for i in range(3)]
    assert writer.batch_set(["h0", "h1", "h2"], values)
    assert writer.set("solo", torch.ones(16, dtype=torch.bfloat16))
    # Another instance of the same model sees them; prefix semantics stop at the first miss.
    assert reader.batch_exists(["h0", "h1", "h2"]) == 3
    assert reader.batch_exists(["h0", "nope", "h2"]) == 1
    assert reader.exists("solo") and not reader.exists("nope")
    got = reader.batch_get(["h0", "h2", "nope"])
    assert torch.equal(got[0], values[0]) and torch.equal(got[1], values[2]) and got[2] is None
    targets = [torch.empty(64, dtype=torch.float32) for _ in range(2)]
    filled = reader.batch_get(["h1", "h0"], targets)
    assert filled[0] is targets[0] and torch.equal(targets[0], values[1])
    assert torch.equal(targets[1], values[0])
    one = reader.get("solo", torch.empty(16, dtype=torch.bfloat16))
    assert one is not None and torch.equal(one, torch.ones(16, dtype=torch.bfloat16))
    # Another model, or another tensor-parallel rank (its own heads), never sees them.
    assert _backend(cluster, model="other").batch_exists(["h0"]) == 0
    assert _backend(cluster, rank=1, size=2).batch_exists(["h0"]) == 0
    # Pipeline stages hold other layers under the same hashes: they never meet either.
    stage0, stage1 = _backend(cluster, pp=(0, 2)), _backend(cluster, pp=(1, 2))
    assert stage0.batch_set(["h9"], [values[0]])
    assert stage0.batch_exists(["h9"]) == 1 and stage1.batch_exists(["h9"]) == 0


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_zero_copy_pages_between_host_pools(cluster, layout):
    source, target = HostPool(32, layout, seed=1), HostPool(32, layout, seed=2)
    writer, reader = (
        _backend(cluster, model=f"v1-{layout}"),
        _backend(cluster, model=f"v1-{layout}"),
    )
    writer.register_mem_pool_host(source)
    reader.register_mem_pool_host(target)
    keys = ["p0", "p1", "p2"]
    written = torch.tensor([8, 9, 10, 11, 0, 1, 2, 3, 20, 21, 22, 23])  # pages at 8, 0, 20
    assert all(writer.batch_set_v1(keys, written))
    assert reader.batch_exists(keys) == 3
    read = torch.tensor([4, 5, 6, 7, 12, 13, 14, 15, 28, 29, 30, 31])  # other slots
    assert reader.batch_get_v1(keys, read) == [True, True, True]
    for w, r in zip((8, 0, 20), (4, 12, 28)):
        assert torch.equal(target.get_data_page(r), source.get_data_page(w))
    assert reader.batch_get_v1(["p0", "missing"], read[:8]) == [True, False]


def test_a_damaged_page_reads_as_missing(cluster):
    source, target = HostPool(16, seed=3), HostPool(16, seed=4)
    writer, reader = _backend(cluster, model="damage"), _backend(cluster, model="damage")
    writer.register_mem_pool_host(source)
    reader.register_mem_pool_host(target)
    assert all(writer.batch_set_v1(["d0", "d1"], torch.arange(8)))
    # Overwrite the stored bytes of d1's first part in its home's pool (same host: mapped).
    with cluster.connect() as rt:
        pages = rt.pages()
        key = reader._pool_keys("d1", 2)[0]
        table = pages.table()
        shard = shard_of(key, table.num_shards)
        lease = table.lease(shard)
        conn = pages._local(lease)
        (found,) = conn.get([(key, shard, lease.token)])
        conn.arena()[found[0] : found[0] + 8] = b"garbage!"
    assert reader.batch_get_v1(["d0", "d1"], torch.tensor([0, 1, 2, 3, 8, 9, 10, 11])) == [
        True,
        False,
    ]
    assert torch.equal(target.get_data_page(0), source.get_data_page(0))
    assert not torch.equal(target.get_data_page(8), source.get_data_page(4))


def test_without_interface_v1_values_are_found_with_a_host_pool_registered(cluster):
    """SGLang registers its host pool whatever the interface; without interface_v1 it stores
    and reads values by key (batch_set / batch_get), and lookups must ask for those keys."""
    writer, reader = (
        _backend(cluster, model="values", v1=False),
        _backend(cluster, model="values", v1=False),
    )
    writer.register_mem_pool_host(HostPool(16, seed=5))
    reader.register_mem_pool_host(HostPool(16, seed=6))
    value = torch.arange(32, dtype=torch.float32)
    assert writer.batch_set(["g0"], [value])
    assert reader.batch_exists(["g0", "g1"]) == 1 and reader.exists("g0")
    (got,) = reader.batch_get(["g0"])
    assert got is not None and torch.equal(got, value)


def test_values_are_shared_only_between_pools_of_one_layout_and_dtype(cluster):
    """Without interface_v1 values are pages by key: two engines of one model whose host
    pools lay a page out differently (layer-first against page-first) would read each
    other's pages as transposed KV, so they do not share them; a value read into a target
    of another dtype is a miss."""
    page_first = _backend(cluster, model="layouts", v1=False)
    layer_first = _backend(cluster, model="layouts", v1=False)
    same = _backend(cluster, model="layouts", v1=False)
    page_first.register_mem_pool_host(HostPool(16, "page_first", seed=7))
    layer_first.register_mem_pool_host(HostPool(16, "layer_first", seed=8))
    same.register_mem_pool_host(HostPool(16, "page_first", seed=9))
    value = torch.randn(2 * LAYERS * PAGE * HEADS * DIM).to(torch.bfloat16)
    assert page_first.batch_set(["l0"], [value])
    assert layer_first.batch_exists(["l0"]) == 0
    assert layer_first.batch_get(["l0"]) == [None]
    assert same.batch_exists(["l0"]) == 1
    target = torch.zeros_like(value)
    assert same.batch_get(["l0"], [target]) == [target] and torch.equal(target, value)
    other_dtype = torch.zeros(value.numel() // 2, dtype=torch.float32)  # as many bytes
    assert same.batch_get(["l0"], [other_dtype]) == [None]
