"""Local etcd members (Debian's `etcd` binary) for `tc up --ha` and the tests: an etcd cluster
of N processes on this host, each with its own data dir, client and peer ports."""

from __future__ import annotations

import json
import secrets
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tensorcast.errors import Unavailable

START_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class EtcdMember:
    name: str
    client_addr: str  # HOST:PORT
    peer_addr: str
    data_dir: str

    @classmethod
    def from_json(cls, d: dict) -> EtcdMember:
        return cls(d["name"], d["client_addr"], d["peer_addr"], d["data_dir"])


def etcd_binary() -> str:
    path = shutil.which("etcd")
    if path is None:
        raise Unavailable(
            "the etcd binary is not installed: apt-get install etcd-server (Debian), or run "
            "etcd yourself and start the store with --backend etcd --etcd-endpoints"
        )
    return path


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def plan_members(count: int, host: str, data_root: Path) -> list[EtcdMember]:
    return [
        EtcdMember(
            f"etcd-{i + 1}",
            f"{host}:{free_port(host)}",
            f"{host}:{free_port(host)}",
            str(data_root / f"etcd-{i + 1}"),
        )
        for i in range(count)
    ]


def cluster_token() -> str:
    """A new cluster's token: every member of one cluster is started with the same."""
    return f"tensorcast-{secrets.token_hex(6)}"


def spawn(
    member: EtcdMember,
    members: list[EtcdMember],
    token: str,
    log: Path,
    cwd: Path,
    extra_args: Sequence[str] = (),
) -> subprocess.Popen:
    """Start one member (joins or forms the cluster of `members`; a data dir that exists
    already holds its identity, and the cluster flags are then ignored by etcd), with
    `extra_args` for etcd."""
    cluster = ",".join(f"{m.name}=http://{m.peer_addr}" for m in members)
    args = [
        etcd_binary(),
        "--name",
        member.name,
        "--data-dir",
        member.data_dir,
        "--listen-client-urls",
        f"http://{member.client_addr}",
        "--advertise-client-urls",
        f"http://{member.client_addr}",
        "--listen-peer-urls",
        f"http://{member.peer_addr}",
        "--initial-advertise-peer-urls",
        f"http://{member.peer_addr}",
        "--initial-cluster",
        cluster,
        "--initial-cluster-token",
        token,
        "--initial-cluster-state",
        "new",
        # A content's layout is one record: a model directory of 100,000+ tensors is ~25 MiB.
        "--max-request-bytes",
        str(32 << 20),
        *extra_args,
    ]
    with open(log, "ab") as out:
        return subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            start_new_session=True,
        )


def healthy(client_addr: str, timeout_s: float = 2.0) -> bool:
    """The member answers and the cluster has a leader (a quorum)."""
    try:
        with urllib.request.urlopen(f"http://{client_addr}/health", timeout=timeout_s) as r:
            return json.loads(r.read()).get("health") == "true"
    except (OSError, ValueError):
        return False


def wait_healthy(members: list[EtcdMember], procs: list[subprocess.Popen], log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace").splitlines()[-10:]
                raise Unavailable(f"etcd exited with code {proc.returncode}:\n" + "\n".join(tail))
        if all(healthy(m.client_addr) for m in members):
            return
        time.sleep(0.1)
    raise Unavailable(f"etcd did not become healthy within {START_TIMEOUT_S:.0f}s; see {log}")
