"""`tc instance start`: run an engine as an instance attached to a worker, serving generation
requests over HTTP: the reference engine (Hugging Face transformers on CPU), the emulated
engine for routing experiments (`--engine sim`, which also speaks SGLang's HTTP API) or a vLLM
OpenAI-compatible server with TensorCast's model loader and KV connector (`--engine vllm`)."""

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
        str,
        typer.Option(
            "--model", help="Artifact id of a model directory put with tc put (engines hf, vllm)."
        ),
    ] = "",
    engine_name: Annotated[
        str,
        typer.Option(
            "--engine",
            help="hf: transformers on CPU (needs --model); sim: the emulated engine "
            "(tensorcast/engine/sim.py) with SGLang's HTTP API; vllm: vllm serve with "
            "load_format=tensorcast and the TensorCastConnector (needs --model).",
        ),
    ] = "hf",
    instance_id: Annotated[
        str, typer.Option("--id", help="Instance id (default: instance-<pid>).", show_default=False)
    ] = "",
    listen: Annotated[
        str, typer.Option("--listen", help="HOST:PORT of the engine's HTTP API (port 0: any).")
    ] = "127.0.0.1:0",
    page_tokens: Annotated[
        int | None,
        typer.Option(
            "--page-tokens",
            min=1,
            max=4096,
            help="Tokens per KV page (default: 16 hf, 32 sim).",
            show_default=False,
        ),
    ] = None,
    time_scale: Annotated[
        float,
        typer.Option(
            "--time-scale",
            min=0.001,
            help="sim: divide every modelled duration by this (the workload's time compression).",
        ),
    ] = 1.0,
    kv_bytes_per_token: Annotated[
        int, typer.Option("--kv-bytes-per-token", min=1, help="sim: real KV bytes per token.")
    ] = 256,
    cache_tokens: Annotated[
        int, typer.Option("--cache-tokens", min=128, help="sim: prefix cache capacity in tokens.")
    ] = 262_144,
    max_running: Annotated[
        int, typer.Option("--max-running", min=1, help="sim: most requests in one batch.")
    ] = 64,
    max_prefill_tokens: Annotated[
        int, typer.Option("--max-prefill-tokens", min=1, help="sim: prefill chunk in tokens.")
    ] = 8192,
    cost: Annotated[
        list[str] | None,
        typer.Option(
            "--cost",
            help="sim: override a cost-model parameter, NAME=SECONDS (repeatable), e.g. "
            "--cost decode_base_s=0.03.",
            show_default=False,
        ),
    ] = None,
    kv_share: Annotated[
        str,
        typer.Option(
            "--kv-share",
            help="sim: shared prefix store: none, tensorcast, redis://HOST:PORT or "
            "mooncake://MASTER?metadata=URL.",
        ),
    ] = "none",
    vllm_listen: Annotated[
        str,
        typer.Option(
            "--vllm-listen", help="vllm: HOST:PORT of vLLM's OpenAI API (port 0: a free one)."
        ),
    ] = "127.0.0.1:0",
    vllm_args: Annotated[
        list[str] | None,
        typer.Option(
            "--vllm-arg",
            help="vllm: one more argument for vllm serve (repeatable), e.g. "
            "--vllm-arg=--max-model-len=4096.",
            show_default=False,
        ),
    ] = None,
    startup_timeout: Annotated[
        float,
        typer.Option("--startup-timeout", min=1, help="vllm: seconds to wait for vllm serve."),
    ] = 600.0,
    load_interval: Annotated[
        float,
        typer.Option("--load-interval", min=0.05, help="Seconds between load reports."),
    ] = 0.5,
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
    GET /load, GET /requests, POST /evict (sim also: SGLang's /generate, /get_load, /health,
    /server_info). The worker pushes publish/hydrate/evict/transform_into to it."""
    import logging
    import signal
    import threading

    from tensorcast.cli.instance_runtime import open_runtime
    from tensorcast.config import parse_host_port
    from tensorcast.errors import InvalidArgument
    from tensorcast.sdk.instance import InstanceRuntime

    if engine_name not in ("hf", "sim", "vllm"):
        raise InvalidArgument(f"unknown engine {engine_name!r}: use hf, sim or vllm")
    if engine_name in ("hf", "vllm") and not model:
        raise InvalidArgument(f"--engine {engine_name} needs --model (an artifact put with tc put)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    host, port = parse_host_port(listen)
    rt, target = open_runtime(worker, state_dir, addr, token)
    kv_store = None
    iid = instance_id or f"instance-{os.getpid()}"
    server = None
    if engine_name == "sim":
        from tensorcast.engine.kv_share import open_store
        from tensorcast.engine.sglang_api import SimHTTPServer
        from tensorcast.engine.sim import SimConfig, SimEngine

        config = SimConfig(
            cost=_cost_model(cost or []),
            page_tokens=page_tokens or 32,
            kv_bytes_per_token=kv_bytes_per_token,
            cache_tokens=cache_tokens,
            max_running=max_running,
            max_prefill_tokens=max(max_prefill_tokens, page_tokens or 32),
            time_scale=time_scale,
        )
        kv_store = open_store(kv_share, rt)
        engine = SimEngine(config, kv_store).start()
        http = SimHTTPServer(engine, host, port).start()
        what = f"sim x{time_scale:g}"
    elif engine_name == "vllm":
        from tensorcast.integrations.vllm.instance import start_vllm

        server, engine, http = start_vllm(  # type: ignore[assignment]
            rt,
            model,
            iid,
            host,
            port,
            vllm_listen,
            vllm_args or [],
            startup_timeout,
            state_dir,
            addr,
            token,
        )
        what = f"vllm {model}, OpenAI API at {server.addr}"
    else:
        from tensorcast.engine.hf import HFEngine
        from tensorcast.engine.server import EngineHTTPServer
        from tensorcast.integrations.transformers import load_model

        engine = HFEngine(load_model(rt, model), page_tokens=page_tokens or 16)  # type: ignore[assignment]
        http = EngineHTTPServer(engine, host, port).start()  # type: ignore[assignment,arg-type]
        what = model
    inst = InstanceRuntime(
        rt, engine, target, iid, endpoint=http.addr, load_interval_s=load_interval
    ).start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ready = {"instance_id": iid, "endpoint": http.addr, "pid": os.getpid()}
    if server is not None:
        ready["openai"] = server.addr
    announce(ready_file, as_json, ready)
    logging.getLogger("tensorcast.instance").info(
        "instance %s (%s) on worker %s, endpoint %s", iid, what, target.name, http.addr
    )
    while not stop.wait(0.5):  # see worker/server.py: a plain wait() may miss SIGTERM
        pass
    inst.close()
    http.close()
    if engine_name == "sim":
        engine.close()  # type: ignore[attr-defined]
    if kv_store is not None:
        kv_store.close()
    if server is not None:
        server.close()
    rt.close()


def _cost_model(overrides: list[str]):
    from dataclasses import fields, replace

    from tensorcast.engine.sim import CostModel
    from tensorcast.errors import InvalidArgument

    names = {f.name for f in fields(CostModel)}
    values: dict[str, float] = {}
    for item in overrides:
        name, sep, value = item.partition("=")
        if not sep or name not in names:
            raise InvalidArgument(
                f"--cost {item!r}: use NAME=SECONDS with NAME one of {sorted(names)}"
            )
        try:
            values[name] = float(value)
        except ValueError:
            raise InvalidArgument(f"--cost {item!r}: {value!r} is not a number") from None
    return replace(CostModel(), **values)
