"""Slicing stored tensors into a new region: the worker side of `Artifact.view()`.

Works on raw bytes (each element viewed as `itemsize` uint8s), so every dtype slices the same way
and no dtype-specific kernel is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tensorcast.errors import InvalidArgument
from tensorcast.types import DTYPE_ITEMSIZE, TensorMeta, pack_layout


@dataclass(frozen=True)
class DimSlice:
    start: int
    stop: int
    step: int


def sliced_shape(meta: TensorMeta, dims: list[DimSlice]) -> tuple[int, ...]:
    if len(dims) > len(meta.shape):
        raise InvalidArgument(
            f"tensor {meta.name!r} has {len(meta.shape)} dimensions, got {len(dims)} slices"
        )
    shape = list(meta.shape)
    for i, d in enumerate(dims):
        if d.step < 1 or not 0 <= d.start <= d.stop <= meta.shape[i]:
            raise InvalidArgument(
                f"tensor {meta.name!r} dim {i} (size {meta.shape[i]}): bad slice "
                f"[{d.start}:{d.stop}:{d.step}]; need 0 <= start <= stop <= size, step >= 1"
            )
        shape[i] = len(range(d.start, d.stop, d.step))
    return tuple(shape)


def plan_view(
    tensors: tuple[TensorMeta, ...], slices: dict[str, list[DimSlice]]
) -> list[TensorMeta]:
    """Layout of the derived content: every tensor, the named ones sliced."""
    names = {t.name for t in tensors}
    unknown = sorted(set(slices) - names)
    if unknown:
        raise InvalidArgument(f"view names tensors that do not exist: {unknown}")
    metas, _ = pack_layout(
        [(t.name, t.dtype, sliced_shape(t, slices.get(t.name, []))) for t in tensors]
    )
    return metas


def _bytes_tensor(region: memoryview, meta: TensorMeta) -> torch.Tensor:
    itemsize = DTYPE_ITEMSIZE[meta.dtype]
    flat = torch.frombuffer(
        region, dtype=torch.uint8, count=meta.size_bytes, offset=meta.offset_bytes
    )
    return flat.view(*meta.shape, itemsize)


def copy_slices(
    source: memoryview,
    source_tensors: tuple[TensorMeta, ...],
    target: memoryview,
    target_tensors: list[TensorMeta],
    slices: dict[str, list[DimSlice]],
) -> None:
    for s, t in zip(source_tensors, target_tensors):
        if t.size_bytes == 0:
            continue
        index = tuple(slice(d.start, d.stop, d.step) for d in slices.get(s.name, []))
        _bytes_tensor(target, t).copy_(_bytes_tensor(source, s)[index])
