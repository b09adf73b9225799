"""Every command's --json output parses and has the shape docs/json-shapes.json documents; the
autoscaling script built on them works step by step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from conftest import Cluster, wait_until
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
SHAPES = json.loads((ROOT / "docs" / "json-shapes.json").read_text())


def _has(data, path: str) -> bool:
    head, _, rest = path.partition(".")
    if head.endswith("[]"):
        items = data.get(head[:-2]) if isinstance(data, dict) else None
        if not isinstance(items, list) or not items:
            return False
        return all(_has(item, rest) for item in items) if rest else True
    if not isinstance(data, dict) or head not in data:
        return False
    return _has(data[head], rest) if rest else True


def _check(command: str, stdout: str) -> dict:
    data = json.loads(stdout)
    missing = [p for p in SHAPES[command] if not _has(data, p)]
    assert not missing, f"tc {command} --json lacks {missing}: {data}"
    return data


def test_every_command_json_matches_its_documented_shape(tmp_path):
    c = Cluster(tmp_path / "state", None)  # type: ignore[arg-type]
    _check("up", c.tc("up", "--workers", "2", "--mem", "32MiB", "--json", check=True).stdout)
    try:
        save_file({"w": torch.ones(8)}, tmp_path / "m.safetensors")
        put = c.tc(
            "put",
            "shape",
            str(tmp_path / "m.safetensors"),
            "--on",
            "worker-1",
            "--json",
            check=True,
        )
        _check("put", put.stdout)
        _check("status", c.tc("status", "--json", check=True).stdout)
        _check(
            "prefetch", c.tc("prefetch", "shape", "--to", "worker-2", "--json", check=True).stdout
        )
        chain = c.tc("prefetch", "shape", "--to", "worker-1", "--to", "worker-2", "--json")
        rows = _check("prefetch (chain)", chain.stdout)["chain"]
        assert [r["worker"] for r in rows] == ["worker-1", "worker-2"]
        assert all(set(SHAPES["prefetch"]) <= set(r) for r in rows)  # each hop as one prefetch
        _check("pin", c.tc("pin", "shape", "--on", "worker-2", "--json", check=True).stdout)
        _check("ls", c.tc("ls", "--json", check=True).stdout)
        _check("workers", c.tc("workers", "--interval", "0", "--json", check=True).stdout)
        _check("shards", c.tc("shards", "--json", check=True).stdout)
        _check("show", c.tc("show", "shape", "--json", check=True).stdout)
        _check("unpin", c.tc("unpin", "shape", "--on", "worker-2", "--json", check=True).stdout)
        out = tmp_path / "out.safetensors"
        _check("get", c.tc("get", "shape", "-o", str(out), "--json", check=True).stdout)
        _check("rm", c.tc("rm", "shape", "--json", check=True).stdout)
        _check("rm --lost", c.tc("rm", "--lost", "--dry-run", "--json", check=True).stdout)
        weights = ("--model", "shape-model", "--json")
        _check(
            "weights publish",
            c.tc(
                "weights",
                "publish",
                str(tmp_path / "m.safetensors"),
                "--version",
                "v1",
                *weights,
                check=True,
            ).stdout,
        )
        _check("weights ls", c.tc("weights", "ls", *weights, check=True).stdout)
        _check(
            "weights sync", c.tc("weights", "sync", "--to", "worker-2", *weights, check=True).stdout
        )
        _check("worker stop", c.tc("worker", "stop", "worker-2", "--json", check=True).stdout)
    finally:
        _check("down", c.tc("down", "--json", check=True).stdout)
    assert set(SHAPES) - {"_comment"} == {
        "up",
        "status",
        "put",
        "get",
        "ls",
        "show",
        "rm",
        "rm --lost",
        "prefetch",
        "prefetch (chain)",
        "pin",
        "unpin",
        "worker stop",
        "down",
        "weights publish",
        "weights ls",
        "weights sync",
        "workers",
        "shards",
        # checked in test_plans.py, where instances run
        "publish",
        "hydrate",
        "migrate",
        "instances",
        "plans",
        # checked in test_router_cli.py
        "rebalance",
        "router state",
    }


def _script(env: dict, *args: str) -> list[dict]:
    proc = subprocess.run(
        [str(ROOT / "scripts" / "autoscale.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_autoscale_script_scales_out_and_in(fresh_cluster):
    c = fresh_cluster
    env = {
        **os.environ,
        "TC_STATE_DIR": str(c.state_dir),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    with c.connect() as rt:
        rt.put({"w": torch.ones(2 << 20)}, "model@v1")
    steps = _script(env, "out", "model@v1", "--mem", "64MiB")
    assert [s["step"] for s in steps] == ["started", "prefetched", "pinned", "ready"]
    new = steps[0]["worker"]
    assert steps[1]["bytes_moved"] == 8 << 20
    with c.connect() as rt:
        names = {w.worker_id: w.name for w in rt.workers()}
        replicas = {names[r.worker_id]: r.pinned for r in rt.info("model@v1").replicas}
        assert replicas == {"worker-1": False, new: True}
        rt.put({"x": torch.ones(16)}, "only-on-new", worker=new)
    steps = _script(env, "in", new, "model@v1")
    assert [s["step"] for s in steps] == ["unpinned", "drained", "stopped"]
    assert steps[1] == {"step": "drained", "moved": 1, "to": "worker-1"}
    with c.connect() as rt:
        wait_until(lambda: not any(w.name == new and w.alive for w in rt.workers()), 30)
        assert torch.equal(rt.artifact("only-on-new").tensor_dict()["x"], torch.ones(16))
        assert torch.equal(rt.artifact("model@v1").tensor_dict()["w"], torch.ones(2 << 20))
