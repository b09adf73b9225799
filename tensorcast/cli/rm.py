"""Delete an artifact, or every lost one. Memory is freed once no other id shares the content and
no caller maps it."""

from __future__ import annotations

from typing import Annotated

import typer

from tensorcast.cli.common import AddrOpt, JsonOpt, StateDirOpt, TokenOpt, connect, emit

NAME = "rm"


def command(
    art_id: Annotated[
        str | None, typer.Argument(help="Artifact id (with --lost: only ids starting with it).")
    ] = None,
    lost: Annotated[
        bool,
        typer.Option(
            "--lost",
            help="Delete every artifact no live worker holds a copy of (shown as lost by tc ls).",
        ),
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="With --lost: list them, delete nothing.")
    ] = False,
    state_dir: StateDirOpt = None,
    addr: AddrOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:

    if not lost:
        if art_id is None or dry_run:  # a usage error (exit 2), like a missing argument
            raise typer.BadParameter("name an artifact to delete (or pass --lost [--dry-run])")
        with connect(state_dir, addr, token) as rt:
            rt.delete(art_id)
        emit(as_json, {"deleted": art_id}, f"deleted {art_id}")
        return
    with connect(state_dir, addr, token) as rt:
        ids = rt.delete_lost(art_id or "", dry_run=dry_run)
    verb = "would delete" if dry_run else "deleted"
    text = f"{verb} {len(ids)} lost artifact(s)" + "".join(f"\n  {i}" for i in ids)
    emit(as_json, {"deleted": [] if dry_run else ids, "lost": ids, "dry_run": dry_run}, text)
