"""HFEngine: greedy decoding whose per-request KV caches move between engines as pages and
continue token-identically, and its HTTP front end. A tiny random Llama; real processes, loopback.
"""

from __future__ import annotations

import http.client
import json
import random
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from tensorcast.adaptors import InstanceLoad, KVExport  # noqa: E402
from tensorcast.engine.hf import HFEngine  # noqa: E402
from tensorcast.engine.server import EngineHTTPServer, engine_request  # noqa: E402
from tensorcast.errors import AlreadyExists, InvalidArgument, NotFound  # noqa: E402

CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
HEAD_DIM = 64 // 4

CONTINUE_IN_SUBPROCESS = r"""
import json, sys, torch, transformers
from safetensors.torch import load_file
from tensorcast.adaptors import KVExport
from tensorcast.engine.hf import HFEngine

directory = sys.argv[1]
config = transformers.LlamaConfig(**json.load(open(f"{directory}/config.json")))
torch.manual_seed(123)  # different init: the weights must come from the file
model = transformers.LlamaForCausalLM(config).eval()
model.load_state_dict(load_file(f"{directory}/weights.safetensors"))
engine = HFEngine(model, page_tokens=7)
meta = json.load(open(f"{directory}/meta.json"))
engine.import_kv("r", KVExport(pages=load_file(f"{directory}/pages.safetensors"), meta=meta))
print(json.dumps(engine.generate("r", None, int(sys.argv[2]))))
"""


def tiny_llama(seed: int = 0, state_dict: dict | None = None):
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG))
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model.eval()


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CONFIG["vocab_size"]) for _ in range(length)]


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def twin(model):
    """A separate model object with the same weights, as another engine would load them."""
    return tiny_llama(seed=1, state_dict=model.state_dict())


def test_generate_in_parts_equals_at_once(model):
    engine = HFEngine(model)
    ids = prompt(20, seed=1)
    whole = engine.generate("whole", ids, 24)
    parts = engine.generate("parts", ids, 1)
    for n in (5, 0, 11, 7):
        parts += engine.generate("parts", None, n)
    assert parts == whole
    assert len(set(whole)) > 5  # the tiny model does not just repeat one token
    with torch.no_grad():  # the obvious way: a full forward over the whole sequence per token
        for n, token in enumerate(whole):
            logits = model(input_ids=torch.tensor([ids + whole[:n]])).logits
            assert int(logits[0, -1].argmax()) == token
    assert engine.load() == InstanceLoad(0, 0, 2 * (20 + 24 - 1), ("parts", "whole"))


def test_generate_rejects_bad_requests(model):
    engine = HFEngine(model)
    engine.generate("r", prompt(4, seed=2), 2)
    with pytest.raises(AlreadyExists):
        engine.generate("r", prompt(4, seed=2), 2)
    with pytest.raises(NotFound):
        engine.generate("other", None, 2)
    for ids, n in (([], 1), ([1, 128], 1), ([1, True], 1), ([1], -1), ([1] * 250, 10)):
        with pytest.raises(InvalidArgument):
            engine.generate("bad", ids, n)
    assert engine.load().requests == ("r",)


def test_concurrent_requests_match_sequential(model):
    prompts = {f"r{i}": prompt(8 + i, seed=10 + i) for i in range(4)}
    sequential = HFEngine(model)
    expected = {rid: sequential.generate(rid, ids, 10) for rid, ids in prompts.items()}
    engine, results = HFEngine(model), {}

    def run(rid: str) -> None:
        results[rid] = engine.generate(rid, prompts[rid], 4)
        results[rid] += engine.generate(rid, None, 6)

    threads = [threading.Thread(target=run, args=(rid,)) for rid in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == expected
    assert engine.load() == InstanceLoad(0, 0, sequential.load().cached_tokens, tuple(prompts))


def test_pages_of_a_37_token_context(model):
    engine = HFEngine(model, page_tokens=16)
    ids = prompt(30, seed=3)
    generated = engine.generate("r", ids, 8)  # 38 tokens; the last one is fed at the next step
    export = engine.export_kv("r")
    names = [f"L{layer}.{kind}.{block}" for layer in (0, 1) for kind in "kv" for block in (0, 1, 2)]
    assert list(export.pages) == names
    assert [p["name"] for p in export.meta["pages"]] == names
    for name, page in export.pages.items():
        tokens = 5 if name.endswith(".2") else 16
        assert page.shape == (2, tokens, HEAD_DIM)
        assert page.is_contiguous() and page.device.type == "cpu" and page.dtype == torch.float32
    meta = export.meta
    assert meta["tokens"] == ids + generated and meta["cache_tokens"] == 37
    assert (meta["num_layers"], meta["num_kv_heads"], meta["head_dim"]) == (2, 2, HEAD_DIM)
    assert (meta["page_tokens"], meta["dtype"], meta["engine"]) == (
        16,
        "float32",
        "hf-transformers",
    )
    json.dumps(meta)
    export.pages["L0.k.0"].zero_()  # pages are copies: the engine's cache is untouched
    assert not torch.equal(engine.export_kv("r").pages["L0.k.0"], export.pages["L0.k.0"])


def test_export_import_continues_identically(model, twin):
    source = HFEngine(model, page_tokens=16)
    source.generate("r", prompt(21, seed=4), 9)
    export = source.export_kv("r")
    target = HFEngine(twin, page_tokens=4)  # import follows the export's page size, not ours
    target.import_kv("r", export)
    assert target.load() == InstanceLoad(0, 0, 29, ("r",))
    with pytest.raises(AlreadyExists):
        target.import_kv("r", export)
    assert target.generate("r", None, 12) == source.generate("r", None, 12)
    again = target.export_kv("r")  # and back again, in 4-token pages this time
    assert len(again.pages) == 2 * 2 * 11  # 41 cached tokens in ceil(41 / 4) pages per K/V
    source.evict("r")
    source.import_kv("r", again)
    assert source.generate("r", None, 5) == target.generate("r", None, 5)


def test_import_into_another_process(model, tmp_path):
    engine = HFEngine(model)
    engine.generate("r", prompt(25, seed=5), 6)
    export = engine.export_kv("r")
    safetensors_torch.save_file(model.state_dict(), str(tmp_path / "weights.safetensors"))
    safetensors_torch.save_file(export.pages, str(tmp_path / "pages.safetensors"))
    (tmp_path / "meta.json").write_text(json.dumps(export.meta))
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    proc = subprocess.run(
        [sys.executable, "-c", CONTINUE_IN_SUBPROCESS, str(tmp_path), "15"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == engine.generate("r", None, 15)


def _without_layer_1(export: KVExport) -> KVExport:
    pages = {name: page for name, page in export.pages.items() if name.startswith("L0.")}
    listed = [entry for entry in export.meta["pages"] if entry["name"].startswith("L0.")]
    return KVExport(pages, {**export.meta, "num_layers": 1, "pages": listed})


def test_kv_of_other_weights_is_refused_until_the_weights_match(model):
    """Two fine-tunes of one architecture: equal shapes, other weights. KV made by one is not
    the other's (its continuation would silently differ from a recompute)."""
    source, other = HFEngine(model, page_tokens=7), HFEngine(tiny_llama(seed=5), page_tokens=7)
    source.generate("r", prompt(12, seed=3), 3)
    export = source.export_kv("r")
    with pytest.raises(InvalidArgument, match="weights"):
        other.import_kv("r", export)
    assert other.load().requests == ()
    with torch.no_grad():  # a weight sync writes the same weights in place: now it fits
        for name, p in other.model.named_parameters():
            p.copy_(dict(model.named_parameters())[name])
    other.import_kv("r", export)
    assert other.generate("r", None, 4) == source.generate("r", None, 4)


def _replace_page(export: KVExport, name: str, page) -> KVExport:
    return KVExport({**export.pages, name: page}, export.meta)


BAD_EXPORTS = {
    "missing page": lambda e: KVExport({n: p for n, p in e.pages.items() if n != "L1.v.1"}, e.meta),
    "extra page": lambda e: _replace_page(e, "L1.v.9", e.pages["L1.v.0"]),
    "short page": lambda e: _replace_page(e, "L0.k.0", e.pages["L0.k.0"][:, :5].clone()),
    "wrong heads": lambda e: _replace_page(e, "L1.k.1", e.pages["L1.k.1"].reshape(1, -1, HEAD_DIM)),
    "wrong dtype": lambda e: _replace_page(e, "L0.v.1", e.pages["L0.v.1"].double()),
    "not a tensor": lambda e: _replace_page(e, "L0.v.1", e.pages["L0.v.1"].tolist()),
    "wrong layers": _without_layer_1,
    "wrong dtype in meta": lambda e: KVExport(e.pages, {**e.meta, "dtype": "bfloat16"}),
    "meta page list": lambda e: KVExport(e.pages, {**e.meta, "pages": e.meta["pages"][:-1]}),
    "cache too long": lambda e: KVExport(e.pages, {**e.meta, "tokens": e.meta["tokens"][:-1]}),
    "token out of vocab": lambda e: KVExport(
        e.pages, {**e.meta, "tokens": [999, *e.meta["tokens"]]}
    ),
    "page_tokens": lambda e: KVExport(e.pages, {**e.meta, "page_tokens": 0}),
}


@pytest.mark.parametrize("case", sorted(BAD_EXPORTS))
def test_import_rejects_bad_pages(model, twin, case):
    source = HFEngine(model, page_tokens=8)
    source.generate("r", prompt(14, seed=6), 5)  # 18 cached tokens: pages of 8, 8, 2
    target = HFEngine(twin)
    target.generate("resident", prompt(5, seed=7), 3)
    before = target.load()
    with pytest.raises(InvalidArgument):
        target.import_kv("r", BAD_EXPORTS[case](source.export_kv("r")))
    assert target.load() == before
    with pytest.raises(NotFound):
        target.generate("r", None, 1)
    target.import_kv("r", source.export_kv("r"))  # the good export still goes in afterwards
    assert target.generate("r", None, 3) == source.generate("r", None, 3)


def test_evict_frees_the_cache(model):
    engine = HFEngine(model)
    engine.generate("a", prompt(10, seed=8), 4)
    engine.generate("b", prompt(6, seed=9), 2)
    assert engine.load().cached_tokens == 13 + 7
    assert engine.evict("a") is True
    assert engine.load() == InstanceLoad(0, 0, 7, ("b",))
    assert engine.evict("a") is False
    with pytest.raises(NotFound):
        engine.generate("a", None, 1)
    with pytest.raises(NotFound):
        engine.export_kv("a")
    engine.generate("a", prompt(3, seed=8), 1)  # the id is free again


def test_buffers_share_the_model_storage(model):
    buffers = HFEngine(model).buffers()
    parameters = dict(model.named_parameters())
    assert buffers.keys() == parameters.keys()
    for name, tensor in buffers.items():
        assert tensor.data_ptr() == parameters[name].data_ptr() and not tensor.requires_grad


def test_adaptors_and_server_import_without_torch():
    code = (
        "import sys, tensorcast.adaptors, tensorcast.engine.server\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.fixture
def server(model):
    with EngineHTTPServer(HFEngine(model), "127.0.0.1", 0) as server:
        yield server


def _post_raw(addr: str, path: str, data: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{addr}{path}", data=data, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_http_round_trip(model, server):
    addr, ids = server.addr, prompt(12, seed=11)
    assert addr.startswith("127.0.0.1:") and not addr.endswith(":0")
    reference = HFEngine(model).generate("x", ids, 10)
    body = {"req_id": "h", "prompt_ids": ids, "max_new_tokens": 4}
    first = engine_request(addr, "POST", "/generate", body, timeout_s=30)["tokens"]
    body = {"req_id": "h", "prompt_ids": None, "max_new_tokens": 6}
    rest = engine_request(addr, "POST", "/generate", body, timeout_s=30)["tokens"]
    assert first + rest == reference
    load = engine_request(addr, "GET", "/load", None, timeout_s=10)
    assert load == {"waiting": 0, "running": 0, "cached_tokens": 21, "requests": ["h"]}
    assert engine_request(addr, "POST", "/evict", {"req_id": "h"}, 10) == {"evicted": True}
    assert engine_request(addr, "POST", "/evict", {"req_id": "h"}, 10) == {"evicted": False}
    with pytest.raises(NotFound, match="not resident"):
        engine_request(addr, "POST", "/generate", body, timeout_s=10)
    engine_request(addr, "POST", "/generate", {**body, "prompt_ids": [1, 2]}, timeout_s=10)
    with pytest.raises(AlreadyExists):
        engine_request(addr, "POST", "/generate", {**body, "prompt_ids": [1, 2]}, timeout_s=10)
    with pytest.raises(InvalidArgument, match="max_new_tokens"):
        engine_request(addr, "POST", "/generate", {**body, "max_new_tokens": "6"}, timeout_s=10)
    with pytest.raises(NotFound, match="no route"):
        engine_request(addr, "GET", "/nope", None, timeout_s=10)


def test_http_rejects_bad_bodies(server):
    status, reply = _post_raw(server.addr, "/generate", b"{not json")
    assert status == 400 and reply["error"] == "InvalidArgument"
    assert "not valid JSON" in reply["message"]
    status, reply = _post_raw(server.addr, "/evict", b"[1, 2]")
    assert (status, reply["error"]) == (400, "InvalidArgument")
    host, port = server.addr.rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    connection.putrequest("POST", "/generate")
    connection.putheader("Content-Length", str(2 << 20))  # announced, never sent
    connection.endheaders()
    response = connection.getresponse()
    assert response.status == 413
    assert json.loads(response.read())["error"] == "ResourceExhausted"
    connection.close()
