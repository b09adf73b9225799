"""Model weights: tensor-parallel shard plans for Llama-style layouts (pure, no I/O).

`shard_plan` says which slice of each tensor a TP rank needs; pass it to `Artifact.view()` so the
worker holding the weights slices them and only the shard's bytes move.
"""

from __future__ import annotations

from collections.abc import Iterable

from tensorcast.errors import InvalidArgument

# Suffixes of Llama-style parameter names (Hugging Face naming).
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split outputs: dim 0
ROW_PARALLEL = ("o_proj", "down_proj")  # split inputs: dim 1 of the weight
EMBEDDINGS = ("embed_tokens", "lm_head")  # [vocab, hidden]


def split_range(size: int, rank: int, parts: int) -> tuple[int, int]:
    """[start, stop) of `rank`'s part when `size` splits into `parts`: the first `size % parts`
    parts get one extra element (torch.tensor_split's rule), so uneven sizes are defined."""
    base, extra = divmod(size, parts)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def shard_plan(
    names_and_shapes: Iterable[tuple[str, tuple[int, ...]]],
    tp_rank: int,
    tp_size: int,
    *,
    shard_embeddings: bool = False,
) -> dict[str, tuple[slice, ...]]:
    """Slices for `Artifact.view()` giving rank `tp_rank` of `tp_size` its shard.

    Column-parallel weights (q/k/v/gate/up) and their biases split along dim 0; row-parallel
    weights (o/down) along dim 1, their biases replicated; norms replicated; embeddings and
    lm_head replicated unless `shard_embeddings` (then vocab-parallel, dim 0). Tensors left out of
    the plan are replicated whole.
    """
    if not 0 <= tp_rank < tp_size:
        raise InvalidArgument(f"tp_rank {tp_rank} out of range for tp_size {tp_size}")
    plan: dict[str, tuple[slice, ...]] = {}
    for name, shape in names_and_shapes:
        parts = name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        kind = parts[-1]
        if module in COLUMN_PARALLEL or (module in EMBEDDINGS and shard_embeddings):
            dim = 0
        elif module in ROW_PARALLEL and kind == "weight":
            dim = 1
        else:
            continue
        if len(shape) <= dim:
            raise InvalidArgument(f"{name}: shape {shape} has no dim {dim} to shard")
        if shape[dim] < tp_size:
            raise InvalidArgument(
                f"{name}: dim {dim} has {shape[dim]} elements, fewer than tp_size {tp_size}"
            )
        start, stop = split_range(shape[dim], tp_rank, tp_size)
        plan[name] = (slice(None),) * dim + (slice(start, stop),)
    return plan
