"""How vLLM KV blocks are named as pages (tensorcast/integrations/vllm/keys.py): pure code, no
vLLM. The incremental chain equals the obvious one, a key names its whole prefix, and model
identity follows the model directory."""

from __future__ import annotations

import hashlib
import json
import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from tensorcast.integrations.vllm import keys

tokens_st = st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=200)


def obvious_chains(tokens: list[int], block_size: int) -> list[str]:
    """Block i's key: a digest of every token up to the end of block i, recomputed each time."""
    out = []
    for end in range(block_size, len(tokens) + 1, block_size):
        chain = keys.ROOT_CHAIN
        for start in range(0, end, block_size):
            digest = hashlib.blake2b(bytes.fromhex(chain), digest_size=16)
            digest.update(struct.pack(f"<{block_size}q", *tokens[start : start + block_size]))
            chain = digest.hexdigest()
        out.append(chain)
    return out


@settings(max_examples=200, deadline=None)
@given(tokens_st, st.integers(1, 16), st.integers(0, 20))
def test_incremental_chain_equals_the_obvious_one(tokens, block_size, split):
    full = keys.chain_hashes(tokens, block_size)
    assert full == obvious_chains(tokens, block_size)
    assert len(full) == len(tokens) // block_size
    split = min(split, len(full))
    parent = full[split - 1] if split else keys.ROOT_CHAIN
    assert full[:split] + keys.chain_hashes(tokens, block_size, split, parent) == full


@settings(max_examples=200, deadline=None)
@given(tokens_st.filter(lambda t: len(t) >= 8), st.integers(1, 8), st.data())
def test_a_key_names_its_whole_prefix(tokens, block_size, data):
    full = keys.chain_hashes(tokens, block_size)
    position = data.draw(st.integers(0, len(tokens) - 1))
    changed = list(tokens)
    changed[position] = tokens[position] + 1
    other = keys.chain_hashes(changed, block_size)
    block = position // block_size
    assert other[:block] == full[:block]  # blocks before the change keep their keys
    assert all(a != b for a, b in zip(other[block:], full[block:]))  # every later one changes


def test_page_keys_fit_and_separate_models_layouts_ranks_layers():
    chain = keys.chain_hashes(list(range(32)), 32)[0]
    a = keys.block_prefix("m1", keys.digest_of({"block": 32}), chain)
    names = {
        keys.page_key(a, 0, 0, 0),
        keys.page_key(a, 1, 0, 0),
        keys.page_key(a, 0, 1, 0),
        keys.page_key(keys.block_prefix("m2", keys.digest_of({"block": 32}), chain), 0, 0, 0),
        keys.page_key(keys.block_prefix("m1", keys.digest_of({"block": 64}), chain), 0, 0, 0),
    }
    assert len(names) == 5
    assert keys.block_page_keys(a, 0, 2, 1) == [
        keys.page_key(a, 0, 0, 0),
        keys.page_key(a, 0, 1, 0),
    ]
    long = keys.page_key(keys.block_prefix("c" * 32, "d" * 16, chain), 7, 127, 1)
    assert len(long.encode()) < 512  # the page index's key limit


def test_model_key_follows_the_directory(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 128}))
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    first = keys.model_key_of_dir(model, {"dtype": "bf16"})
    assert keys.model_key_of_dir(model, {"dtype": "bf16"}) == first
    assert keys.model_key_of_dir(model, {"dtype": "fp32"}) != first
    (model / "config.json").write_text(json.dumps({"hidden_size": 256}))
    assert keys.model_key_of_dir(model, {"dtype": "bf16"}) != first
    (model / keys.MARKER_FILE).write_text(json.dumps({"content_id": "c1-abc", "artifact": "x"}))
    assert keys.model_key_of_dir(model, {"dtype": "bf16"}) == "c1-abc"  # the weights' identity
