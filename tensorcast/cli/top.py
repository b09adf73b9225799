"""Live view of the cluster: workers, artifacts, engine instances, KV shards and recent plans
(keys: 1-5 views, s sort, / filter, Enter detail, p/u/f pin/unpin/prefetch with confirmation,
q quit)."""

from __future__ import annotations

from typing import Annotated

import typer

from tensorcast.cli.common import AddrOpt, StateDirOpt, TokenOpt, connect

NAME = "top"


def command(
    interval: Annotated[
        float, typer.Option("--interval", min=0.2, help="Refresh period in seconds.")
    ] = 1.0,
    state_dir: StateDirOpt = None,
    addr: AddrOpt = None,
    token: TokenOpt = None,
) -> None:
    from tensorcast.tui.top import SdkSource, TopApp

    TopApp(SdkSource(lambda: connect(state_dir, addr, token)), interval_s=interval).run()
