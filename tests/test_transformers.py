"""transformers integration: a tiny Llama from a config (no downloads), saved with save_pretrained,
put with `tc put`, loaded in a fresh process; greedy tokens must equal loading from disk."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

GENERATE = r"""
import json, sys, torch, transformers
import tensorcast as tc
from tensorcast.integrations.transformers import load_model

state_dir, directory, tp_size = sys.argv[1], sys.argv[2], int(sys.argv[3])
prompt = torch.tensor([[1, 5, 9, 2]])
def greedy(model):
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    return out[0].tolist()
reference = greedy(transformers.AutoModelForCausalLM.from_pretrained(directory))
rt = tc.connect(state_dir=state_dir)
model = load_model(rt, "tiny-llama@v1", tp_size=tp_size)
ptr = model.model.layers[0].mlp.up_proj.weight.data_ptr()
maps = open("/proc/self/maps").read().splitlines()
mapped = any(int(l.split()[0].split("-")[0], 16) <= ptr < int(l.split()[0].split("-")[1], 16)
             and "memfd:tensorcast-pool" in l for l in maps)
print(json.dumps({"reference": reference, "tensorcast": greedy(model), "zero_copy": mapped}))
"""


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    directory = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="60KB")
    assert (directory / "model.safetensors.index.json").exists()  # a sharded checkpoint
    return directory


@pytest.mark.parametrize("tp_size", [1, 2])
def test_load_model_generates_like_from_pretrained(cluster, tiny_llama, tp_size):
    if tp_size == 1:
        cluster.tc("put", "tiny-llama@v1", str(tiny_llama), check=True)
    proc = subprocess.run(
        [sys.executable, "-c", GENERATE, str(cluster.state_dir), str(tiny_llama), str(tp_size)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tensorcast"] == result["reference"]
    assert len(result["reference"]) == 4 + 12
    assert result["zero_copy"] == (tp_size == 1)  # reassembled TP shards are new tensors
    with cluster.connect() as rt:  # the TP-rank views were the load's own: none is left
        assert [a.art_id for a in rt.list_artifacts("tiny-llama@v1/")] == []
