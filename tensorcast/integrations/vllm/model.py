"""What vLLM is given instead of a model directory on disk, and how its processes reach the
cluster.

`prepare_model_dir(artifact)` writes the small files that `tc put` stored with a model
directory (config.json, generation_config.json, the tokenizer's files) into a local directory,
with a `.tensorcast.json` marker naming the artifact and its content id. vLLM reads its
configuration and tokenizer from there; the weights never come from disk: the model loader
(`load_format="tensorcast"`) maps them from the worker holding the artifact.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensorcast.errors import InvalidArgument, NotFound
from tensorcast.integrations.connection import runtime
from tensorcast.integrations.vllm.keys import MARKER_FILE

if TYPE_CHECKING:
    from tensorcast.sdk.runtime import Runtime


def marker_of(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The `.tensorcast.json` of a prepared directory ({} when there is none)."""
    path = Path(model_dir) / MARKER_FILE
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def artifact_files(rt: Runtime, artifact: str) -> tuple[str, dict[str, bytes]]:
    """(content id, the small files) of a model directory artifact, or a clear error."""
    try:
        art = rt.artifact(artifact)
    except NotFound:
        raise NotFound(
            f"artifact {artifact!r} does not exist: put the model directory with "
            f"`tc put {artifact} DIR`"
        ) from None
    files = art.files()
    if "config.json" not in files:
        raise InvalidArgument(
            f"artifact {artifact!r} is not a model directory (it holds no config.json): put "
            f"a Hugging Face model directory with `tc put {artifact} DIR`"
        )
    return art.content_id, files


def prepare_model_dir(
    artifact: str,
    *,
    addr: str | None = None,
    token: str | None = None,
    state_dir: str | None = None,
    directory: str | os.PathLike[str] | None = None,
) -> Path:
    """A local directory holding the artifact's config and tokenizer files (no weights) and a
    marker naming the artifact, for `LLM(model=...)` / `vllm serve`. Written once per content
    id under `~/.cache/tensorcast/vllm-models/` (or `directory`); NotFound / InvalidArgument /
    Unavailable as for the loader."""
    from tensorcast.config import cache_dir

    rt = runtime(addr, token, state_dir)
    content_id, files = artifact_files(rt, artifact)
    target = Path(directory) if directory else cache_dir() / "vllm-models" / content_id[:32]
    marker = {"artifact": artifact, "content_id": content_id}
    if marker_of(target) == marker:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        for name, data in files.items():
            if Path(name).name != name or name.startswith("."):
                continue  # only plain file names are ever stored (model_dir.scan)
            (staging / name).write_bytes(data)
        (staging / MARKER_FILE).write_text(json.dumps(marker))
        try:
            os.replace(staging, target)  # atomic while `target` does not exist
        except OSError:  # it does: another process prepared it, or it holds other content
            if marker_of(target) != marker:
                stale = Path(tempfile.mkdtemp(prefix=".stale-", dir=target.parent))
                os.replace(target, stale / "old")
                os.replace(staging, target)
                shutil.rmtree(stale, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
