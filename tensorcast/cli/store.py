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
    TokenOpt,
    announce,
    state_dir_of,
)

app = typer.Typer(help="Run the Global Store (control-plane metadata).", no_args_is_help=True)


@app.command("start")
def start(
    db: Annotated[
        Path | None,
        typer.Option("--db", help="sqlite file (default: STATE_DIR/store.db).", show_default=False),
    ] = None,
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

    from tensorcast.config import env_token, parse_host_port, timing
    from tensorcast.sdk.cluster_file import read_token, write_token
    from tensorcast.store.server import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    parse_host_port(listen)
    directory = state_dir_of(state_dir)
    token = token or env_token() or read_token(directory)
    if not token:
        token = secrets.token_urlsafe(32)
        write_token(directory, token)
        typer.echo(f"generated a cluster token in {directory / 'token'}", err=True)
    serve(
        db or directory / "store.db",
        listen,
        token,
        timing().heartbeat_ttl_s,
        on_ready=lambda addr, metrics_addr: announce(
            ready_file,
            as_json,
            {"addr": addr, "pid": os.getpid(), "metrics_addr": metrics_addr},
        ),
        metrics_listen=metrics_listen,
        num_shards=shards,
        unreferenced_grace_s=timing().unreferenced_grace_s,
    )
