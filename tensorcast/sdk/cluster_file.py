"""The state dir's record of a local cluster: where `tc` and `tc.connect()` find it."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

CLUSTER_FILE = "cluster.json"
TOKEN_FILE = "token"


@dataclass
class ProcessRecord:
    role: str  # "store" | "worker"
    name: str
    pid: int
    addr: str
    log: str
    metrics_addr: str = ""


@dataclass
class ClusterRecord:
    store_addr: str
    started_at: float
    processes: list[ProcessRecord] = field(default_factory=list)

    def save(self, state_dir: Path) -> None:
        path = state_dir / CLUSTER_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, path)

    @classmethod
    def load(cls, state_dir: Path) -> ClusterRecord | None:
        try:
            data = json.loads((state_dir / CLUSTER_FILE).read_text())
        except (OSError, ValueError):
            return None
        return cls(
            store_addr=data["store_addr"],
            started_at=data["started_at"],
            processes=[ProcessRecord(**p) for p in data.get("processes", [])],
        )


def read_token(state_dir: Path) -> str | None:
    try:
        return (state_dir / TOKEN_FILE).read_text().strip() or None
    except OSError:
        return None


def write_token(state_dir: Path, token: str) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
