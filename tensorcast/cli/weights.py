"""`tc weights`: versioned weight publication (RL weight sync)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tensorcast.cli.common import AddrOpt, JsonOpt, StateDirOpt, TokenOpt, connect, emit, table

app = typer.Typer(help="Publish and sync versioned model weights.", no_args_is_help=True)

ModelOpt = Annotated[str, typer.Option("--model", help="Model name, e.g. llama-8b.")]


@app.command("publish")
def publish(
    path: Annotated[Path, typer.Argument(help="A .safetensors file or a model directory.")],
    model: ModelOpt,
    version: Annotated[str, typer.Option("--version", help="Version name, e.g. step-1200.")],
    keep_last: Annotated[int, typer.Option("--keep-last", min=1, help="Versions to keep.")] = 3,
    state_dir: StateDirOpt = None,
    addr: AddrOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Publish the tensors of PATH as an immutable version of MODEL; tensors whose content is
    already stored move no data. Versions beyond --keep-last are deleted."""
    from safetensors.torch import load_file

    from tensorcast.config import format_size
    from tensorcast.model_dir import scan
    from tensorcast.sdk.weight_sync import WeightPublisher

    state = {}
    for header in scan(path).headers:
        state.update(load_file(header.path))
    with connect(state_dir, addr, token) as rt:
        info = WeightPublisher(rt, model, keep_last=keep_last).publish(state, version)
    emit(
        as_json,
        {
            "model": model,
            "version": version,
            "tensors": len(info.tensors),
            "size_bytes": info.size_bytes,
        },
        f"published {model}@{version}: {len(info.tensors)} tensors, {format_size(info.size_bytes)}",
    )


@app.command("ls")
def ls(
    model: ModelOpt,
    state_dir: StateDirOpt = None,
    addr: AddrOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List the published versions of MODEL, oldest first."""
    from tensorcast.config import format_size
    from tensorcast.sdk.weight_sync import list_versions

    with connect(state_dir, addr, token) as rt:
        versions = list_versions(rt, model)
    rows = [
        [v.version, str(len(v.tensors)), format_size(v.size_bytes), f"{v.published_at:.0f}"]
        for v in versions
    ]
    emit(
        as_json,
        {
            "model": model,
            "versions": [
                {
                    "version": v.version,
                    "tensors": len(v.tensors),
                    "size_bytes": v.size_bytes,
                    "published_at": v.published_at,
                }
                for v in versions
            ],
        },
        table(rows, ["VERSION", "TENSORS", "SIZE", "PUBLISHED"]),
    )


@app.command("sync")
def sync(
    model: ModelOpt,
    to: Annotated[str, typer.Option("--to", help="Worker to bring the version to.")],
    version: Annotated[
        str | None, typer.Option("--version", help="Version (default: newest).", show_default=False)
    ] = None,
    state_dir: StateDirOpt = None,
    addr: AddrOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Bring a version of MODEL to a worker: only tensors it does not hold yet are moved."""
    from tensorcast.sdk.weight_sync import latest_version, read_version

    with connect(state_dir, addr, token) as rt:
        info = latest_version(rt, model) if version is None else read_version(rt, model, version)
        replies = rt.prefetch_many([e["art_id"] for e in info.tensors.values()], to)
    moved = sum(r.bytes_moved for r in replies)
    fresh = sum(not r.already_present for r in replies)
    emit(
        as_json,
        {
            "model": model,
            "version": info.version,
            "worker": to,
            "moved_tensors": fresh,
            "moved_bytes": moved,
        },
        f"{to} now holds {model}@{info.version}: moved {fresh} tensors ({moved} bytes)",
    )
