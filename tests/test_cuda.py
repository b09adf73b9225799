"""The GPU tier and CUDA materialization.

Tests marked `cuda` need torch with CUDA and a visible GPU; elsewhere they skip with that reason
(scripts/device-check.sh runs them on a GPU machine). The rest run everywhere: the errors a
process without CUDA gets, the copy pipeline's ordering against a stand-in for a CUDA stream
(the only fake here: it replaces the GPU, and `CudaQueue` is the real implementation it stands
for), and the GPU tier's bookkeeping, which needs no device.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import shards_settled, start_cluster, wait_until
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorcast as tc
from tensorcast.sdk import device as on_device
from tensorcast.transport import cuda, native
from tensorcast.types import TensorMeta
from tensorcast.worker.gpu_tier import TierEntry, TierIndex

HAS_CUDA = cuda.unavailable_reason() is None
needs_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason=f"needs a CUDA GPU: {cuda.unavailable_reason()}"
)
no_cuda = pytest.mark.skipif(HAS_CUDA, reason="checks what a process without CUDA gets")
MIB = 1 << 20


def _tensors(seed: int = 0, big_mib: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {
        "bf16": torch.randn(33, 65, generator=g).to(torch.bfloat16),
        "f32": torch.randn(7, 3, 5, generator=g),
        "i64": torch.randint(-(2**40), 2**40, (129,), generator=g),
        "mask": torch.rand(17, generator=g) > 0.5,
        "odd": torch.randint(0, 255, (13,), dtype=torch.uint8, generator=g),
        "scalar": torch.tensor(3.5, dtype=torch.float16),
        "empty": torch.empty(0, 4),
    }
    if big_mib:  # spans several 64 MiB copy chunks, ends mid-chunk
        out["big"] = torch.randint(0, 255, (big_mib * MIB + 12345,), dtype=torch.uint8, generator=g)
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        x, y = a[name].cpu(), b[name].cpu()
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)), name


# -- everywhere ------------------------------------------------------------------------------------


@no_cuda
def test_cuda_device_without_cuda_is_unavailable_and_says_why(rt):
    art = rt.put(_tensors(), "cuda/none@v1")
    with pytest.raises(tc.Unavailable) as e:
        art.tensor_dict(device="cuda")
    assert "needs CUDA" in str(e.value) and "device='cpu'" in str(e.value)
    assert cuda.unavailable_reason() in str(e.value)  # CPU-only build / no GPU visible
    with pytest.raises(tc.Unavailable):
        art.tensor_dict(device="cuda:1", shared=False)
    _same(art.tensor_dict(), _tensors())  # the CPU path is untouched


def test_unparsable_device_is_invalid_argument(rt):
    art = rt.put(_tensors(), "cuda/bad@v1")
    for device in ("gpu:0", "cuda:x", ""):
        with pytest.raises(tc.InvalidArgument, match="use 'cpu', 'cuda' or 'cuda:N'"):
            art.tensor_dict(device=device)


@no_cuda
def test_worker_gpu_mem_without_cuda_exits_unavailable(cluster):
    proc = cluster.tc(
        "worker",
        "start",
        "--store",
        cluster.record.store_addr,
        "--mem",
        "16MiB",
        "--gpu-mem",
        "16MiB",
        env={"TC_TOKEN": cluster.token},
    )
    assert proc.returncode == 7, proc.stderr  # Unavailable
    assert "--gpu-mem" in proc.stderr and "needs CUDA" in proc.stderr


def test_gpu_prefetch_to_a_worker_without_tier_says_so(rt, cluster):
    art = rt.put(_tensors(), "cuda/notier@v1", worker="worker-1")
    with pytest.raises(tc.InvalidArgument, match="has no GPU tier"):
        art.prefetch("worker-1", device="cuda")
    assert on_device.tier_of(rt, rt.resolve_worker("worker-2")) is None
    # A worker gone but still listed alive has no tier to offer, this time: not an error
    # that fails every read (nor remembered as tierless).
    from dataclasses import replace

    gone = replace(rt.resolve_worker("worker-1"), worker_id="gone", local_socket="no-such")
    assert on_device.tier_of(rt, gone) is None and "gone" not in on_device._tiers
    proc = cluster.tc("prefetch", "cuda/notier@v1", "--to", "worker-1", "--device", "cuda")
    assert proc.returncode == 3 and "no GPU tier" in proc.stderr
    proc = cluster.tc("prefetch", "cuda/notier@v1", "--to", "worker-1", "--device", "tpu:0")
    assert proc.returncode == 3


@given(
    size=st.integers(0, 5000),
    chunk=st.integers(1, 700),
    buffers=st.integers(1, 4),
)
@settings(max_examples=200, deadline=None)
def test_staged_copy_refills_a_buffer_only_after_its_copy_ran(size, chunk, buffers):
    source = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    queue = _LazyQueue(size)
    staging = [torch.empty(chunk, dtype=torch.uint8) for _ in range(buffers)]
    chunks = cuda.staged_copy(source, queue, staging, lambda d, s: native.copy_into(d, 0, s))
    assert chunks == len(cuda.chunk_spans(size, chunk)) == -(-size // chunk)
    assert bytes(queue.dest) == source.tobytes()
    assert queue.waits >= max(0, chunks - buffers)  # each refill of a buffer waited


class _LazyQueue:
    """Stands in for a CUDA stream: a queued copy runs only when waited for (as late as an
    asynchronous device may run it), and fails if its staging buffer changed since submit."""

    def __init__(self, size: int) -> None:
        self.dest = bytearray(size)
        self.queued: list[tuple[int, torch.Tensor, bytes, int]] = []
        self.next_id = 0
        self.ran = -1
        self.waits = 0

    def submit(self, dest_offset: int, source: torch.Tensor) -> int:
        self.queued.append((dest_offset, source, source.numpy().tobytes(), self.next_id))
        self.next_id += 1
        return self.next_id - 1

    def done(self, completion: int) -> bool:
        return completion <= self.ran

    def wait(self, completion: int) -> None:
        self.waits += 1
        while self.queued and self.queued[0][3] <= completion:
            offset, source, snapshot, ident = self.queued.pop(0)
            data = source.numpy().tobytes()
            assert data == snapshot, "a staging buffer was refilled before its copy ran"
            self.dest[offset : offset + len(data)] = data
            self.ran = ident

    def finish(self) -> None:
        self.wait(self.next_id)


@given(size=st.integers(0, 10**6), chunk=st.integers(64, 10**6))
@settings(deadline=None)
def test_chunk_spans_cover_exactly(size, chunk):
    spans = cuda.chunk_spans(size, chunk)
    assert sum(n for _, n in spans) == size
    assert all(o == i * chunk and 0 < n <= chunk for i, (o, n) in enumerate(spans))


def test_views_over_shares_aligned_tensors_and_copies_misaligned_ones():
    flat = torch.arange(64, dtype=torch.uint8)
    metas = [
        TensorMeta("a", "F32", (2, 2), 16, 0),
        TensorMeta("b", "I16", (3,), 6, 17),  # odd offset: cannot be a view
        TensorMeta("c", "U8", (5,), 5, 40),
        TensorMeta("z", "F32", (0,), 0, 0),
    ]
    out = cuda.views_over(flat, metas)
    assert out["a"].data_ptr() == flat.data_ptr()
    assert out["c"].data_ptr() == flat.data_ptr() + 40
    assert out["b"].data_ptr() not in range(flat.data_ptr(), flat.data_ptr() + 64)
    assert out["b"].view(torch.uint8).tolist() == list(range(17, 23))
    assert out["z"].shape == (0,)


def _entry(cid: str, size: int, index: TierIndex) -> TierEntry:
    return index.insert(TierEntry(cid, index.reserve(size), size, ()))


def test_tier_index_evicts_idle_lru_never_held_and_frees_once():
    freed: list[str] = []
    index = TierIndex(12 * 4096, lambda e: freed.append(e.content_id))
    a = _entry("a", 4 * 4096, index)
    b = _entry("b", 4 * 4096, index)
    index.release(a)  # a idle, b held
    c = _entry("c", 4 * 4096, index)  # fits: nothing evicted
    index.release(c)
    assert freed == [] and index.stats().used_bytes == 12 * 4096
    touched = index.hold("c")  # c used after a: a is the least recently used idle entry
    assert touched is c
    index.release(c)
    _entry("d", 4 * 4096, index)
    assert freed == ["a"] and index.stats().evictions_total == 1
    assert sorted(index.content_ids()) == ["b", "c", "d"]
    with pytest.raises(tc.ResourceExhausted, match="in use by callers"):
        index.reserve(5 * 4096)  # c idle (4 pages), nothing free, b and d held
    assert "c" in index.content_ids() and freed == ["a"]  # hopeless: nothing evicted
    with pytest.raises(tc.ResourceExhausted, match="larger --gpu-mem"):
        index.reserve(13 * 4096)
    assert index.reserve(3 * 4096) == c.offset and freed == ["a", "c"]
    assert index.drop("b") and "b" not in index.content_ids()
    assert freed == ["a", "c"]  # still held: freed when released
    index.release(b)
    assert freed == ["a", "c", "b"]
    assert index.stats().used_bytes == 7 * 4096 and index.stats().holds == 1  # d + 3 pages


def test_tier_index_gives_up_cleanly_when_only_fragments_or_rounded_regions_fit():
    freed: list[str] = []
    index = TierIndex(3 * 4096, lambda e: freed.append(e.content_id))
    a, b, c = (_entry(cid, 4096, index) for cid in "abc")
    index.release(a)
    index.release(c)  # a and c idle around a held b: two free pages, never contiguous
    with pytest.raises(tc.ResourceExhausted, match="GPU tier full"):
        index.reserve(2 * 4096)
    assert freed == ["a", "c"] and index.content_ids() == ["b"]
    index.release(b)
    small = TierIndex(2 * 4096, lambda e: None)
    index.release(_entry("one-byte", 1, small))  # holds a whole page of the two
    assert small.reserve(2 * 4096) == 0  # evicting it makes room: counted by its region


# -- on a GPU --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory):
    """A store, worker-1 (no GPU tier) and gpu-1 (a 48 MiB GPU tier over a 256 MiB pool),
    gpu-1 logging to logs/gpu-1.log."""
    if not HAS_CUDA:
        pytest.skip(f"needs a CUDA GPU: {cuda.unavailable_reason()}")
    clusters = start_cluster(tmp_path_factory.mktemp("gpu"), workers=1, mem="512MiB")
    cluster = next(clusters)
    log_path = cluster.state_dir / "logs" / "gpu-1.log"
    ready = cluster.state_dir / "run" / "gpu-1.json"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "tensorcast.cli.main", "worker", "start"),
                *("--store", cluster.record.store_addr, "--name", "gpu-1"),
                *("--mem", "256MiB", "--gpu-mem", "48MiB", "--ready-file", str(ready)),
            ],
            env={**os.environ, "TC_TOKEN": cluster.token},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until(lambda: ready.exists() or proc.poll() is not None, 60)
        assert ready.exists(), log_path.read_text()[-3000:]
        with cluster.connect() as rt:
            wait_until(lambda: shards_settled(rt, 2), 30, 0.1)
        yield cluster
    finally:
        proc.terminate()
        proc.wait(30)
        clusters.close()  # tc down


@pytest.fixture
def grt(gpu_cluster):
    runtime = gpu_cluster.connect()
    yield runtime
    runtime.close()


def _tier(rt) -> dict:
    return on_device.tier_stats(rt, rt.resolve_worker("gpu-1"))


@needs_cuda
@pytest.mark.parametrize("route", ["register", "staging", "auto"])
def test_pool_to_gpu_equals_cpu(grt, monkeypatch, route):
    monkeypatch.setenv("TC_CUDA_COPY", route)
    tensors = _tensors(seed=1, big_mib=150)
    art = grt.put(tensors, f"cuda/pool-{route}@v1", worker="worker-1")
    before = _tier(grt)
    on_gpu = art.tensor_dict(device="cuda:0", shared=False)  # worker-1 has no GPU tier
    assert all(t.device == torch.device("cuda", 0) for t in on_gpu.values())
    _same(on_gpu, tensors)
    assert _tier(grt)["loads_total"] == before["loads_total"]  # shared=False loads nothing
    report = on_device.last_copy_report
    assert report.route in {"register": ("register", "register+staging")}.get(route, ("staging",))
    assert report.size_bytes == art.size_bytes


@needs_cuda
def test_private_copy_is_written_by_the_workers_dma(grt):
    tensors = _tensors(seed=2, big_mib=70)
    art = grt.put(tensors, "cuda/dma@v1", worker="gpu-1")  # in the pool of the tier's worker
    before = _tier(grt)
    private = art.tensor_dict(device="cuda", shared=False)
    assert on_device.last_copy_report.route == "worker"  # gpu-1 wrote into our buffer
    _same(private, tensors)
    assert _tier(grt)["loads_total"] == before["loads_total"]  # the tier was not used
    assert art.content_id not in _tier(grt)["contents"]


@needs_cuda
@pytest.mark.parametrize("route", ["register", "staging"])
def test_copy_routes_equal_source(route):
    host = torch.randint(0, 255, (3 * cuda.CHUNK_BYTES + 4097,), dtype=torch.uint8)
    dest = torch.full_like(host, 7, device="cuda")  # poisoned: every byte must be written
    report = cuda.copy_to_device(host, dest, route)
    assert torch.equal(dest.cpu(), host)
    # 4 chunks of at most 64 MiB (registering adds one when the buffer starts mid-page)
    assert report.chunks >= 4 and report.route in (route, "register+staging")
    pinned = cuda.PinnedHost(memoryview(bytearray(host.numpy().tobytes())))
    try:
        dest.fill_(7)
        report = cuda.copy_to_device(pinned.tensor, dest, "pinned" if pinned.pinned else "staging")
        assert torch.equal(dest.cpu(), host)
    finally:
        pinned.close()


def _odd_safetensors(path) -> dict[str, torch.Tensor]:
    """A file whose F32 tensor starts at byte 3 of the data (writers may do that)."""
    tensors = {"a": torch.tensor([1, 2, 3], dtype=torch.uint8), "b": torch.randn(5, 7)}
    header = {
        "a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "b": {"dtype": "F32", "shape": [5, 7], "data_offsets": [3, 143]},
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    data = tensors["a"].numpy().tobytes() + tensors["b"].numpy().tobytes()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return tensors


@needs_cuda
def test_misaligned_file_tensors_reach_the_gpu(grt, tmp_path):
    tensors = _odd_safetensors(tmp_path / "odd.safetensors")
    art = grt.put_files("cuda/odd@v1", tmp_path / "odd.safetensors", worker="worker-1")
    assert {t.name: t.offset_bytes % 4 for t in art.info.tensors}["b"] == 3
    _same(art.tensor_dict(device="cuda", shared=False), tensors)
    _same(art.tensor_dict(device="cuda"), tensors)  # through the GPU tier


@needs_cuda
def test_device_index_out_of_range_is_invalid(grt):
    art = grt.put(_tensors(), "cuda/range@v1")
    with pytest.raises(tc.InvalidArgument, match="sees"):
        art.tensor_dict(device=f"cuda:{torch.cuda.device_count()}")


CHILD = textwrap.dedent(
    """
    import json, os, sys, torch
    import tensorcast as tc
    rt = tc.connect(state_dir=sys.argv[1])
    t = rt.artifact(sys.argv[2]).tensor_dict(device="cuda")
    w = t["w"]
    print(json.dumps({"first": w[0].item(), "ptr": w.data_ptr()}), flush=True)
    if sys.argv[3] == "mark":
        w[0] = 12345.0
        torch.cuda.synchronize()
    if sys.argv[3] == "hang":
        sys.stdin.read()  # holds the tier range until killed
    """
)


def _child(cluster, art_id: str, mode: str, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(cluster.state_dir), art_id, mode],
        stdout=subprocess.PIPE,
        text=True,
        **kw,
    )


@needs_cuda
def test_gpu_tier_is_the_same_device_memory_in_every_process(gpu_cluster, grt):
    w = torch.arange(1024, dtype=torch.float32)
    art = grt.put({"w": w, "b": torch.ones(3)}, "cuda/shared@v1", worker="worker-1")
    before = _tier(grt)
    out, _ = _child(gpu_cluster, art.art_id, "mark").communicate(timeout=120)
    assert json.loads(out)["first"] == 0.0  # loaded into the tier, read zero-copy
    loaded = _tier(grt)
    assert loaded["loads_total"] == before["loads_total"] + 1
    assert art.content_id in loaded["contents"]
    # The child wrote into the shared range; this process maps the same memory and sees it
    # (a copy from the pool would still read 0), and the tier copied nothing more.
    mine = art.tensor_dict(device="cuda")
    assert mine["w"][0].item() == 12345.0 and torch.equal(mine["w"][1:].cpu(), w[1:])
    assert _tier(grt)["loads_total"] == loaded["loads_total"]
    private = art.tensor_dict(device="cuda", shared=False)  # device-to-device from the tier
    assert private["w"][0].item() == 12345.0
    private["w"][1] = -1.0
    assert mine["w"][1].item() == 1.0  # a private copy is private
    assert art.tensor_dict()["w"][0].item() == 0.0  # the pool copy never changed


@needs_cuda
def test_gpu_tier_holds_end_when_tensors_die_or_the_caller_crashes(gpu_cluster, grt):
    art = grt.put({"w": torch.zeros(1000)}, "cuda/holds@v1", worker="worker-1")
    gc.collect()  # earlier tests' tensors: their holds are released in the background
    wait_until(lambda: _tier(grt)["holds"] == 0, 10)
    held = 0
    tensors = art.tensor_dict(device="cuda")
    assert _tier(grt)["holds"] == held + 1
    view = tensors["w"][10:20]
    del tensors
    gc.collect()
    assert _tier(grt)["holds"] == held + 1  # a view still uses the range
    del view
    gc.collect()
    wait_until(lambda: _tier(grt)["holds"] == held, 10)
    child = _child(gpu_cluster, art.art_id, "hang", stdin=subprocess.PIPE)
    assert child.stdout is not None
    json.loads(child.stdout.readline())
    assert _tier(grt)["holds"] == held + 1
    os.kill(child.pid, signal.SIGKILL)
    child.wait(30)
    wait_until(lambda: _tier(grt)["holds"] == held, 20)  # its connection closed


@needs_cuda
def test_gpu_tier_evicts_idle_contents_and_falls_back_to_the_pool_when_full(grt):
    size = 14 * MIB  # 48 MiB tier: three fit, a fourth needs room
    arts = [
        grt.put({"x": torch.full((size // 4,), float(i))}, f"cuda/evict{i}@v1", worker="worker-1")
        for i in range(4)
    ]
    for art in arts:  # idle once loaded
        art.prefetch("gpu-1", device="cuda")
    start = _tier(grt)
    assert {a.content_id for a in arts[1:]} <= set(start["contents"])  # LRU: 0 left first
    assert arts[0].content_id not in start["contents"] and start["evictions_total"] >= 1
    held = [a.tensor_dict(device="cuda") for a in arts[1:]]  # all three held
    fallback = arts[0].tensor_dict(device="cuda")  # no room: a private copy, by gpu-1's DMA
    assert on_device.last_copy_report.route == "worker"
    assert fallback["x"][0].item() == 0.0 and fallback["x"].device.type == "cuda"
    assert arts[0].content_id not in _tier(grt)["contents"]
    assert [h["x"][-1].item() for h in held] == [1.0, 2.0, 3.0]


@needs_cuda
def test_prefetch_device_cuda_warms_the_tier(gpu_cluster, grt):
    grt.put({"y": torch.ones(100)}, "cuda/warm@v1", worker="worker-1")
    first = gpu_cluster.tc(
        "prefetch", "cuda/warm@v1", "--to", "gpu-1", "--device", "cuda", "--json", check=True
    )
    again = gpu_cluster.tc(
        "prefetch", "cuda/warm@v1", "--to", "gpu-1", "--device", "cuda", "--json", check=True
    )
    assert json.loads(first.stdout)["already_present"] is False
    assert json.loads(again.stdout)["already_present"] is True
    assert grt.artifact("cuda/warm@v1").content_id in _tier(grt)["contents"]


@needs_cuda
def test_kv_pages_from_and_into_gpu_buffers(grt):
    pages = grt.pages()
    src = {
        f"kv/gpu/{i}": torch.randn(16, 128, device="cuda", dtype=torch.bfloat16) for i in range(9)
    }
    refs = pages.put_pages(src, ttl_s=60)
    for ref, (key, t) in zip(refs, src.items()):  # same hash as the CPU bytes would get
        cpu_bytes = t.cpu().reshape(-1).view(torch.uint8).numpy()
        assert ref.key == key and ref.hash == native.hash_buffer(cpu_bytes)
    into = [torch.zeros(16, 128, device="cuda", dtype=torch.bfloat16) for _ in src]
    got = pages.get_pages([*list(src), "kv/gpu/absent"], into=[*into, torch.zeros_like(into[0])])
    assert got[-1] is None
    for page, buffer, t in zip(got, into, src.values()):
        assert page is not None and torch.equal(buffer, t)  # written in place
        assert page.tensor().data_ptr() == buffer.data_ptr()
    on_cpu = pages.get_pages(list(src))
    assert all(torch.equal(p.tensor(), t.cpu()) for p, t in zip(on_cpu, src.values()))
    with pytest.raises(tc.InvalidArgument, match="does not fit"):
        pages.get_pages([next(iter(src))], into=[torch.zeros(8, device="cuda")])


@needs_cuda
def test_closing_a_page_connection_unlocks_its_pool_mapping(grt):
    """Pages put from a GPU page-lock the home's pool mapping once per connection; closing the
    connection (a worker gone, the caller done) unregisters it: left registered, a dead
    worker's pool would stay locked in memory for as long as the caller runs."""
    from tensorcast.sdk import gpu_pages

    pages = grt.pages()
    pages.put_pages({"kv/gpu/pinned": torch.ones(4096, device="cuda")}, ttl_s=60)
    held = list(gpu_pages._pinned.values())
    assert held
    pages.close()
    assert not any(p.pinned for p in held) and len(gpu_pages._pinned) == 0
    got = pages.get_pages(["kv/gpu/pinned"], into=[torch.zeros(4096, device="cuda")])
    assert got[0] is not None  # a new connection, pinned again on use


@needs_cuda
def test_load_model_on_cuda_matches_cpu(grt, tmp_path):
    transformers = pytest.importorskip("transformers")
    from tensorcast.integrations.transformers import load_model

    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    grt.put_files("cuda/llama@v1", tmp_path)
    prompt = torch.tensor([[1, 5, 9, 2]])
    cpu = load_model(grt, "cuda/llama@v1")
    for shared in (True, False):
        gpu = load_model(grt, "cuda/llama@v1", device="cuda", shared=shared)
        assert all(p.device.type == "cuda" for p in gpu.parameters())
        with torch.no_grad():
            a = cpu(prompt).logits
            b = gpu(prompt.cuda()).logits.cpu()
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
