"""Content identity: a digest over tensor names, dtypes, shapes and per-tensor content hashes.

Offsets are not part of the identity: the same tensors laid out differently are the same content.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

from tensorcast.types import TensorMeta

CONTENT_ID_PREFIX = "c1-"


def content_id(tensors: Iterable[TensorMeta]) -> str:
    canonical = sorted((t.name, t.dtype, list(t.shape), t.hash_hex) for t in tensors)
    digest = hashlib.sha256(json.dumps(canonical, separators=(",", ":")).encode()).hexdigest()
    return CONTENT_ID_PREFIX + digest[:40]


REFERENCE_ID_PREFIX = "r1-"


def reference_id(tensors: Iterable[TensorMeta], files: Iterable[tuple[str, int, int, int]]) -> str:
    """Identity of content registered by reference, before any byte is read: the layout plus the
    files' (path, size, mtime_ns, inode). The same unchanged files give the same id again."""
    canonical = [
        sorted((t.name, t.dtype, list(t.shape), t.offset_bytes) for t in tensors),
        sorted(list(f) for f in files),
    ]
    digest = hashlib.sha256(json.dumps(canonical, separators=(",", ":")).encode()).hexdigest()
    return REFERENCE_ID_PREFIX + digest[:40]
