"""`tc instance start`: run the reference engine (Hugging Face transformers on CPU) as an
instance attached to a worker, serving generation requests over HTTP."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from tensorcast.cli.common import AddrOpt, JsonOpt, StateDirOpt, TokenOpt, announce

app = typer.Typer(help="Run engine instances attached to a worker.", no_args_is_help=True)


@app.command("start")
def start(
    worker: Annotated[
        str, typer.Option("--worker", help="The local worker to attach to: HOST:PORT, name or id.")
    ],
    model: Annotated[
        str, typer.Option("--model", help="Artifact id of a model directory put with tc put.")
    ],
    instance_id: Annotated[
        str, typer.Option("--id", help="Instance id (default: instance-<pid>).", show_default=False)
    ] = "",
    listen: Annotated[
        str, typer.Option("--listen", help="HOST:PORT of the engine's HTTP API (port 0: any).")
    ] = "127.0.0.1:0",
    page_tokens: Annotated[
        int, typer.Option("--page-tokens", min=1, max=4096, help="Tokens per KV page.")
    ] = 16,
    state_dir: StateDirOpt = None,
    addr: AddrOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
    ready_file: Annotated[
        Path | None,
        typer.Option(
            "--ready-file",
            help="Write {instance_id, endpoint, pid} here once serving.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Serve until SIGTERM/SIGINT: POST /generate {req_id, prompt_ids | null, max_new_tokens},
    GET /load, POST /evict. The worker pushes publish/hydrate/evict/transform_into to it."""
    import logging
    import signal
    import threading

    from tensorcast.cli.instance_runtime import open_runtime
    from tensorcast.config import parse_host_port
    from tensorcast.engine.hf import HFEngine
    from tensorcast.engine.server import EngineHTTPServer
    from tensorcast.integrations.transformers import load_model
    from tensorcast.sdk.instance import InstanceRuntime

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    host, port = parse_host_port(listen)
    rt, target = open_runtime(worker, state_dir, addr, token)
    engine = HFEngine(load_model(rt, model), page_tokens=page_tokens)
    http = EngineHTTPServer(engine, host, port).start()
    iid = instance_id or f"instance-{os.getpid()}"
    inst = InstanceRuntime(rt, engine, target, iid, endpoint=http.addr).start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    announce(ready_file, as_json, {"instance_id": iid, "endpoint": http.addr, "pid": os.getpid()})
    logging.getLogger("tensorcast.instance").info(
        "instance %s (%s) on worker %s, endpoint %s", iid, model, target.name, http.addr
    )
    stop.wait()
    inst.close()
    http.close()
    rt.close()
