"""torch <-> pool bytes. The main importer of torch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from tensorcast.errors import InvalidArgument
from tensorcast.types import TensorMeta, check_tensor_name

TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
    "U16": torch.uint16,
    "I16": torch.int16,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "U32": torch.uint32,
    "I32": torch.int32,
    "F32": torch.float32,
    "U64": torch.uint64,
    "I64": torch.int64,
    "F64": torch.float64,
    "C64": torch.complex64,
}
_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise InvalidArgument(
            f"dtype {dtype} cannot be stored (no safetensors equivalent)"
        ) from None


def check_tensors(tensors: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(tensors, Mapping):
        raise InvalidArgument("tensors must be a mapping of name -> torch.Tensor")
    items = []
    for name, t in tensors.items():
        check_tensor_name(name)
        if not isinstance(t, torch.Tensor):
            raise InvalidArgument(f"{name!r} is a {type(t).__name__}, not a torch.Tensor")
        if t.layout != torch.strided or t.device.type == "meta":
            raise InvalidArgument(f"{name!r}: only dense tensors with data can be stored")
        dtype_name(t.dtype)
        items.append((name, t))
    return items


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a uint8 array (a view when it is a contiguous CPU tensor)."""
    # A lazily conjugated or negated view (.conj()) holds other bytes than its values.
    flat = t.detach().resolve_conj().resolve_neg().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def tensors_over(
    buffer: Any, base_offset: int, metas: tuple[TensorMeta, ...]
) -> dict[str, torch.Tensor]:
    """Tensors sharing `buffer`'s memory: no copy. The tensors keep the buffer alive."""
    out = {}
    for m in metas:
        dtype = TORCH_DTYPES[m.dtype]
        if m.size_bytes == 0:
            out[m.name] = torch.empty(m.shape, dtype=dtype)
            continue
        flat = torch.frombuffer(
            buffer,
            dtype=dtype,
            count=m.size_bytes // dtype.itemsize,
            offset=base_offset + m.offset_bytes,
        )
        out[m.name] = flat.view(m.shape)
    return out
