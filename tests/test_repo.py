"""Repository hygiene that CI enforces: generated stubs current, `tc --help` light and complete."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_protobuf_stubs_are_current():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr


def test_help_imports_no_heavy_modules():
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "tensorcast.cli.main", "--help"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and "put" in proc.stdout
    imported = {line.split("|")[-1].strip().split(".")[0] for line in proc.stderr.splitlines()}
    assert not imported & {"torch", "grpc", "textual", "numpy"}, imported & {"torch", "grpc"}


def test_every_command_has_help():
    from typer.main import get_command

    from tensorcast.cli.main import app

    def walk(cmd, path):
        yield path, cmd
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from walk(sub, [*path, name])

    for path, cmd in walk(get_command(app), ["tc"]):
        assert (cmd.help or "").strip(), f"{' '.join(path)} has no help"
        for param in cmd.params:
            if param.name != "help" and getattr(param, "param_type_name", "") == "option":
                assert (param.help or "").strip(), f"{' '.join(path)} {param.name} has no help"


def test_help_shows_every_option_text_as_written():
    """Rich markup must not eat parts of help texts (`[default: x]` renders as nothing)."""
    from typer.main import get_command
    from typer.testing import CliRunner

    from tensorcast.cli.main import app

    def walk(cmd, path):
        yield path, cmd
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from walk(sub, [*path, name])

    runner = CliRunner()
    for path, cmd in walk(get_command(app), []):
        shown = " ".join(
            runner.invoke(app, [*path, "--help"], env={"COLUMNS": "400"}).stdout.split()
        )
        for param in cmd.params:
            if getattr(param, "param_type_name", "") == "option" and param.help:
                text = " ".join(param.help.split())
                assert text in shown, f"tc {' '.join(path)} {param.opts[0]}: {text!r} not shown"


def test_man_pages_are_current():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_man.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert (ROOT / "man" / "tc-put.1").read_text().count(".SH OPTIONS") == 1
