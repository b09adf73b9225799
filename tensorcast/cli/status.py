"""Show each component of the cluster: healthy, dead or unreachable, with heartbeat age.

Exits 7 (unavailable) when the Global Store cannot be reached or any component is not healthy.
"""

from __future__ import annotations

from tensorcast.cli.common import AddrOpt, JsonOpt, StateDirOpt, TokenOpt, connect, emit, table

NAME = "status"


def command(
    state_dir: StateDirOpt = None,
    addr: AddrOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    import typer

    from tensorcast.errors import Unavailable
    from tensorcast.sdk.health import cluster_health

    try:
        rt = connect(state_dir, addr, token)
    except Unavailable as e:
        emit(
            as_json,
            {"healthy": False, "components": [], "error": str(e)},
            f"store: unreachable ({e})",
        )
        raise typer.Exit(Unavailable.exit_code) from None
    with rt:
        components = cluster_health(rt)
    healthy = all(c.state == "healthy" for c in components)
    rows = [
        [
            c.role,
            c.name,
            c.addr,
            c.state,
            "-" if c.heartbeat_age_s is None else f"{c.heartbeat_age_s:.1f}s",
            c.detail,
        ]
        for c in components
    ]
    emit(
        as_json,
        {"healthy": healthy, "components": [c.to_json() for c in components]},
        table(rows, ["ROLE", "NAME", "ADDR", "STATE", "HEARTBEAT", "DETAIL"]),
    )
    if not healthy:
        raise typer.Exit(Unavailable.exit_code)
