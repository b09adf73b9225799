"""Hugging Face transformers: build a model from an artifact's stored config and take its weights
from TensorCast, zero-copy when a worker on this host holds them.

The model is built without initialising weights (its parameter storage is allocated but never
touched), then `load_state_dict(assign=True)` makes the parameters *be* the tensors mapped from the
worker's shared memory: no second full-size copy. Tied weights are re-tied afterwards. With
`device="cuda"` the parameters are the tensors `tensor_dict(device="cuda")` returns: the GPU
tier's device memory shared by CUDA IPC when a worker on this host has one (no copy at all), else
a copy made from the pool by chunked host-to-device DMA.
"""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from tensorcast.errors import InvalidArgument
from tensorcast.weights import shard_plan

if TYPE_CHECKING:
    import torch

    from tensorcast.sdk.runtime import Runtime

VIEW_TTL_S = 600.0  # a TP-rank view lives this long if its load dies before deleting it


def load_model(
    rt: Runtime,
    art_id: str,
    *,
    model_class: Any = None,
    tp_size: int = 1,
    device: str = "cpu",
    shared: bool = True,
) -> Any:
    """A transformers model (eval mode) for the model directory stored as `art_id`.

    `model_class` defaults to `AutoModelForCausalLM`. With `tp_size` > 1 the weights are fetched
    as `tp_size` TP-rank views (only each shard's bytes move per rank) and reassembled, which is
    how a tensor-parallel engine's ranks would each take theirs. `device` ("cuda", "cuda:N")
    puts the model there; `shared` as in `Artifact.tensor_dict` (shared GPU-tier weights must
    not be trained in place).
    """
    import transformers
    from transformers.initialization import no_init_weights

    art = rt.artifact(art_id)
    files = art.files()
    if "config.json" not in files:
        raise InvalidArgument(
            f"{art_id!r} holds no config.json: put the model directory with tc put"
        )
    config_dict = json.loads(files["config.json"])
    config = transformers.AutoConfig.for_model(**config_dict)
    cls = model_class or transformers.AutoModelForCausalLM
    # The weights are fetched (on a cold worker: read from disk) while the skeleton is built.
    with ThreadPoolExecutor(1, thread_name_prefix="tc-load") as fetcher:
        fetching = fetcher.submit(
            (lambda: art.tensor_dict(device, shared=shared))
            if tp_size == 1
            else lambda: _reassembled(art, tp_size, device)
        )
        with no_init_weights():
            model = cls.from_config(config, torch_dtype=getattr(config, "torch_dtype", None))
        state = fetching.result()
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    tied = {k for k in missing if _is_tied(model, k)}
    if set(missing) - tied or unexpected:
        raise InvalidArgument(
            f"{art_id!r} does not fit {type(model).__name__}: "
            f"missing {sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    if device != "cpu":  # buffers built at init (rotary tables, ...); parameters stay put
        model.to(device)
    return model.eval()


def _is_tied(model: Any, name: str) -> bool:
    return bool(getattr(model.config, "tie_word_embeddings", False)) and name.endswith(
        "lm_head.weight"
    )


def _reassembled(art: Any, tp_size: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    import torch

    shapes = [(t.name, t.shape) for t in art.info.tensors]
    parts = []
    # Each load's views are its own (another load may be deleting its views right now) and
    # leased (a load that dies leaves nothing for ever); deleted once read: the tensors read
    # keep their bytes while they live.
    load_id = uuid.uuid4().hex[:12]
    for rank in range(tp_size):
        plan = shard_plan(shapes, rank, tp_size)
        name = f"{art.art_id}/tp{rank}-of-{tp_size}/{load_id}"
        view = art.view(plan, name, ttl_s=VIEW_TTL_S)
        try:
            parts.append((plan, view.tensor_dict(device)))
        finally:
            art.runtime.delete(name)
    state = {}
    for name in parts[0][1]:
        index = parts[0][0].get(name)
        if index is None:
            state[name] = parts[0][1][name]
        else:
            state[name] = torch.cat([p[1][name] for p in parts], dim=len(index) - 1)
    return state
