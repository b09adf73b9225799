#!/usr/bin/env python3
"""Generate man/tc.1 and one page per subcommand from the CLI itself; `--check` fails when stale."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from typer.main import get_command

from tensorcast.cli.main import app

ROOT = Path(__file__).resolve().parent.parent
MAN_DIR = ROOT / "man"
EXIT_CODES = [
    ("0", "success"),
    ("1", "internal error"),
    ("2", "usage error"),
    ("3", "invalid argument (bad input file, size, id)"),
    ("4", "not found"),
    ("5", "already exists (artifact ids are immutable)"),
    ("6", "resource exhausted (pool full)"),
    ("7", "unavailable (store or worker unreachable, no live replica)"),
    ("8", "deadline exceeded"),
    ("9", "integrity error (checksum mismatch)"),
    ("10", "fencing error (stale token)"),
    ("11", "unauthenticated (missing or wrong cluster token)"),
]


def esc(text: str) -> str:
    text = " ".join(text.split())
    text = text.replace("\\", "\\\\").replace("-", "\\-")
    return "\\&" + text if text.startswith((".", "'")) else text


def walk(cmd, path: list[str]):
    yield path, cmd
    if hasattr(cmd, "commands"):
        for name in sorted(cmd.commands):
            yield from walk(cmd.commands[name], [*path, name])


def page(path: list[str], cmd) -> str:
    name = "-".join(path)
    title = " ".join(path)
    ctx = cmd.context_class(cmd, info_name=title)
    lines = [
        f'.TH {name.upper()} 1 "" "tensorcast" "TensorCast manual"',
        ".SH NAME",
        f"{esc(name)} \\- {esc((cmd.help or '').strip().splitlines()[0])}",
        ".SH SYNOPSIS",
        f".B {esc(title)}",
        esc(" ".join(cmd.collect_usage_pieces(ctx))),
        ".SH DESCRIPTION",
    ]
    for para in (cmd.help or "").strip().split("\n\n"):
        lines += [esc(para), ".PP"]
    if hasattr(cmd, "commands"):
        lines.append(".SH COMMANDS")
        for sub in sorted(cmd.commands):
            lines += [".TP", f".B {esc(sub)}", esc(cmd.commands[sub].get_short_help_str(200))]
    args = [p for p in cmd.params if p.param_type_name == "argument"]
    opts = [p for p in cmd.params if p.param_type_name == "option" and not p.hidden]
    if args:
        lines.append(".SH ARGUMENTS")
        for p in args:
            lines += [".TP", f".I {esc((p.name or '').upper())}", esc(getattr(p, "help", "") or "")]
    if opts:
        lines.append(".SH OPTIONS")
        for p in opts:
            record = p.get_help_record(ctx)
            if record:
                lines += [".TP", f".B {esc(record[0])}", esc(record[1])]
    lines.append(".SH EXIT STATUS")
    for code, meaning in EXIT_CODES:
        lines += [".TP", f".B {code}", esc(meaning)]
    lines += [
        ".SH ENVIRONMENT",
        ".TP",
        ".B TC_STATE_DIR",
        "local cluster state dir",
        ".TP",
        ".B TC_ADDR",
        "Global Store address",
        ".TP",
        ".B TC_TOKEN",
        "cluster token",
    ]
    if path != ["tc"]:
        lines += [".SH SEE ALSO", ".BR tc (1)"]
    return "\n".join(lines) + "\n"


def pages() -> dict[str, str]:
    return {"-".join(p) + ".1": page(p, c) for p, c in walk(get_command(app), ["tc"])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    check = parser.parse_args().check
    wanted = pages()
    existing = {p.name for p in MAN_DIR.glob("*.1")}
    stale = sorted(
        n
        for n, text in wanted.items()
        if not (MAN_DIR / n).exists() or (MAN_DIR / n).read_text() != text
    ) + sorted(existing - set(wanted))
    if check:
        if stale:
            print(f"stale man pages: {stale}; run scripts/gen_man.py", file=sys.stderr)
            return 1
        return 0
    MAN_DIR.mkdir(exist_ok=True)
    for n in existing - set(wanted):
        (MAN_DIR / n).unlink()
    for n, text in wanted.items():
        (MAN_DIR / n).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
