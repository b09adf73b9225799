"""`tc store start`: run a Global Store in the foreground."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from tensorcast.cli.common import (
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

app = typer.Typer(help="Run the Global Store (control-plane metadata).", no_args_is_help=True)


@app.command("start")
def start(
    backend: Annotated[
        str,
        typer.Option(
            "--backend",
            help="Where the records live: sqlite (one file, one store process) or etcd "
            "(an etcd cluster several store processes may serve at once).",
        ),
    ] = "sqlite",
    db: Annotated[
        Path | None,
        typer.Option("--db", help="sqlite file (default: STATE_DIR/store.db).", show_default=False),
    ] = None,
    etcd_endpoints: Annotated[
        str,
        typer.Option(
            "--etcd-endpoints",
            help="etcd members' client addresses, H1:2379,H2:2379,... (with --backend etcd).",
        ),
    ] = "",
    etcd_prefix: Annotated[
        str,
        typer.Option("--etcd-prefix", help="Key prefix of this cluster's records in etcd."),
    ] = "/tensorcast/",
    listen: Annotated[
        str, typer.Option("--listen", help="HOST:PORT to serve on (port 0: any).")
    ] = "127.0.0.1:7400",
    metrics_listen: MetricsListenOpt = "127.0.0.1:0",
    shards: Annotated[
        int | None,
        typer.Option(
            "--shards",
            help="KV page shards, fixed when the store is first created (default: 16).",
            show_default=False,
        ),
    ] = None,
    token: TokenOpt = None,
    tls_ca: TlsCaOpt = None,
    tls_cert: TlsCertOpt = None,
    tls_key: TlsKeyOpt = None,
    state_dir: StateDirOpt = None,
    as_json: JsonOpt = False,
    ready_file: Annotated[
        Path | None,
        typer.Option(
            "--ready-file", help="Write {addr, pid} here once serving.", show_default=False
        ),
    ] = None,
) -> None:
    """Serve the Global Store until SIGTERM/SIGINT. Without a token (flag, TC_TOKEN, state dir)
    one is generated and saved to the state dir's `token` file (mode 0600)."""
    import logging
    import secrets

    from tensorcast.config import env_token, parse_host_port, parse_store_addrs, timing, tls_files
    from tensorcast.errors import InvalidArgument
    from tensorcast.sdk.cluster_file import read_token, write_token
    from tensorcast.store.server import open_backend, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parse_host_port(listen)
    if backend not in ("sqlite", "etcd"):
        raise InvalidArgument(f"--backend {backend!r}: choose sqlite or etcd")
    if (backend == "etcd") != bool(etcd_endpoints):
        raise InvalidArgument("--etcd-endpoints goes with --backend etcd, and only with it")
    if backend == "etcd" and db is not None:
        raise InvalidArgument("--db is the sqlite backend's file: not with --backend etcd")
    if not etcd_prefix.startswith("/") or not etcd_prefix.endswith("/"):
        raise InvalidArgument(f"--etcd-prefix {etcd_prefix!r}: start and end it with '/'")
    endpoints = parse_store_addrs(etcd_endpoints) if etcd_endpoints else []
    directory = state_dir_of(state_dir)
    token = token or env_token() or read_token(directory)
    if not token:
        token = secrets.token_urlsafe(32)
        write_token(directory, token)
        typer.echo(f"generated a cluster token in {directory / 'token'}", err=True)
    t = timing()
    records = open_backend(
        db or directory / "store.db",
        endpoints,
        t.heartbeat_ttl_s,
        num_shards=shards,
        unreferenced_grace_s=t.unreferenced_grace_s,
        etcd_prefix=etcd_prefix,
        batch_timeout_s=t.batch_timeout_s,
    )
    serve(
        records,
        listen,
        token,
        t.heartbeat_ttl_s,
        on_ready=lambda addr, metrics_addr, frame_port: announce(
            ready_file,
            as_json,
            {
                "addr": addr,
                "pid": os.getpid(),
                "metrics_addr": metrics_addr,
                "frame_port": frame_port,
            },
        ),
        metrics_listen=metrics_listen,
        tls=tls_files(directory, tls_ca, tls_cert, tls_key),
    )
