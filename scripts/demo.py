#!/usr/bin/env python3
"""The README's first command: a local cluster, a generated model put into it and materialized
zero-copy in a fresh process, with timings; the cluster is stopped at the end."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MATERIALIZE = """
import json, sys, time
t0 = time.perf_counter()
import torch
import tensorcast as tc
rt = tc.connect()
art = rt.artifact(sys.argv[1])
t1 = time.perf_counter()
tensors = art.tensor_dict()
t2 = time.perf_counter()
checksum = sum(float(t.float().sum()) for t in tensors.values())
t3 = time.perf_counter()
print(json.dumps({"tensors": len(tensors), "bytes": art.size_bytes, "import_connect_s": t1 - t0,
                  "tensor_dict_s": t2 - t1, "read_all_s": t3 - t2, "checksum": checksum}))
"""


def tc(*args: str) -> str:
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "tensorcast.cli.main", *args], capture_output=True, text=True
    )
    print(f"$ tc {' '.join(args)}   ({time.perf_counter() - started:.2f}s)")
    print(proc.stdout.rstrip())
    if proc.returncode:
        sys.exit(f"tc {args[0]} failed ({proc.returncode}): {proc.stderr}")
    return proc.stdout


def make_model(directory: Path, size_mib: int) -> None:
    """A Llama-shaped model in two safetensors shards (random bf16 weights)."""
    import torch
    from safetensors.torch import save_file

    hidden = 1024
    layers = max(1, (size_mib - 16) // 17)  # ~17 MiB per layer, 16 MiB of embeddings
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    shards[0]["model.embed_tokens.weight"] = torch.randn(8192, hidden, dtype=torch.bfloat16)
    for i in range(layers):
        p = f"model.layers.{i}."
        shard = shards[0 if i < layers // 2 else 1]
        for name, shape in [
            ("self_attn.q_proj.weight", (hidden, hidden)),
            ("self_attn.k_proj.weight", (hidden // 4, hidden)),
            ("self_attn.v_proj.weight", (hidden // 4, hidden)),
            ("self_attn.o_proj.weight", (hidden, hidden)),
            ("mlp.gate_proj.weight", (2 * hidden, hidden)),
            ("mlp.up_proj.weight", (2 * hidden, hidden)),
            ("mlp.down_proj.weight", (hidden, 2 * hidden)),
            ("input_layernorm.weight", (hidden,)),
        ]:
            shard[p + name] = torch.randn(shape, dtype=torch.bfloat16)
    for i, shard in enumerate(shards):
        save_file(shard, directory / f"model-0000{i + 1}-of-00002.safetensors")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-mib", type=int, default=512, help="model size")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tc-demo-"))
    os.environ["TC_STATE_DIR"] = str(work / "state")
    model = work / "model"
    model.mkdir()
    started = time.perf_counter()
    make_model(model, args.size_mib)
    print(
        f"generated a {args.size_mib} MiB model in {model} ({time.perf_counter() - started:.1f}s)"
    )
    # Room for two copies: a second put of the same files is deduplicated after it is read.
    tc("up", "--workers", "1", "--mem", f"{2 * args.size_mib + 256}MiB")
    try:
        tc("put", "demo-llama@v1", str(model))
        tc("ls")
        tc("put", "demo-llama@copy", str(model))  # same content: stored once
        out = subprocess.run(
            [sys.executable, "-c", MATERIALIZE, "demo-llama@v1"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        r = json.loads(out)
        print(
            f"fresh process materialized {r['tensors']} tensors ({r['bytes'] / 2**20:.0f} MiB):"
            f" tensor_dict() {r['tensor_dict_s'] * 1000:.1f} ms (zero-copy),"
            f" reading every byte {r['read_all_s']:.2f}s,"
            f" import torch+tensorcast and connect {r['import_connect_s']:.2f}s"
        )
        tc("status")
    finally:
        tc("down")


if __name__ == "__main__":
    main()
