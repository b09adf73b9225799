"""Store a safetensors file, or a directory of them, as an artifact.

Every header is validated before any byte moves; a malformed file changes nothing. Putting the
same content under the same id again is a no-op; under a taken id it fails (exit 5).
With --by-reference nothing is read now: this host's worker reads the tensors on first use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tensorcast.cli.common import (
    AddrOpt,
    JsonOpt,
    StateDirOpt,
    TokenOpt,
    connect,
    emit,
    progress_bar,
)

NAME = "put"


def command(
    art_id: Annotated[str, typer.Argument(help="Artifact id, e.g. llama-8b@v1.")],
    path: Annotated[Path, typer.Argument(help="A .safetensors file or a directory of them.")],
    ttl: Annotated[
        float | None,
        typer.Option(
            "--ttl",
            help="Caller-leased: expire after this many seconds unless renewed.",
            show_default=False,
        ),
    ] = None,
    on: Annotated[
        str | None,
        typer.Option(
            "--on",
            help="Worker to place it on, by name or id (default: same host, most free memory).",
            show_default=False,
        ),
    ] = None,
    by_reference: Annotated[
        bool,
        typer.Option(
            "--by-reference",
            help="Register the files without copying them: the first read loads the tensors' "
            "byte ranges into this host's worker (the files must stay unchanged).",
        ),
    ] = False,
    state_dir: StateDirOpt = None,
    addr: AddrOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    import time

    from tensorcast.config import format_size
    from tensorcast.model_dir import scan
    from tensorcast.store.base import check_lease_ttl

    if ttl is not None:
        check_lease_ttl(ttl)
    total = sum(facts[1] for facts in scan(path).facts())
    with connect(state_dir, addr, token) as rt:
        started = time.perf_counter()
        if by_reference:
            art = rt.put_files(art_id, path, ttl_s=ttl, worker=on, by_reference=True)
        else:
            with progress_bar(total, f"put {art_id}", not as_json) as advance:
                art = rt.put_files(art_id, path, ttl_s=ttl, worker=on, progress=advance)
        elapsed = time.perf_counter() - started
    info = art.info
    data = {**info.to_json(), "elapsed_s": round(elapsed, 4), "by_reference": by_reference}
    if by_reference:
        how = "registered by reference (read on first use)"
    else:
        rate = info.size_bytes / elapsed / 1e9 if elapsed > 0 else 0.0
        how = f"in {elapsed:.2f}s ({rate:.2f} GB/s)"
    emit(
        as_json,
        data,
        f"put {info.art_id}: {len(info.tensors)} tensors, {format_size(info.size_bytes)} "
        f"{how}, content {info.content_id}",
    )
