"""The `tc` (alias `tensorcast`) command. Imports nothing heavy: `tc --help` answers at once."""

from __future__ import annotations

import sys

import typer

from tensorcast.cli import (
    down,
    get,
    hydrate,
    instance,
    instances,
    ls,
    migrate,
    pin,
    plans,
    prefetch,
    publish,
    put,
    rebalance,
    rm,
    router,
    shards,
    show,
    status,
    store,
    top,
    unpin,
    up,
    weights,
    worker,
    workers,
)
from tensorcast.errors import TensorcastError

app = typer.Typer(
    name="tc",
    help="TensorCast: tensor lifecycle as a service. Start a local cluster with `tc up`.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)
for module in (
    up,
    down,
    status,
    top,
    put,
    get,
    ls,
    show,
    rm,
    prefetch,
    pin,
    unpin,
    publish,
    hydrate,
    migrate,
    rebalance,
    workers,
    instances,
    plans,
    shards,
):
    app.command(name=module.NAME, help=module.__doc__)(module.command)
app.add_typer(store.app, name="store")
app.add_typer(worker.app, name="worker")
app.add_typer(weights.app, name="weights")
app.add_typer(instance.app, name="instance")
app.add_typer(router.app, name="router")


def run() -> None:
    try:
        app()
    except TensorcastError as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(e.exit_code)
    except OSError as e:  # a path or port of the command line: the system's word for it
        sys.stderr.write(f"error: {e}\n")
        sys.exit(1)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)


if __name__ == "__main__":
    run()
