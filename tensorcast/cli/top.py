"""Live view of the cluster: workers, artifacts, engine instances, KV shards and recent plans,
and with --router a router's loads, sessions and migrations (keys: 1-7 views, s sort,
/ filter, Enter detail, p/u/f pin/unpin/prefetch with confirmation, q quit)."""

from __future__ import annotations

from typing import Annotated

import typer

from tensorcast.cli.common import AddrOpt, StateDirOpt, TokenOpt, connect

NAME = "top"


def command(
    router: Annotated[
        str | None,
        typer.Option(
            "--router",
            help="HOST:PORT of a running tc router: adds its view (loads, sessions, migrations); "
            "default: the router recorded in the state dir, if any.",
            show_default=False,
        ),
    ] = None,
    interval: Annotated[
        float, typer.Option("--interval", min=0.2, help="Refresh period in seconds.")
    ] = 1.0,
    state_dir: StateDirOpt = None,
    addr: AddrOpt = None,
    token: TokenOpt = None,
) -> None:
    from tensorcast.cli.router import router_addr
    from tensorcast.errors import NotFound
    from tensorcast.tui.top import SdkSource, TopApp

    try:
        router = router_addr(router, state_dir)
    except NotFound:
        router = None

    TopApp(
        SdkSource(lambda: connect(state_dir, addr, token), router),
        interval_s=interval,
        show_router=router is not None,
    ).run()
