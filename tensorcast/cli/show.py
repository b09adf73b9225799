"""Show one artifact: owner, lease, replicas and every tensor's dtype, shape and hash."""

from __future__ import annotations

from typing import Annotated

import typer

from tensorcast.cli.common import AddrOpt, JsonOpt, StateDirOpt, TokenOpt, connect, emit, table

NAME = "show"


def command(
    art_id: Annotated[str, typer.Argument(help="Artifact id.")],
    state_dir: StateDirOpt = None,
    addr: AddrOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    from tensorcast.config import format_size

    with connect(state_dir, addr, token) as rt:
        info = rt.info(art_id)
        names = {w.worker_id: w.name for w in rt.workers()}
    data = {**info.to_json(), "tensors": [t.to_json() for t in info.tensors]}
    head = [
        f"artifact  {info.art_id}",
        f"content   {info.content_id}",
        f"owner     {info.owner}"
        + (f" (expires at {info.expires_at:.0f})" if info.expires_at else ""),
        f"size      {format_size(info.size_bytes)} in {len(info.tensors)} tensors",
        "replicas  "
        + (", ".join(names.get(r.worker_id, r.worker_id) for r in info.replicas) or "none live"),
    ]
    if info.parent:
        head.append(f"parent    {info.parent}")
    rows = [
        [
            t.name,
            t.dtype,
            "x".join(map(str, t.shape)) or "()",
            str(t.size_bytes),
            t.hash_hex[:16] or "(not read yet)",  # by reference: hashed on first read
        ]
        for t in info.tensors
    ]
    emit(
        as_json,
        data,
        "\n".join(head) + "\n\n" + table(rows, ["TENSOR", "DTYPE", "SHAPE", "BYTES", "HASH"]),
    )
