"""The state dir's record of a local cluster: where `tc` and `tc.connect()` find it."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
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
    frame_port: int = 0  # a store's frame port (0: none, or not recorded)
    # When the process started (psutil's create_time; 0: not recorded): a pid recycled by
    # another process after a reboot is not this one.
    started_at: float = 0.0


@dataclass
class ClusterRecord:
    store_addr: str
    started_at: float
    processes: list[ProcessRecord] = field(default_factory=list)

    def store_frame_ports(self) -> dict[str, int]:
        """Store address -> frame port, for the stores that recorded one."""
        return {p.addr: p.frame_port for p in self.processes if p.role == "store" and p.frame_port}

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
            processes=[_process(p) for p in data.get("processes", [])],
        )


def _process(data: dict) -> ProcessRecord:
    """Fields this version does not know are left out: a record written by a newer `tc`
    (a cluster it started) stays readable."""
    known = {f.name for f in fields(ProcessRecord)}
    return ProcessRecord(**{k: v for k, v in data.items() if k in known})


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
