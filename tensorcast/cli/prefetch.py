"""Make a worker hold a replica of an artifact, pulled from the best peer (same host first, then
least loaded) over parallel streams, verified before it is listed. A no-op if it has one.
Several --to workers form a pipelined chain: each relays what it has received to the next."""

from __future__ import annotations

from typing import Annotated

import typer

from tensorcast.cli.common import AddrOpt, JsonOpt, StateDirOpt, TokenOpt, connect, emit

NAME = "prefetch"


def command(
    art_id: Annotated[str, typer.Argument(help="Artifact id.")],
    to: Annotated[
        list[str],
        typer.Option(
            "--to",
            help="Target worker (name or id). Repeat it for several: they receive the artifact "
            "as a chain (each relays to the next while receiving), in the order given.",
        ),
    ],
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
    if len(to) > 1 and device != "cpu":
        raise typer.BadParameter("several --to workers take --device cpu only", param_hint="--to")
    with connect(state_dir, addr, token) as rt:
        art = rt.artifact(art_id)
        if len(to) == 1:
            replies = [art.prefetch(to[0], device, timeout_s=timeout, streams=streams)]
        else:
            replies = art.prefetch_chain(to, timeout_s=timeout, streams=streams)
    rows = [_row(art_id, worker, device, reply) for worker, reply in zip(to, replies)]
    human = "\n".join(_human(art_id, row) for row in rows)
    emit(as_json, rows[0] if len(rows) == 1 else {"art_id": art_id, "chain": rows}, human)


def _row(art_id: str, worker: str, device: str, reply) -> dict:
    return {
        "art_id": art_id,
        "worker": worker,
        "device": device,
        "already_present": reply.already_present,
        "bytes_moved": reply.bytes_moved,
        "source_worker_id": reply.source_worker_id,
        "elapsed_s": round(reply.elapsed_s, 4),
        "retries": reply.retries,
    }


def _human(art_id: str, row: dict) -> str:
    from tensorcast.config import format_size

    if row["already_present"]:
        return f"{row['worker']} already holds {art_id}"
    rate = row["bytes_moved"] / row["elapsed_s"] / 1e9 if row["elapsed_s"] else 0.0
    return (
        f"prefetched {art_id} to {row['worker']}: {format_size(row['bytes_moved'])} in "
        f"{row['elapsed_s']:.2f}s ({rate:.2f} GB/s) from {row['source_worker_id']}"
    )
