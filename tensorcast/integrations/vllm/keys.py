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


def model_key_of_dir(path: str | Path, extra: Any = None) -> str:
    """The model's identity for a model directory not loaded from TensorCast: the content id
    its `.tensorcast.json` marker names, else a digest of config.json and every safetensors
    file's name, size and header (the tensor names, dtypes, shapes and offsets), plus `extra`
    (e.g. the revision). Reading headers only keeps this cheap; weights rewritten in place with
    identical headers would not change it (set `model_key` in the connector's extra config)."""
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
    for file in sorted(path.glob("*.safetensors")):
        with file.open("rb") as f:
            head = f.read(8)
            (length,) = struct.unpack("<Q", head) if len(head) == 8 else (0,)
            header = f.read(min(length, 100 * 1024 * 1024))
        digest.update(f"{file.name}:{file.stat().st_size}:".encode())
        digest.update(header)
    return digest.hexdigest()
