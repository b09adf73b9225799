"""Separate "hosts" on one machine: network namespaces joined by a bridge (veth pairs).

Needs root and iproute2; `unavailable_reason()` says why not, so tests skip with a clear message.
A `Network` has its own namespace names, bridge and subnet (10.<octet>.0.0/24), so several can
exist at once (a test and a benchmark, or two test runs); the module-level functions act on the
default one (tc-a, tc-b on 10.77.0.0/24). Everything is torn down after use.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# iproute2's tc, not ours: a venv's bin/tc (TensorCast's CLI) comes first on PATH.
IPROUTE_TC = next((p for p in ("/usr/sbin/tc", "/sbin/tc") if os.path.exists(p)), "")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or not IPROUTE_TC:
        return "iproute2 (ip, tc) is not installed"
    probe_name = f"tc-probe-{os.getpid()}"
    probe = _ip("netns", "add", probe_name, check=False)
    if probe.returncode != 0:
        return f"cannot create network namespaces: {probe.stderr.strip()}"
    _ip("netns", "del", probe_name, check=False)
    return None


class Network:
    """Namespaces `names` on bridge `bridge`, host i at 10.<octet>.0.<i + 2>, the bridge at .1."""

    def __init__(self, names: Sequence[str], bridge: str, octet: int) -> None:
        assert all(len(f"v-{n}") <= 15 for n in names), "interface names are 15 bytes at most"
        self.bridge = bridge
        self.bridge_ip = f"10.{octet}.0.1"
        self.hosts = {n: f"10.{octet}.0.{i + 2}" for i, n in enumerate(names)}

    @staticmethod
    def unique(count: int = 2) -> Network:
        """A network of `count` hosts whose names and subnet no other process uses (by pid)."""
        tag = os.getpid() % 100_000
        names = [f"tn{tag}-{chr(ord('a') + i)}" for i in range(count)]
        return Network(names, f"tnbr{tag}", 100 + tag % 150)

    def veth(self, ns: str) -> str:
        return f"v-{ns}"  # the bridge side; inside the namespace it is eth0

    def teardown(self) -> None:
        for ns in self.hosts:
            _ip("link", "del", self.veth(ns), check=False)  # at once, unlike a namespace's
            _ip("netns", "del", ns, check=False)
        _ip("link", "del", self.bridge, check=False)

    def setup(self) -> None:
        self.teardown()
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for ns, address in self.hosts.items():
            _ip("netns", "add", ns)
            _ip("link", "add", self.veth(ns), "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", self.veth(ns), "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def set_link(self, ns: str, up: bool) -> None:
        _ip("link", "set", self.veth(ns), "up" if up else "down")

    def limit_rate(self, ns: str, rate: str, queue_ms: float = 200) -> None:
        """Shape what leaves `ns` (its eth0 egress) to `rate`, e.g. "200mbit", queueing at most
        `queue_ms` of data (a NIC's queue is short: what leaves a host that sends data delays
        the ACKs of what it receives by that much)."""
        qdisc = (
            f"{IPROUTE_TC} qdisc replace dev eth0 root tbf rate {rate} burst 256kb "
            f"latency {queue_ms}ms"
        )
        proc = subprocess.run(
            ["ip", "netns", "exec", ns, *qdisc.split()], capture_output=True, text=True
        )
        assert proc.returncode == 0, f"{qdisc}: {proc.stdout} {proc.stderr}"


DEFAULT = Network(("tc-a", "tc-b"), "tcbr0", 77)
BRIDGE = DEFAULT.bridge
BRIDGE_IP = DEFAULT.bridge_ip
HOSTS = DEFAULT.hosts


def veth(ns: str) -> str:
    return DEFAULT.veth(ns)


def teardown() -> None:
    DEFAULT.teardown()


def setup() -> None:
    DEFAULT.setup()


def set_link(ns: str, up: bool) -> None:
    DEFAULT.set_link(ns, up)


def limit_rate(ns: str, rate: str) -> None:
    DEFAULT.limit_rate(ns, rate)


@dataclass
class NetnsCluster:
    state_dir: Path
    token: str
    store_addr: str = ""
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    network: Network = DEFAULT

    def _spawn(
        self,
        name: str,
        args: list[str],
        ns: str | None,
        timeout_s: float = 30,
        env: dict[str, str] | None = None,
    ) -> dict:
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
            env={**os.environ, "TC_TOKEN": self.token, **(env or {})},
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

    def start(
        self, mem: str, workers: Sequence[str] | None = None, args: Sequence[str] = ()
    ) -> None:
        """A store on the bridge and a worker (named after its host) on each of `workers`
        (default: every host), with extra worker `args`."""
        self.store_addr = self._spawn(
            "store",
            [
                "store",
                "start",
                "--db",
                str(self.state_dir / "store.db"),
                "--listen",
                f"{self.network.bridge_ip}:0",
            ],
            None,
        )["addr"]
        for ns in self.network.hosts if workers is None else workers:
            self.start_worker(ns, mem, args)

    def start_worker(self, ns: str, mem: str, args: Sequence[str] = ()) -> dict:
        return self._spawn(
            ns,
            [
                "worker",
                "start",
                "--store",
                self.store_addr,
                "--listen",
                f"{self.network.hosts[ns]}:0",
                "--mem",
                mem,
                "--name",
                ns,
                *args,
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


def netns_cluster(
    state_dir: Path,
    mem: str,
    network: Network = DEFAULT,
    workers: Sequence[str] | None = None,
) -> Iterator[NetnsCluster]:
    network.setup()
    cluster = NetnsCluster(state_dir, token="netns-test-token", network=network)
    try:
        cluster.start(mem, workers)
        yield cluster
    finally:
        cluster.stop()
        network.teardown()
