"""Remembers which content a set of files produced, keyed by their stat fingerprint (path, size,
mtime, inode), so putting an unchanged directory again moves no data. A changed file changes the
fingerprint; a stale entry only costs a normal put."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from tensorcast.config import cache_dir
from tensorcast.model_dir import FileFacts

MAX_ENTRIES = 256


def fingerprint(facts: list[FileFacts]) -> str:
    """The files as scanned (the facts their layout was read from, resolved paths)."""
    return hashlib.sha256(json.dumps(facts).encode()).hexdigest()


def _file() -> Path:
    return cache_dir() / "put-cache.json"


def lookup(key: str) -> str | None:
    try:
        return json.loads(_file().read_text()).get(key)
    except (OSError, ValueError):
        return None


def record(key: str, content_id: str) -> None:
    path = _file()
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        entries = {}
    entries.pop(key, None)
    entries[key] = content_id
    entries = dict(list(entries.items())[-MAX_ENTRIES:])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(entries))
    os.replace(tmp, path)
