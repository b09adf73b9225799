"""How vLLM KV blocks are named as TensorCast KV pages: pure functions, no vLLM, no torch.

A block's pages are keyed by what fixes their bytes, so that two engines running the same model
with the same KV layout name the same block the same way (and share it), while anything that
changes the bytes changes the key:

    vllm/{model_key}/{layout_key}/{chain}/{rank}.{layer}.{part}

- `model_key`: the weights' identity (a TensorCast content id when the weights came from an
  artifact, else a fingerprint of the model directory; see `model_key_of_dir`).
- `layout_key`: a digest of the KV layout (block size, heads, head size, dtype, backend, layers,
  tensor-parallel size).
- `chain`: the hash chain of the token prefix up to and including this block: block i's chain
  hashes block i-1's chain with block i's token ids, so a key names the whole prefix, not only
  the block's own tokens (the same tokens after a different prefix have different KV).
- `rank.layer.part`: the tensor-parallel rank, the attention layer's index, and which
  contiguous part of the layer's block (one part when a block's K and V lie together).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT_CHAIN = "0" * 32
KEY_PREFIX = "vllm"
MARKER_FILE = ".tensorcast.json"  # written by `prepare_model_dir` beside config.json
PAGE_TTL_S = 3600.0  # a block page's lease, unless the connector's `ttl_s` says otherwise


def chain_hashes(
    tokens: Sequence[int], block_size: int, start: int = 0, parent: str = ROOT_CHAIN
) -> list[str]:
    """Chain hashes of the full blocks `start, start+1, ...` of `tokens`.

    `parent` is the chain of block `start - 1` (ROOT_CHAIN for block 0). A trailing partial
    block has no chain: its KV is not final until the block is full.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, not {block_size}")
    out = []
    chain = parent
    for block in range(start, len(tokens) // block_size):
        ids = tokens[block * block_size : (block + 1) * block_size]
        digest = hashlib.blake2b(bytes.fromhex(chain), digest_size=16)
        digest.update(struct.pack(f"<{len(ids)}q", *ids))
        chain = digest.hexdigest()
        out.append(chain)
    return out


def request_root(
    lora: tuple[str, str] | None = None,
    cache_salt: str | None = None,
    mm: Sequence[str] = (),
) -> str:
    """The chain's start for one request: ROOT_CHAIN for plain token prompts, else a digest of
    what besides the tokens changes the KV (vLLM's block hash counts the same): the LoRA
    adapter (name, path), the cache salt (tenants that must not share), and the multimodal
    inputs' identifiers (their placeholder tokens are the same whatever the image)."""
    if lora is None and not cache_salt and not mm:
        return ROOT_CHAIN
    extra = {"lora": list(lora) if lora else None, "salt": cache_salt or None, "mm": list(mm)}
    return hashlib.blake2b(
        json.dumps(extra, sort_keys=True).encode(), digest_size=16, person=b"tc-kv-root"
    ).hexdigest()


def save_range(
    saved: int, computed: int, scheduled: int, num_tokens: int, block_size: int
) -> tuple[int, int]:
    """Blocks [first, end) to save after a step that computes tokens [computed, computed +
    scheduled) of a request whose known token ids number `num_tokens`, when blocks before
    `saved` were handed to saving already.

    A block is saved once its KV is computed and its token ids are known (its key hashes
    them). They may be known a step late (async scheduling: the token a step feeds is
    sampled by the step before and not yet in the request's ids; speculative decoding: the
    accepted tokens): such a block is picked up by the next step, from `saved`. A request
    whose computed tokens went back (preempted, or recomputed after a failed load) saves from
    there again."""
    first = min(saved, computed // block_size)
    end = min(computed + scheduled, num_tokens) // block_size
    return first, max(first, end)


def digest_of(value: Any, size: int = 8) -> str:
    """A short stable digest of a JSON-serialisable value (dict keys sorted)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode(), digest_size=size).hexdigest()


def block_prefix(model_key: str, layout_key: str, chain: str) -> str:
    return f"{KEY_PREFIX}/{model_key}/{layout_key}/{chain}"


def page_key(prefix: str, rank: int, layer: int, part: int) -> str:
    return f"{prefix}/{rank}.{layer}.{part}"


def block_page_keys(prefix: str, rank: int, layers: int, parts: int) -> list[str]:
    """Every page of one block on one rank, layer-major."""
    return [page_key(prefix, rank, layer, part) for layer in range(layers) for part in range(parts)]


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def model_key_of_dir(path: str | Path, extra: Any = None) -> str:
    """The model's identity for a model directory not loaded from TensorCast: the content id
    its `.tensorcast.json` marker names, else a digest of config.json and every weight file's
    name and contents, plus `extra` (e.g. the revision, the dtype, quantization). Two
    fine-tunes of one architecture have the same config and headers: only the contents tell
    them apart (hashed with the native tree hash on every core: ~0.1 s per GiB in the page
    cache, which the engine's own load then reuses)."""
    path = Path(path)
    marker = path / MARKER_FILE
    if marker.is_file():
        content_id = json.loads(marker.read_text()).get("content_id")
        if content_id:
            return str(content_id)[:32]
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps(extra, sort_keys=True, default=str).encode())
    if not path.is_dir():  # e.g. a hub id: its name and the extra facts only
        digest.update(str(path).encode())
        return digest.hexdigest()
    config = path / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    for file in sorted(p for p in path.iterdir() if p.name.endswith(WEIGHT_SUFFIXES)):
        digest.update(f"{file.name}:{file.stat().st_size}:{_file_hash(file)}".encode())
    return digest.hexdigest()


def _file_hash(file: Path) -> str:
    import mmap

    from tensorcast.transport import native

    with file.open("rb") as f:
        if file.stat().st_size == 0:
            return native.hash_buffer(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return native.hash_buffer(mapped)
