"""Versioned weight publication for RL post-training: a trainer publishes state dicts, rollout
workers bring live models to a version moving only the tensors whose content changed.

Layout: every tensor of a version is its own artifact `weights/MODEL@VERSION/NAME` (content that
did not change is stored once, so publishing an unchanged tensor moves no bytes); the version's
manifest `weights/MODEL@VERSION` lists them with their hashes. A version's tensors and manifest are
created in ONE Global Store transaction (`Runtime.put_many`'s batch), so a subscriber that finds a
manifest finds a complete version, and a failed publish leaves nothing. Versions are immutable;
`keep_last` bounds how many are kept.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tensorcast.errors import (
    AlreadyExists,
    IntegrityError,
    InvalidArgument,
    NotFound,
    TensorcastError,
)
from tensorcast.model_dir import FILE_PREFIX

if TYPE_CHECKING:
    import torch

    from tensorcast.sdk.runtime import Runtime

log = logging.getLogger("tensorcast.weights")
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
    """Version names of `model`, oldest first (by when the store recorded each manifest): one
    listing of the manifests alone (not their tensors), a page at a time."""
    _check_name("model", model)
    prefix = f"{PREFIX}{model}@"
    manifests = []
    page, after = rt.list_artifacts_page(prefix, delimiter="/")
    while True:
        manifests += page
        if not after:
            break
        page, after = rt.list_artifacts_page(prefix, after=after, delimiter="/")
    return [a.art_id[len(prefix) :] for a in sorted(manifests, key=lambda a: a.created_at)]


def list_versions(rt: Runtime, model: str) -> list[VersionInfo]:
    """Published versions of `model`, oldest first."""
    versions = []
    for name in _manifests(rt, model):
        try:
            versions.append(read_version(rt, model, name))
        except NotFound:
            continue  # collected meanwhile, or not a version
    return versions


def latest_version(rt: Runtime, model: str) -> VersionInfo:
    """The newest published version (reads its manifest; an artifact under the model's name
    that is no version is passed over)."""
    for name in reversed(_manifests(rt, model)):
        try:
            return read_version(rt, model, name)
        except NotFound:
            continue
    raise NotFound(f"no published version of {model!r}")


def read_version(rt: Runtime, model: str, version: str) -> VersionInfo:
    """A version's manifest; NotFound when there is none under that name, or the artifact
    there holds no manifest (someone else's artifact under the `weights/` prefix)."""
    art_id = manifest_id(model, version)
    try:
        manifest = json.loads(rt.artifact(art_id).files()[MANIFEST_FILE])
        return VersionInfo(model, version, float(manifest["published_at"]), manifest["tensors"])
    except (KeyError, TypeError, ValueError):
        raise NotFound(f"{art_id} is not a published version (no valid manifest)") from None


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
        then delete versions older than the newest `keep_last`. The version's tensors and its
        manifest are created in one Global Store transaction: all of them or none."""
        import torch

        from tensorcast.sdk import batch
        from tensorcast.types import OWNER_SYSTEM

        _check_name("version", version)
        base = manifest_id(self.model, version)
        items = [(f"{base}/{name}", {name: tensor}) for name, tensor in state_dict.items()]
        specs = batch.tensor_specs(items, OWNER_SYSTEM, 0.0)
        tensors = {}
        for (name, _), spec in zip(state_dict.items(), specs):
            meta = spec.metas[0]
            tensors[name] = {
                "art_id": spec.art_id,
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
        specs += batch.tensor_specs(
            [(base, {FILE_PREFIX + MANIFEST_FILE: blob})], OWNER_SYSTEM, 0.0
        )
        try:
            batch.put_batch(self.rt, specs, None, brief=True)
            info = VersionInfo(self.model, version, published_at, tensors)
        except AlreadyExists:
            # A retry (the first call's outcome unknown) of the same weights is that version;
            # other weights under the name, or an id of it taken by other content, are refused.
            existing = self._same_version(version, tensors)
            if existing is None:
                raise
            info = existing
        try:
            self.collect()
        except TensorcastError as e:  # the version is published: collecting waits for the next
            log.warning("collecting old versions of %s failed: %s", self.model, e)
        return info

    def _same_version(self, version: str, tensors: dict[str, dict]) -> VersionInfo | None:
        """`version` as published, if it holds exactly `tensors`: the same bytes as the same
        dtypes and shapes (a reshape, or other dtype of equal bits, is other weights)."""
        try:
            info = read_version(self.rt, self.model, version)
        except NotFound:
            return None

        def key(entries: dict[str, dict]) -> dict[str, tuple]:
            return {n: (t["hash"], t["dtype"], list(t["shape"])) for n, t in entries.items()}

        return info if key(info.tensors) == key(tensors) else None

    def collect(self) -> list[str]:
        """Delete all but the newest `keep_last` versions; returns the deleted versions. One
        listing, a read of each manifest past the newest `keep_last` and one delete request,
        manifests first (a version is never half-visible). Artifacts under the model's name
        that are no version (no manifest) are neither counted nor deleted."""
        names = _manifests(self.rt, self.model)
        if len(names) <= self.keep_last:
            return []  # nothing to collect: no manifest read
        kept = 0
        doomed: list[VersionInfo] = []
        for name in reversed(names):
            try:
                info = read_version(self.rt, self.model, name)
            except NotFound:
                continue  # collected meanwhile (another publisher), or not a version
            if kept < self.keep_last:
                kept += 1
            else:
                doomed.append(info)
        manifests = [manifest_id(self.model, v.version) for v in doomed]
        tensors = [entry["art_id"] for v in doomed for entry in v.tensors.values()]
        if manifests:
            self.rt.delete_many(manifests + tensors, missing_ok=True)
        return [v.version for v in reversed(doomed)]


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

        from tensorcast.tensors import dtype_name

        if version is None:
            info = latest_version(self.rt, self.model)
        else:
            info = read_version(self.rt, self.model, version)
        missing = sorted(set(self.target) - set(info.tensors))
        if missing:
            raise InvalidArgument(f"version {info.version} lacks {missing[:5]}")
        for name in sorted(set(self.target) & set(info.tensors)):
            # copy_ would broadcast a smaller tensor or cast another dtype: wrong weights,
            # silently. Every tensor is checked before any is written.
            entry, have = info.tensors[name], self.target[name]
            if (list(entry["shape"]), entry["dtype"]) != (list(have.shape), dtype_name(have.dtype)):
                raise InvalidArgument(
                    f"version {info.version}: tensor {name!r} is {entry['dtype']} "
                    f"{list(entry['shape'])}, the target's is {dtype_name(have.dtype)} "
                    f"{list(have.shape)}; nothing was changed"
                )
        changed = {
            name: entry
            for name, entry in info.tensors.items()
            if name in self.target and self._hashes.get(name) != entry["hash"]
        }
        # Every changed tensor is mapped (and held) before `target` changes: a version
        # collected meanwhile (another publisher's `keep_last`) fails the sync with `target`
        # as it was, never half old and half new.
        sources = {}
        for name, entry in changed.items():
            art = self.rt.artifact(entry["art_id"])
            meta = art.tensor_meta().get(name)
            if meta is None or meta.hash_hex != entry["hash"]:
                raise IntegrityError(
                    f"version {info.version}: artifact {entry['art_id']} does not hold the "
                    f"tensor {name!r} its manifest names"
                )
            sources[name] = art.tensor_dict()[name]
        with torch.no_grad():
            for name, source in sources.items():
                self.target[name].copy_(source)
                self._hashes[name] = changed[name]["hash"]
        moved = len(sources)
        moved_bytes = sum(changed[name]["size_bytes"] for name in sources)
        self.version = info.version
        return SyncResult(info.version, moved, moved_bytes, len(info.tensors) - moved)
