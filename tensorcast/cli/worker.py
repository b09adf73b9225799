"""`tc worker start`: run a worker in the foreground."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from tensorcast.cli.common import (
    AddrOpt,
    JsonOpt,
    MetricsListenOpt,
    StateDirOpt,
    TlsCaOpt,
    TlsCertOpt,
    TlsKeyOpt,
    TokenOpt,
    announce,
    state_dir_of,
)
from tensorcast.config import DEFAULT_WORKER_MEM

app = typer.Typer(help="Run a worker (holds a slice of the tensor pool).", no_args_is_help=True)


@app.command("start")
def start(
    store: Annotated[
        str,
        typer.Option(
            "--store",
            help="Global Store HOST:PORT, or several members H1:P1,H2:P2 (tried in turn).",
        ),
    ],
    listen: Annotated[
        str, typer.Option("--listen", help="HOST:PORT for the worker's gRPC service.")
    ] = "127.0.0.1:0",
    mem: Annotated[
        str, typer.Option("--mem", help="Pool size (allocated and pre-faulted at start).")
    ] = DEFAULT_WORKER_MEM,
    roles: Annotated[
        str, typer.Option("--roles", help="Comma list of basic, gateway, shard-home.")
    ] = "basic,gateway,shard-home",
    name: Annotated[str, typer.Option("--name", help="Name shown in tc status.")] = "",
    disk: Annotated[
        Path | None,
        typer.Option(
            "--disk",
            help="Directory for the disk tier: last copies spill here when "
            "the pool is full (otherwise the write fails).",
            show_default=False,
        ),
    ] = None,
    gpu_mem: Annotated[
        str | None,
        typer.Option(
            "--gpu-mem",
            help="GPU tier: this much device memory, allocated at start, holds contents "
            "that same-host callers map by CUDA IPC handle (tensor_dict(device='cuda')).",
            show_default=False,
        ),
    ] = None,
    gpu_device: Annotated[
        int, typer.Option("--gpu-device", min=0, help="CUDA device index of the GPU tier.")
    ] = 0,
    metrics_listen: MetricsListenOpt = "127.0.0.1:0",
    token: TokenOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    state_dir: StateDirOpt = None,
    as_json: JsonOpt = False,
    ready_file: Annotated[
        Path | None,
        typer.Option(
            "--ready-file",
            help="Write {addr, pid, worker_id} here once serving.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Serve a worker until SIGTERM/SIGINT: a shared-memory pool of --mem bytes with a hard cap,
    registered with the Global Store and heartbeating."""
    import logging

    from tensorcast.config import (
        env_token,
        parse_host_port,
        parse_size,
        parse_store_addrs,
        timing,
        tls_files,
    )
    from tensorcast.errors import InvalidArgument
    from tensorcast.sdk.cluster_file import read_token
    from tensorcast.worker.server import parse_roles, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parse_store_addrs(store)
    parse_host_port(listen)
    mem_bytes = parse_size(mem)
    gpu_mem_bytes = parse_size(gpu_mem) if gpu_mem else 0
    role_list = parse_roles(roles)
    token = token or env_token() or read_token(state_dir_of(state_dir))
    if not token:
        raise InvalidArgument("no cluster token: pass --token or set TC_TOKEN")
    t = timing()
    tls = tls_files(state_dir_of(state_dir), tls_ca, tls_cert, tls_key)
    serve(
        store,
        listen,
        token,
        mem_bytes,
        role_list,
        name,
        t.heartbeat_interval_s,
        t.rpc_timeout_s,
        disk_dir=disk,
        metrics_listen=metrics_listen,
        gpu_mem_bytes=gpu_mem_bytes,
        gpu_device=gpu_device,
        tls=tls,
        on_ready=lambda node: announce(
            ready_file,
            as_json,
            {
                "addr": node.addr,
                "pid": os.getpid(),
                "worker_id": node.worker_id,
                "metrics_addr": node.metrics_addr,
            },
        ),
    )


@app.command("stop")
def stop(
    name: Annotated[str, typer.Argument(help="Worker name or id (see tc status).")],
    timeout: Annotated[
        float, typer.Option("--timeout", min=0.1, help="Seconds to wait before SIGKILL.")
    ] = 10.0,
    state_dir: StateDirOpt = None,
    addr: AddrOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Stop a worker running on this host (SIGTERM, then SIGKILL after --timeout). Its replicas
    leave the cluster with it: drain what must survive first (tc prefetch to another worker)."""
    from tensorcast.cli.common import connect, emit
    from tensorcast.errors import InvalidArgument
    from tensorcast.sdk.local_cluster import stop_process

    with connect(state_dir, addr, token) as rt:
        worker = rt.resolve_worker(name)
        if not rt.is_local(worker):
            raise InvalidArgument(f"worker {name!r} runs on another host: stop it there")
    killed = stop_process(worker.pid, timeout)
    emit(
        as_json,
        {"name": worker.name, "worker_id": worker.worker_id, "pid": worker.pid, "killed": killed},
        f"stopped {worker.name} (pid {worker.pid}{', killed' if killed else ''})",
    )
