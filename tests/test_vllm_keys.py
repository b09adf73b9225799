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
    # Two fine-tunes of one architecture: same config, same headers, other weights.
    tuned = tmp_path / "tuned"
    tuned.mkdir()
    (tuned / "config.json").write_text(json.dumps({"hidden_size": 128}))
    (model / "config.json").write_text(json.dumps({"hidden_size": 128}))
    (model / keys.MARKER_FILE).unlink()
    (tuned / "model.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header + bytes([1]) + bytes(7)
    )
    assert keys.model_key_of_dir(tuned, {"dtype": "bf16"}) != keys.model_key_of_dir(
        model, {"dtype": "bf16"}
    )
    # Weights in other formats count too.
    (tuned / "extra.bin").write_bytes(b"\0" * 16)
    before = keys.model_key_of_dir(tuned)
    (tuned / "extra.bin").write_bytes(b"\1" + b"\0" * 15)
    assert keys.model_key_of_dir(tuned) != before


def test_what_changes_the_kv_besides_the_tokens_starts_another_chain():
    """LoRA adapters, cache salts and multimodal inputs change a block's KV without changing its
    token ids: each starts the request's chain elsewhere, so nothing of another's is loaded.
    Plain prompts keep the root every engine (and the instance's exports) computes."""
    assert keys.request_root() == keys.ROOT_CHAIN
    roots = [
        keys.request_root(),
        keys.request_root(lora=("sql", "/adapters/sql")),
        keys.request_root(lora=("sql", "/adapters/sql-v2")),
        keys.request_root(cache_salt="tenant-a"),
        keys.request_root(cache_salt="tenant-b"),
        keys.request_root(mm=["img-1"]),
        keys.request_root(mm=["img-2"]),
    ]
    assert len(set(roots)) == len(roots)
    assert keys.request_root(cache_salt="tenant-a") == roots[3]  # stable
    tokens = list(range(64))
    chains = {tuple(keys.chain_hashes(tokens, 16, parent=r)) for r in roots}
    assert len(chains) == len(roots)


def test_save_range_catches_up_with_tokens_known_a_step_late():
    """Blocks of 4 tokens. Async scheduling: the step that fills block 2 (computing token 11)
    does not know token 11's id yet; the next step saves block 2."""
    assert keys.save_range(0, 0, 10, 10, 4) == (0, 2)  # prefill of 10 tokens: blocks 0-1
    assert keys.save_range(2, 10, 1, 11, 4) == (2, 2)  # token 10: block 2 not full
    assert keys.save_range(2, 11, 1, 11, 4) == (2, 2)  # token 11 fed, its id not known yet
    assert keys.save_range(2, 12, 1, 12, 4) == (2, 3)  # now it is: block 2 saved late
    assert keys.save_range(3, 13, 1, 14, 4) == (3, 3)
    # Synchronous scheduling gives the same blocks, one step earlier.
    assert keys.save_range(2, 11, 1, 12, 4) == (2, 3)
    # Computed tokens went back (recompute after a failed load): saved again from there.
    assert keys.save_range(5, 8, 12, 20, 4) == (2, 5)
