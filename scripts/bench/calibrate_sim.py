#!/usr/bin/env python3
"""Calibrate the emulated engine's cost model (tensorcast/engine/sim.py `CostModel`) on a small
real model: a Llama-shaped transformers model (hidden 512, 8 layers, 8 heads, 2 KV heads,
intermediate 1408, vocab 32000, random weights, fp32, CPU, eager attention).

Measured (fastest of `--repeats` runs each, after one warm-up, torch threads = the host's cores):
  prefill  forward of n new tokens after c cached ones, for (n, c) in a small grid
  decode   one token for each of b sequences (batched, right-aligned, c cached tokens each)
Fitted by least squares to the cost model's forms:
  prefill_s = prefill_base_s + prefill_per_token_s * n + prefill_per_context_token_s * n*c/1000
  decode_s  = decode_base_s + decode_per_seq_s * b + decode_per_context_token_s * b*c
Prints one JSON line (the fitted parameters, every measurement) and a table.

    python scripts/bench/calibrate_sim.py            # ~1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import transformers

CONFIG = dict(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
)


def timed(setup, fn, repeats: int) -> float:
    """The fastest of `repeats` runs (other processes on the host only ever add time)."""
    samples = []
    for _ in range(repeats):
        state = setup()
        start = time.perf_counter()
        fn(state)
        samples.append(time.perf_counter() - start)
    return min(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**CONFIG, attn_implementation="eager")
    ).eval()

    def cache_of(batch: int, tokens: int):
        cache = transformers.DynamicCache(config=model.config)
        if tokens:
            with torch.no_grad():
                model(input_ids=torch.randint(0, 32000, (batch, tokens)), past_key_values=cache)
        return cache

    def forward(batch: int, new: int, cached: int) -> float:
        import copy

        base = cache_of(batch, cached)
        ids = torch.randint(0, 32000, (batch, new))

        def run(cache) -> None:
            with torch.no_grad():
                model(input_ids=ids, past_key_values=cache)

        return timed(lambda: copy.deepcopy(base), run, args.repeats)

    prefill = [
        (n, c, forward(1, n, c))
        for n, c in [(64, 0), (256, 0), (1024, 0), (2048, 0), (256, 1024), (256, 2048), (512, 2048)]
    ]
    decode = [
        (b, c, forward(b, 1, c))
        for b, c in [(1, 256), (4, 256), (16, 256), (32, 256), (4, 2048), (16, 1024)]
    ]

    a = np.array([[1.0, n, n * c / 1000.0] for n, c, _ in prefill])
    y = np.array([t for *_, t in prefill])
    p_fit = np.linalg.lstsq(a, y, rcond=None)[0]
    a = np.array([[1.0, b, b * c] for b, c, _ in decode])
    y = np.array([t for *_, t in decode])
    d_fit = np.linalg.lstsq(a, y, rcond=None)[0]
    fitted = {
        "prefill_base_s": max(0.0, float(p_fit[0])),
        "prefill_per_token_s": max(0.0, float(p_fit[1])),
        "prefill_per_context_token_s": max(0.0, float(p_fit[2])),
        "decode_base_s": max(0.0, float(d_fit[0])),
        "decode_per_seq_s": max(0.0, float(d_fit[1])),
        "decode_per_context_token_s": max(0.0, float(d_fit[2])),
    }
    print(
        json.dumps(
            {
                "model": CONFIG,
                "torch_threads": torch.get_num_threads(),
                "fitted": {k: round(v, 9) for k, v in fitted.items()},
                "prefill": [{"new": n, "cached": c, "s": round(t, 5)} for n, c, t in prefill],
                "decode": [{"batch": b, "cached": c, "s": round(t, 5)} for b, c, t in decode],
            }
        )
    )
    print(f"{'kind':8} {'n/b':>6} {'cached':>7} {'measured s':>11}")
    for n, c, t in prefill:
        print(f"{'prefill':8} {n:6d} {c:7d} {t:11.4f}")
    for b, c, t in decode:
        print(f"{'decode':8} {b:6d} {c:7d} {t:11.4f}")
    for k, v in fitted.items():
        print(f"{k:30} {v:.3g}")


if __name__ == "__main__":
    main()
