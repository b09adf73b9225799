"""Separate "hosts" on one machine: network namespaces joined by a bridge (veth pairs).

Needs root and iproute2; `unavailable_reason()` says why not, so tests skip with a clear message.
Addresses are this test network's own (10.77.0.0/24), torn down after use.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

BRIDGE = "tcbr0"
BRIDGE_IP = "10.77.0.1"
HOSTS = {"tc-a": "10.77.0.2", "tc-b": "10.77.0.3"}
# iproute2's tc, not ours: a venv's bin/tc (TensorCast's CLI) comes first on PATH.
IPROUTE_TC = next((p for p in ("/usr/sbin/tc", "/sbin/tc") if os.path.exists(p)), "")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or not IPROUTE_TC:
        return "iproute2 (ip, tc) is not installed"
    probe = _ip("netns", "add", "tc-probe", check=False)
    if probe.returncode != 0:
        return f"cannot create network namespaces: {probe.stderr.strip()}"
    _ip("netns", "del", "tc-probe", check=False)
    return None


def veth(ns: str) -> str:
    return f"v-{ns}"  # the bridge side; inside the namespace it is eth0


def teardown() -> None:
    for ns in HOSTS:
        _ip("link", "del", veth(ns), check=False)  # synchronously, unlike a namespace's deletion
        _ip("netns", "del", ns, check=False)
    _ip("link", "del", BRIDGE, check=False)


def setup() -> None:
    teardown()
    _ip("link", "add", BRIDGE, "type", "bridge")
    _ip("addr", "add", f"{BRIDGE_IP}/24", "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    for ns, address in HOSTS.items():
        _ip("netns", "add", ns)
        _ip("link", "add", veth(ns), "type", "veth", "peer", "name", "eth0", "netns", ns)
        _ip("link", "set", veth(ns), "master", BRIDGE, "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")


def set_link(ns: str, up: bool) -> None:
    _ip("link", "set", veth(ns), "up" if up else "down")


def limit_rate(ns: str, rate: str) -> None:
    """Shape what leaves `ns` (its eth0 egress) to `rate`, e.g. "200mbit"."""
    qdisc = f"{IPROUTE_TC} qdisc replace dev eth0 root tbf rate {rate} burst 256kb latency 200ms"
    proc = subprocess.run(
        ["ip", "netns", "exec", ns, *qdisc.split()], capture_output=True, text=True
    )
    assert proc.returncode == 0, f"{qdisc}: {proc.stdout} {proc.stderr}"


@dataclass
class NetnsCluster:
    state_dir: Path
    token: str
    store_addr: str = ""
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def _spawn(self, name: str, args: list[str], ns: str | None, timeout_s: float = 30) -> dict:
        """Start `tc ARGS` (in namespace `ns`, if any) as `name`; its ready file's JSON.

        The process joins `procs`, so `stop` kills it whether or not it came up."""
        ready = self.state_dir / f"{name}.ready"
        prefix = ["ip", "netns", "exec", ns] if ns else []
        log = open(self.state_dir / f"{name}.log", "ab")  # noqa: SIM115 (kept by the child)
        self.procs[name] = subprocess.Popen(
            [
                *prefix,
                sys.executable,
                "-m",
                "tensorcast.cli.main",
                *args,
                "--ready-file",
                str(ready),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TC_TOKEN": self.token},
        )
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if self.procs[name].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"{name} failed to start: "
                    f"{(self.state_dir / f'{name}.log').read_text()[-2000:]}"
                )
            time.sleep(0.05)
        return json.loads(ready.read_text())

    def start(self, mem: str) -> None:
        self.store_addr = self._spawn(
            "store",
            [
                "store",
                "start",
                "--db",
                str(self.state_dir / "store.db"),
                "--listen",
                f"{BRIDGE_IP}:0",
            ],
            None,
        )["addr"]
        for ns, address in HOSTS.items():
            self._spawn(
                ns,
                [
                    "worker",
                    "start",
                    "--store",
                    self.store_addr,
                    "--listen",
                    f"{address}:0",
                    "--mem",
                    mem,
                    "--name",
                    ns,
                ],
                ns,
            )

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait(10)

    def in_host(self, ns: str, code: str, timeout_s: float = 60) -> dict:
        """Run Python `code` as a caller on host `ns`; it prints one JSON line."""
        proc = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, "TC_TOKEN": self.token, "TC_ADDR": self.store_addr},
        )
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])


def netns_cluster(state_dir: Path, mem: str) -> Iterator[NetnsCluster]:
    setup()
    cluster = NetnsCluster(state_dir, token="netns-test-token")
    try:
        cluster.start(mem)
        yield cluster
    finally:
        cluster.stop()
        teardown()
