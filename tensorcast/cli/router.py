"""`tc router start`: an HTTP router (SGLang's /generate API) in front of the cluster's engine
instances, with policies rebalance (a new session on the least busy instance, then sticky,
plus Algorithm 1 migrations of sessions with their KV caches), cache-aware, load-aware (power
of two) and round-robin.
`tc router state`: what a running router sees (loads, sessions, recent migrations)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tensorcast.cli.common import AddrOpt, JsonOpt, StateDirOpt, TokenOpt, announce, emit, table

app = typer.Typer(help="Route generation requests across engine instances.", no_args_is_help=True)


@app.command("start")
def start(
    listen: Annotated[
        str, typer.Option("--listen", help="HOST:PORT to serve on (port 0: any).")
    ] = "127.0.0.1:0",
    policy: Annotated[
        str,
        typer.Option(
            "--policy", help="rebalance, cache-aware, load-aware (power of two) or round-robin."
        ),
    ] = "rebalance",
    tick: Annotated[
        float,
        typer.Option("--tick", min=0.01, max=86400, help="Seconds between rebalance ticks."),
    ] = 1.0,
    load_source: Annotated[
        str,
        typer.Option(
            "--load-source",
            help="signals: instances' reported waiting+running; router: this router's "
            "in-flight requests.",
        ),
    ] = "signals",
    alpha: Annotated[float, typer.Option("--alpha", help="EWMA weight of a new sample.")] = 0.5,
    theta_abs: Annotated[
        float, typer.Option("--theta-abs", help="Smallest load gap that triggers a move.")
    ] = 2.0,
    theta_rel: Annotated[
        float, typer.Option("--theta-rel", help="Smallest load ratio that triggers a move.")
    ] = 1.5,
    horizon: Annotated[
        float, typer.Option("--horizon", help="H: idle seconds that divide a score by e.")
    ] = 60.0,
    penalty: Annotated[
        float, typer.Option("--penalty", help="lambda: score divisor per past migration.")
    ] = 1.0,
    block_tokens: Annotated[
        int, typer.Option("--block-tokens", min=1, help="Prefix-match granularity in tokens.")
    ] = 32,
    instance: Annotated[
        list[str] | None,
        typer.Option(
            "--instance",
            help="Only these instances (repeatable; default: all).",
            show_default=False,
        ),
    ] = None,
    deadline: Annotated[
        float,
        typer.Option("--deadline", min=0.1, max=3600, help="Seconds a migration plan may take."),
    ] = 30.0,
    wait_for_instances: Annotated[
        float,
        typer.Option(
            "--wait-for-instances", min=0, max=3600, help="Seconds to wait for a first instance."
        ),
    ] = 0.0,
    session_idle: Annotated[
        float,
        typer.Option(
            "--session-idle",
            min=0.001,
            max=30 * 86400,
            help="Seconds after which an idle session is forgotten (its next turn is placed anew).",
        ),
    ] = 600.0,
    state_dir: StateDirOpt = None,
    addr: AddrOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
    ready_file: Annotated[
        Path | None,
        typer.Option(
            "--ready-file", help="Write {addr, pid, policy} here once serving.", show_default=False
        ),
    ] = None,
) -> None:
    """Serve until SIGTERM/SIGINT: POST /generate (SGLang's body; the session is
    session_params.id, session_id, the X-Session-Id header or the rid), GET /health,
    GET /router/state."""
    import logging
    import os
    import signal
    import threading

    from tensorcast.cli.common import connect
    from tensorcast.config import parse_host_port
    from tensorcast.errors import Unavailable
    from tensorcast.router.policy import RebalanceParams
    from tensorcast.router.server import Router, RouterConfig, RouterHTTPServer

    config = RouterConfig(
        policy=policy,
        params=RebalanceParams(alpha, theta_abs, theta_rel, horizon, penalty),
        tick_s=tick,
        load_source=load_source,
        block_tokens=block_tokens,
        migration_deadline_ms=int(deadline * 1000),
        session_idle_s=session_idle,
        instances=tuple(instance or ()),
    )
    host, port = parse_host_port(listen)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    rt = connect(state_dir, addr, token)
    router = Router(rt, config).start(wait_for_instances_s=wait_for_instances)
    try:
        http = RouterHTTPServer(router, host, port).start()
    except OSError as e:
        router.close()
        raise Unavailable(f"cannot listen on {listen}: {e.strerror or e}") from None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    info = {"addr": http.addr, "pid": os.getpid(), "policy": policy}
    announce(ready_file, as_json, info)
    record = _record_path(state_dir)
    if record.parent.is_dir():  # `tc router state` and `tc top` find it there
        announce(record, False, info)
    logging.getLogger("tensorcast.router").info("router (%s) on %s", policy, http.addr)
    while not stop.wait(0.5):  # see worker/server.py: a plain wait() may miss SIGTERM
        pass
    http.close()
    router.close()
    rt.close()
    if _names(record, info):  # not another router's record, written since
        record.unlink()


def _names(record: Path, info: dict) -> bool:
    import json

    try:
        recorded = json.loads(record.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(recorded, dict) and (recorded.get("addr"), recorded.get("pid")) == (
        info["addr"],
        info["pid"],
    )


def _record_path(state_dir: Path | None) -> Path:
    from tensorcast.cli.common import state_dir_of

    return state_dir_of(state_dir) / "router.json"


def router_addr(router: str | None, state_dir: Path | None) -> str:
    """--router, else the router `tc router start` recorded in the state dir."""
    import json

    from tensorcast.config import parse_host_port
    from tensorcast.errors import NotFound

    if router:
        parse_host_port(router)
        return router
    record = _record_path(state_dir)
    if not record.exists():
        raise NotFound(f"no router recorded in {record}: pass --router HOST:PORT")
    return str(json.loads(record.read_text())["addr"])


@app.command("state")
def state(
    router: Annotated[
        str | None,
        typer.Option(
            "--router",
            help="HOST:PORT of a running router (default: the one recorded in the state dir).",
            show_default=False,
        ),
    ] = None,
    state_dir: StateDirOpt = None,
    addr: AddrOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Print a running router's view: per-instance load and sessions, recent migrations."""
    from tensorcast.engine.server import engine_request

    data = engine_request(router_addr(router, state_dir), "GET", "/router/state", timeout_s=10.0)
    emit(as_json, data, human(data))


def human(data: dict) -> str:
    rows = [
        [
            i["instance_id"],
            str(i["inflight"]),
            f"{i['reported_waiting']}+{i['reported_running']}",
            f"{i['ewma_load']:.2f}",
            str(i["sessions"]),
            str(i["routed"]),
        ]
        for i in data["instances"]
    ]
    lines = [
        f"router {data['router_id']} policy {data['policy']} ({data['load_source']} load), "
        f"{data['sessions']} sessions, {data['migrations_ok']} migrations ok, "
        f"{data['migrated_bytes']} bytes moved",
        table(rows, ["INSTANCE", "IN FLIGHT", "REPORTED", "EWMA", "SESSIONS", "ROUTED"])
        if rows
        else "no live instances",
    ]
    moves = [
        [
            m["req_id"],
            f"{m['source']} -> {m['target']}",
            m.get("status", "?"),
            str(m.get("bytes", 0)),
            f"{m.get('duration_s', 0):.3f}s",
        ]
        for m in data["migrations"][:10]
    ]
    if moves:
        lines.append(table(moves, ["SESSION", "MOVE", "STATUS", "BYTES", "TIME"]))
    return "\n".join(lines)
