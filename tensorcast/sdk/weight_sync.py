"""Versioned weight publication for RL post-training: a trainer publishes state dicts, rollout
workers bring live models to a version moving only the tensors whose content changed.

Layout: every tensor of a version is its own artifact `weights/MODEL@VERSION/NAME` (content that
did not change is stored once, so publishing an unchanged tensor moves no bytes); the version's
manifest `weights/MODEL@VERSION` lists them with their hashes and is written LAST, so a subscriber
that finds a manifest finds a complete version. Versions are immutable; `keep_last` bounds how many
are kept.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tensorcast.errors import InvalidArgument, NotFound
from tensorcast.model_dir import FILE_PREFIX

if TYPE_CHECKING:
    import torch

    from tensorcast.sdk.runtime import Runtime

PREFIX = "weights/"
MANIFEST_FILE = "manifest.json"


def manifest_id(model: str, version: str) -> str:
    return f"{PREFIX}{model}@{version}"


def _check_name(kind: str, value: str) -> None:
    if not value or "@" in value or "/" in value or value != value.strip():
        raise InvalidArgument(f"bad {kind} {value!r}: no '@', '/' or surrounding spaces")


@dataclass(frozen=True)
class VersionInfo:
    model: str
    version: str
    published_at: float
    tensors: dict[str, dict] = field(repr=False)

    @property
    def size_bytes(self) -> int:
        return sum(t["size_bytes"] for t in self.tensors.values())


def _manifests(rt: Runtime, model: str) -> list[str]:
    """Version names of `model`, oldest first (by when the store recorded each manifest)."""
    _check_name("model", model)
    manifests = [
        a
        for a in rt.list_artifacts(f"{PREFIX}{model}@")
        if "/" not in a.art_id[len(PREFIX) :]  # not a tensor of a version
    ]
    return [a.art_id.rpartition("@")[2] for a in sorted(manifests, key=lambda a: a.created_at)]


def list_versions(rt: Runtime, model: str) -> list[VersionInfo]:
    """Published versions of `model`, oldest first."""
    return [read_version(rt, model, v) for v in _manifests(rt, model)]


def latest_version(rt: Runtime, model: str) -> VersionInfo:
    """The newest published version (reads only its manifest)."""
    names = _manifests(rt, model)
    if not names:
        raise NotFound(f"no published version of {model!r}")
    return read_version(rt, model, names[-1])


def read_version(rt: Runtime, model: str, version: str) -> VersionInfo:
    files = rt.artifact(manifest_id(model, version)).files()
    manifest = json.loads(files[MANIFEST_FILE])
    return VersionInfo(model, version, manifest["published_at"], manifest["tensors"])


class WeightPublisher:
    def __init__(self, rt: Runtime, model: str, *, keep_last: int = 3) -> None:
        _check_name("model", model)
        if keep_last < 1:
            raise InvalidArgument("keep_last must be >= 1")
        self.rt = rt
        self.model = model
        self.keep_last = keep_last

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: str) -> VersionInfo:
        """Publish `state_dict` as `version` (immutable: AlreadyExists if it holds other weights),
        then delete versions older than the newest `keep_last`."""
        import torch

        _check_name("version", version)
        tensors = {}
        for name, tensor in state_dict.items():
            art_id = f"{manifest_id(self.model, version)}/{name}"
            art = self.rt.put({name: tensor}, art_id)
            meta = art.info.tensors[0]
            tensors[name] = {
                "art_id": art_id,
                "hash": meta.hash_hex,
                "dtype": meta.dtype,
                "shape": list(meta.shape),
                "size_bytes": meta.size_bytes,
            }
        published_at = time.time()
        manifest = {
            "model": self.model,
            "version": version,
            "published_at": published_at,
            "tensors": tensors,
        }
        raw = json.dumps(manifest, sort_keys=True).encode()
        blob = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        self.rt.put({FILE_PREFIX + MANIFEST_FILE: blob}, manifest_id(self.model, version))
        self.collect()
        return VersionInfo(self.model, version, published_at, tensors)

    def collect(self) -> list[str]:
        """Delete all but the newest `keep_last` versions; returns the deleted versions."""
        versions = list_versions(self.rt, self.model)
        doomed = versions[: max(0, len(versions) - self.keep_last)]
        for v in doomed:
            self.rt.delete(manifest_id(self.model, v.version))  # first: never half-visible
            for entry in v.tensors.values():
                try:
                    self.rt.delete(entry["art_id"])
                except NotFound:
                    pass
        return [v.version for v in doomed]


@dataclass(frozen=True)
class SyncResult:
    version: str
    moved_tensors: int
    moved_bytes: int
    unchanged_tensors: int


class WeightSubscriber:
    """Brings `target` (a model's parameters or any state dict of tensors) to a version."""

    def __init__(self, rt: Runtime, model: str, target: Mapping[str, torch.Tensor]) -> None:
        _check_name("model", model)
        self.rt = rt
        self.model = model
        self.target = target
        self.version: str | None = None
        self._hashes: dict[str, str] = {}  # what `target` holds now

    def sync(self, version: str | None = None) -> SyncResult:
        """Move only the tensors whose hash differs from what `target` holds (all, the first
        time). `version=None` means the newest published."""
        import torch

        if version is None:
            info = latest_version(self.rt, self.model)
        else:
            info = read_version(self.rt, self.model, version)
        missing = sorted(set(self.target) - set(info.tensors))
        if missing:
            raise InvalidArgument(f"version {info.version} lacks {missing[:5]}")
        moved = moved_bytes = 0
        with torch.no_grad():
            for name, entry in info.tensors.items():
                if name not in self.target or self._hashes.get(name) == entry["hash"]:
                    continue
                source = self.rt.artifact(entry["art_id"]).tensor_dict()[name]
                self.target[name].copy_(source)
                self._hashes[name] = entry["hash"]
                moved += 1
                moved_bytes += entry["size_bytes"]
        self.version = info.version
        return SyncResult(info.version, moved, moved_bytes, len(info.tensors) - moved)
