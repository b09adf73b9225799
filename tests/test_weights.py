"""Model weights: TP shard plans (pure), views per rank reassembled, transform_into in place."""

from __future__ import annotations

import gc
import itertools
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorcast as tc
from tensorcast.weights import shard_plan, split_range


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 1000), st.integers(1, 16))
def test_split_range_tiles_exactly_like_tensor_split(size, parts):
    ranges = [split_range(size, r, parts) for r in range(parts)]
    assert ranges[0][0] == 0 and ranges[-1][1] == size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    expected = [len(c) for c in torch.tensor_split(torch.arange(size), parts)]
    assert [b - a for a, b in ranges] == expected


def _llama_state(hidden=16, inter=24, vocab=40, layers=2, kv=8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    state = {
        "model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g),
        "model.norm.weight": torch.randn(hidden, generator=g),
        "lm_head.weight": torch.randn(vocab, hidden, generator=g),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj.weight": (hidden, hidden),
            "self_attn.k_proj.weight": (kv, hidden),
            "self_attn.v_proj.weight": (kv, hidden),
            "self_attn.o_proj.weight": (hidden, hidden),
            "self_attn.q_proj.bias": (hidden,),
            "mlp.gate_proj.weight": (inter, hidden),
            "mlp.up_proj.weight": (inter, hidden),
            "mlp.down_proj.weight": (hidden, inter),
            "input_layernorm.weight": (hidden,),
        }
        for name, shape in shapes.items():
            state[p + name] = torch.randn(shape, generator=g)
    return state


def test_shard_plan_layout_rules():
    state = _llama_state()
    shapes = [(n, tuple(t.shape)) for n, t in state.items()]
    plan = shard_plan(shapes, 1, 2)
    assert plan["model.layers.0.self_attn.q_proj.weight"] == (slice(8, 16),)
    assert plan["model.layers.0.self_attn.q_proj.bias"] == (slice(8, 16),)
    assert plan["model.layers.0.self_attn.o_proj.weight"] == (slice(None), slice(8, 16))
    assert plan["model.layers.0.mlp.down_proj.weight"] == (slice(None), slice(12, 24))
    assert "model.norm.weight" not in plan and "model.embed_tokens.weight" not in plan
    sharded = shard_plan(shapes, 0, 3, shard_embeddings=True)
    assert sharded["model.embed_tokens.weight"] == (slice(0, 14),)  # 40 = 14 + 13 + 13
    with pytest.raises(tc.InvalidArgument):
        shard_plan(shapes, 2, 2)
    with pytest.raises(tc.InvalidArgument, match="fewer than tp_size"):
        shard_plan([("a.q_proj.weight", (3, 4))], 0, 4)


@pytest.mark.parametrize("tp_size", [2, 3])
def test_tp_views_reassemble_to_the_original(rt, tp_size):
    state = _llama_state()
    art = rt.put(state, f"llama-tp{tp_size}@v1")
    shapes = [(n, tuple(t.shape)) for n, t in state.items()]
    ranks = []
    for rank in range(tp_size):
        plan = shard_plan(shapes, rank, tp_size)
        view = art.view(plan, f"llama-tp{tp_size}@v1/rank{rank}")
        assert view.size_bytes < art.size_bytes
        ranks.append((plan, view.tensor_dict()))
    for name, full in state.items():
        plan0 = ranks[0][0].get(name)
        if plan0 is None:  # replicated
            assert all(torch.equal(r[1][name], full) for r in ranks), name
            continue
        dim = len(plan0) - 1
        assert torch.equal(torch.cat([r[1][name] for r in ranks], dim=dim), full), name


def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError


def test_transform_into_fills_parameters_in_place(rt):
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 16))
    source = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    art = rt.put(source, "transform@v1")
    params = dict(model.named_parameters())
    pointers = {k: v.data_ptr() for k, v in params.items()}
    gc.collect()
    before = _rss_anon()
    filled = art.transform_into(params)
    grown = _rss_anon() - before
    assert sorted(filled) == sorted(params)
    for name, p in params.items():
        assert p.data_ptr() == pointers[name] and torch.equal(p.detach(), source[name])
    assert grown < art.size_bytes // 4, f"RssAnon grew {grown} for a {art.size_bytes} artifact"
    renamed = {"w": torch.empty(16, 2048)}
    assert art.transform_into(renamed, {"w": "1.weight"}) == ["w"]
    assert torch.equal(renamed["w"], source["1.weight"])
    with pytest.raises(tc.InvalidArgument, match="shape"):
        art.transform_into({"0.bias": torch.empty(3)})
    with pytest.raises(tc.InvalidArgument, match="lacks"):
        art.transform_into({"nope": torch.empty(3)})


def _model_dir(root: Path, state: dict[str, torch.Tensor]) -> Path:
    import json

    from safetensors.torch import save_file

    root.mkdir()
    names = sorted(state)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, root / file)
        weight_map.update({k: file for k in keys})
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (root / "config.json").write_text('{"model_type": "llama", "hidden_size": 16}')
    (root / "tokenizer.json").write_text('{"version": "1.0"}')
    (root / "pytorch_model.bin").write_bytes(b"not copied")
    return root


def test_put_model_directory_with_index_and_files(rt, tmp_path, monkeypatch):
    from tensorcast.sdk import writes

    state = _llama_state()
    directory = _model_dir(tmp_path / "llama", state)
    art = rt.put_files("llama-dir@v1", directory)
    got = art.tensor_dict()
    assert set(got) == set(state)
    assert all(torch.equal(got[k], state[k]) for k in state)
    files = art.files()
    assert files["config.json"] == (directory / "config.json").read_bytes()
    assert set(files) == {"config.json", "tokenizer.json", "model.safetensors.index.json"}
    # The same directory again moves no data: the read path is not even planned.
    monkeypatch.setattr(writes, "plan_files", lambda *_: pytest.fail("re-read an unchanged dir"))
    again = rt.put_files("llama-dir@v1-again", directory)
    assert again.content_id == art.content_id


@pytest.mark.parametrize("damage", ["missing_file", "tensor_twice", "file_only_tensor"])
def test_bad_index_is_rejected_and_nothing_stored(rt, tmp_path, damage):
    import json

    directory = _model_dir(tmp_path / "bad", _llama_state())
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    if damage == "missing_file":
        index["weight_map"][first] = "model-00003-of-00002.safetensors"
        index_path.write_text(json.dumps(index))
    elif damage == "tensor_twice":
        body = json.dumps(index)
        twice = f'"{first}": "model-00001-of-00002.safetensors", '
        index_path.write_text(body.replace('"weight_map": {', '"weight_map": {' + twice, 1))
    else:
        del index["weight_map"][first]
        index_path.write_text(json.dumps(index))
    before = [a.art_id for a in rt.list_artifacts()]
    with pytest.raises(tc.InvalidArgument, match=r"index|model\.safetensors"):
        rt.put_files(f"bad-{damage}", directory)
    assert [a.art_id for a in rt.list_artifacts()] == before


def test_files_rewritten_while_they_are_put_store_nothing(rt, tmp_path):
    """A shard replaced (e.g. `save_pretrained` into the same directory) after the directory was
    scanned and while it is read: its bytes no longer match the scanned layout, so the put
    fails with IntegrityError and stores nothing."""
    from safetensors.torch import save_file

    state = _llama_state()
    directory = _model_dir(tmp_path / "moving", state)
    second = directory / "model-00002-of-00002.safetensors"
    keys = sorted(state)[len(state) // 2 :]
    replaced = []

    def progress(done: int) -> None:
        if not replaced:  # after the first extent: another writer replaces the second shard
            staged = tmp_path / "staged.safetensors"
            save_file(
                {k: state[k] + 1 for k in keys}, staged, metadata={"format": "pt", "pad": "x" * 99}
            )
            os.replace(staged, second)
            replaced.append(True)

    before = [a.art_id for a in rt.list_artifacts()]
    with pytest.raises(tc.IntegrityError, match="changed while it was being put"):
        rt.put_files("moving@v1", directory, progress=progress)
    assert replaced and [a.art_id for a in rt.list_artifacts()] == before
