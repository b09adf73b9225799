"""Cross-host behaviour for real: workers in separate network namespaces joined by veth pairs."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from conftest import wait_until
from kv_engine import PROMPT, generate, save_llama
from netns import HOSTS, limit_rate, netns_cluster, set_link, unavailable_reason

import tensorcast as tc
from tensorcast.sdk.migrate import migrate

pytestmark = pytest.mark.root
_reason = unavailable_reason()
if _reason:
    pytest.skip(f"cross-host tests skipped: {_reason}", allow_module_level=True)

MiB = 1024 * 1024


@pytest.fixture
def hosts(tmp_path):
    yield from netns_cluster(tmp_path, mem="160MiB")


def _replica_names(rt, art_id):
    names = {w.worker_id: w.name for w in rt.workers()}
    return {names[r.worker_id] for r in rt.info(art_id).replicas}


def test_prefetch_across_hosts_and_transparent_fetch(hosts):
    with tc.connect(hosts.store_addr, hosts.token) as rt:
        data = torch.randn(24 * MiB // 4)
        rt.put({"w": data}, "xhost", worker="tc-a")  # from a host without workers: gRPC stream
        assert _replica_names(rt, "xhost") == {"tc-a"}
        # A caller on host b: its worker has no replica, fetches one from a, then maps it.
        out = hosts.in_host(
            "tc-b",
            """
import json, torch, tensorcast as tc
rt = tc.connect()
t = rt.artifact("xhost").tensor_dict()["w"]
maps = open("/proc/self/maps").read()
addr = t.data_ptr()
inside = any(int(l.split()[0].split("-")[0], 16) <= addr < int(l.split()[0].split("-")[1], 16)
             and "memfd:tensorcast-pool" in l for l in maps.splitlines())
print(json.dumps({"sum": float(t.double().sum()), "zero_copy": inside}))
""",
        )
        assert out["zero_copy"]
        assert out["sum"] == pytest.approx(float(data.double().sum()))
        assert _replica_names(rt, "xhost") == {"tc-a", "tc-b"}
        # And a caller with no worker on its host pulls straight into its own memory.
        assert torch.equal(rt.artifact("xhost").tensor_dict()["w"], data)


def _prefetch_while(art, timeout_s: float, fault_after_s: float, fault, join_s: float):
    """Prefetch to tc-b over a shaped tc-a link, `fault` mid-way; returns (error, elapsed)."""
    errors: list[Exception] = []

    def pull():
        try:
            art.prefetch("tc-b", timeout_s=timeout_s)
        except tc.TensorcastError as e:
            errors.append(e)

    limit_rate("tc-a", "200mbit")  # ~4 s for 96 MiB: time to break things mid-way
    thread = threading.Thread(target=pull)
    started = time.monotonic()
    thread.start()
    time.sleep(fault_after_s)
    fault()
    thread.join(join_s)
    elapsed = time.monotonic() - started
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], (tc.Unavailable, tc.DeadlineExceeded))
    return errors[0], elapsed


def test_source_killed_mid_transfer_leaves_no_partial_replica(hosts):
    with tc.connect(hosts.store_addr, hosts.token) as rt:
        art = rt.put({"w": torch.randn(96 * MiB // 4)}, "victim", worker="tc-a")
        _, elapsed = _prefetch_while(
            art, 20, 1.0, lambda: os.kill(hosts.procs["tc-a"].pid, signal.SIGKILL), 30
        )
        assert elapsed < 20
        b = next(w for w in rt.workers() if w.name == "tc-b")
        from tensorcast.proto import tensorcast_pb2 as pb

        status = rt.worker_stub(b).call("Status", pb.Empty())
        assert status.num_contents == 0 and status.worker.mem_used_bytes == 0
        wait_until(lambda: _replica_names(rt, "victim") == set(), 30)


def test_link_cut_respects_the_deadline(hosts):
    with tc.connect(hosts.store_addr, hosts.token) as rt:
        art = rt.put({"w": torch.randn(96 * MiB // 4)}, "cut", worker="tc-a")
        try:
            _, elapsed = _prefetch_while(art, 3.0, 0.5, lambda: set_link("tc-a", up=False), 15)
        finally:
            set_link("tc-a", up=True)
        assert elapsed < 3.0 + 4.0, elapsed  # the 3 s deadline, plus slack for a loaded machine
        # tc-a missed heartbeats while cut off (dead, replicas dropped); once back it
        # re-reports its inventory. tc-b never lists a partial replica.
        wait_until(lambda: _replica_names(rt, "cut") == {"tc-a"}, 30)


def _start_instance(hosts, iid: str, ns: str, model_id: str) -> str:
    """`tc instance start` on host `ns`, attached to its worker; the endpoint, on `ns`'s address.

    Spawned through the cluster, so its teardown kills the instance even if the test fails."""
    args = ["instance", "start", "--worker", ns, "--model", model_id, "--id", iid]
    args += ["--listen", f"{HOSTS[ns]}:0", "--page-tokens", "8", "--addr", hosts.store_addr]
    return hosts._spawn(iid, args, ns, timeout_s=120)["endpoint"]  # torch + transformers: slow


def test_migrate_mid_generation_across_hosts_continues_token_identically(hosts, tmp_path):
    save_llama(tmp_path / "llama")
    with tc.connect(hosts.store_addr, hosts.token) as rt:
        rt.put_files("kv-llama@v1", tmp_path / "llama", worker="tc-a")
        a = _start_instance(hosts, "inst-a", "tc-a", "kv-llama@v1")
        b = _start_instance(hosts, "inst-b", "tc-b", "kv-llama@v1")  # pulls the model from tc-a
        assert a.startswith(f"{HOSTS['tc-a']}:") and b.startswith(f"{HOSTS['tc-b']}:")
        wait_until(
            lambda: {i.instance_id for i in rt.instances() if i.alive} >= {"inst-a", "inst-b"}, 30
        )
        assert {i.instance_id: i.worker_name for i in rt.instances()} == {
            "inst-a": "tc-a",
            "inst-b": "tc-b",
        }
        reference = generate(a, "ref", PROMPT, 24)
        assert len(set(reference)) > 4  # a degenerate sequence would prove little
        first = generate(a, "req-1", PROMPT, 10)
        result = migrate(rt, "req-1", "inst-a", "inst-b", parts=1)
        assert [s["op"] for s in result["steps"]] == [
            "publish",
            "prefetch_many",
            "hydrate",
            "evict",
        ]
        assert [s["worker"] for s in result["steps"]] == ["tc-a", "tc-b", "tc-b", "tc-a"]
        assert result["steps"][1]["bytes"] > 0  # pages crossed the bridge before hydrate
        rest = generate(b, "req-1", None, 14)
        assert first + rest == reference
        with pytest.raises(tc.NotFound):  # evicted from the source
            generate(a, "req-1", None, 1)
