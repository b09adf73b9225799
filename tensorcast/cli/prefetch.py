"""Make a worker hold a replica of an artifact, pulled from the best peer (same host first, then
least loaded) over parallel streams, verified before it is listed. A no-op if it has one."""

from __future__ import annotations

from typing import Annotated

import typer

from tensorcast.cli.common import AddrOpt, JsonOpt, StateDirOpt, TokenOpt, connect, emit

NAME = "prefetch"


def command(
    art_id: Annotated[str, typer.Argument(help="Artifact id.")],
    to: Annotated[str, typer.Option("--to", help="Target worker (name or id).")],
    streams: Annotated[
        int, typer.Option("--streams", min=0, max=64, help="Parallel TCP streams (0: default).")
    ] = 0,
    timeout: Annotated[
        float, typer.Option("--timeout", min=0.1, help="Deadline in seconds.")
    ] = 120.0,
    device: Annotated[
        str,
        typer.Option(
            "--device",
            help="cpu (the pool), or cuda / cuda:N to also load it into the worker's GPU tier "
            "(a worker on this host started with --gpu-mem).",
        ),
    ] = "cpu",
    state_dir: StateDirOpt = None,
    addr: AddrOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    from tensorcast.config import format_size

    with connect(state_dir, addr, token) as rt:
        reply = rt.artifact(art_id).prefetch(to, device, timeout_s=timeout, streams=streams)
    rate = reply.bytes_moved / reply.elapsed_s / 1e9 if reply.elapsed_s else 0.0
    data = {
        "art_id": art_id,
        "worker": to,
        "device": device,
        "already_present": reply.already_present,
        "bytes_moved": reply.bytes_moved,
        "source_worker_id": reply.source_worker_id,
        "elapsed_s": round(reply.elapsed_s, 4),
        "retries": reply.retries,
    }
    human = (
        f"{to} already holds {art_id}"
        if reply.already_present
        else f"prefetched {art_id} to {to}: {format_size(reply.bytes_moved)} in "
        f"{reply.elapsed_s:.2f}s ({rate:.2f} GB/s)"
    )
    emit(as_json, data, human)
