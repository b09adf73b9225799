"""Cluster lifecycle and failures with real processes: zero-copy, liveness, restarts, auth."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import Cluster, pool_used, wait_until

import tensorcast as tc


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(field)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


def _mapping_of(address: int) -> str:
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        start, end = (int(x, 16) for x in parts[0].split("-"))
        if start <= address < end:
            return parts[5] if len(parts) > 5 else ""
    return ""


def test_tensor_dict_is_zero_copy(rt):
    size = 256 * 1024 * 1024 // 4 // 2  # 128 MiB of float32
    rt.put({"w": torch.ones(size), "v": torch.arange(1000, dtype=torch.float32)}, "zero-copy")
    gc.collect()
    anon_before = _status_kib("RssAnon")
    tensors = rt.artifact("zero-copy").tensor_dict()
    # Every tensor lives inside the worker's shared-memory pool mapping...
    for t in tensors.values():
        assert "memfd:tensorcast-pool" in _mapping_of(t.data_ptr())
    # ...and reading every byte does not grow this process's private memory.
    assert float(tensors["w"].sum()) == size
    assert float(tensors["v"].sum()) == sum(range(1000))
    grown = _status_kib("RssAnon") - anon_before
    assert grown < size * 4 // 10, f"RssAnon grew by {grown} bytes"
    # Writing to a tensor changes only this caller's copy, never the pool.
    tensors["v"][0] = 12345.0
    assert float(rt.artifact("zero-copy").tensor_dict()["v"][0]) == 0.0


def test_up_twice_status_and_down(tmp_path):
    from conftest import Cluster

    state = tmp_path / "state"
    c = Cluster(state, None)  # type: ignore[arg-type]
    try:
        first = json.loads(
            c.tc("up", "--workers", "2", "--mem", "32MiB", "--json", check=True).stdout
        )
        assert not first["already_running"]
        pids = {p["pid"] for p in first["processes"]}
        assert len(pids) == 3
        second = json.loads(c.tc("up", "--json", check=True).stdout)
        assert second["already_running"] and {p["pid"] for p in second["processes"]} == pids
        # What running workers cannot follow is refused, nothing saved: --mem is every
        # worker's pool (the next restart of all took it), --workers below the running ones
        # dropped them from the record.
        for args, says in (
            (["--mem", "64MiB"], "run with 32MiB pools"),
            (["--workers", "1"], "worker-2 run(s) beyond --workers 1"),
        ):
            refused = c.tc("up", *args)
            assert refused.returncode == tc.InvalidArgument.exit_code and says in refused.stderr
        assert json.loads((state / "layout.json").read_text())["mem"] == "32MiB"
        status = json.loads(c.tc("status", "--json", check=True).stdout)
        assert status["healthy"]
        states = {x["name"]: x["state"] for x in status["components"]}
        assert states == {"store": "healthy", "worker-1": "healthy", "worker-2": "healthy"}
        assert (state / "logs" / "store.log").exists() and (
            state / "token"
        ).stat().st_mode & 0o777 == 0o600
    finally:
        down = json.loads(c.tc("down", "--json", check=True).stdout)
    assert len(down["stopped"]) == 3
    for pid in pids:
        wait_until(
            lambda pid=pid: _gone(pid),
            30,
        )
    proc = c.tc("status")
    assert proc.returncode == tc.Unavailable.exit_code and "tc up" in proc.stdout


def test_worker_options_of_a_failed_up_are_not_what_the_next_up_repeats(tmp_path):
    """`tc up --disk FILE` fails (a worker cannot make its disk tier under a file); a plain
    `tc up` then brings the cluster back as it last worked, instead of failing the same way."""
    from conftest import Cluster

    state = tmp_path / "state"
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    c = Cluster(state, None)  # type: ignore[arg-type]
    try:
        c.tc("up", "--workers", "1", "--mem", "32MiB", check=True)
        c.tc("down", check=True)
        failed = c.tc("up", "--workers", "2", "--disk", str(not_a_dir))
        assert failed.returncode != 0 and "Not a directory" in failed.stdout + failed.stderr
        layout = json.loads((state / "layout.json").read_text())
        assert (layout["workers"], layout["mem"], layout["disk"]) == (1, "32MiB", "")
        again = json.loads(c.tc("up", "--json", check=True).stdout)
        assert sorted(again["started"]) == ["store", "worker-1"]
        c.tc("down", check=True)
        bigger = json.loads(c.tc("up", "--workers", "2", "--json", check=True).stdout)
        assert sorted(bigger["started"]) == ["store", "worker-1", "worker-2"]
        assert json.loads((state / "layout.json").read_text())["workers"] == 2
    finally:
        c.tc("down")


def test_up_in_a_state_dir_never_takes_the_default_state_dirs_tls(tmp_path):
    """Processes of `tc up --state-dir B` resolved their state dir (TLS files, token) as the
    default one: a TLS cluster's certificates there made B's plaintext cluster unusable."""
    from conftest import Cluster

    from tensorcast.sdk.tls_certs import local_cluster_tls

    local_cluster_tls(tmp_path / "default")  # the default state dir holds a TLS cluster's
    c = Cluster(tmp_path / "b", None)  # type: ignore[arg-type]
    env = {"TC_STATE_DIR": str(tmp_path / "default")}
    try:
        c.tc("up", "--workers", "1", "--mem", "32MiB", check=True, env=env)
        c.tc("put", "plain", str(_tiny_file(tmp_path)), check=True, env=env)
        assert "plain" in c.tc("ls", check=True, env=env).stdout
    finally:
        c.tc("down", env=env)


def _tiny_file(tmp_path: Path) -> Path:
    from safetensors.torch import save_file

    save_file({"w": torch.ones(4)}, str(tmp_path / "tiny.safetensors"))
    return tmp_path / "tiny.safetensors"


def test_down_never_signals_a_recycled_pid(tmp_path):
    """A state dir whose record names a pid now used by another cluster's worker (a reboot
    recycled it): `tc down` there leaves that worker alone."""
    from conftest import Cluster

    from tensorcast.sdk import local_cluster

    a = Cluster(tmp_path / "a", None)  # type: ignore[arg-type]
    up = json.loads(a.tc("up", "--workers", "1", "--mem", "32MiB", "--json", check=True).stdout)
    try:
        record = json.loads((tmp_path / "a" / "cluster.json").read_text())
        worker = next(p for p in record["processes"] if p["name"] == "worker-1")
        assert worker["started_at"] > 0
        stale = dict(record, processes=[dict(worker, started_at=worker["started_at"] - 3600)])
        (tmp_path / "b").mkdir()
        (tmp_path / "b" / "cluster.json").write_text(json.dumps(stale))
        stopped, killed = local_cluster.down(tmp_path / "b", timeout_s=5)
        assert stopped == [] and killed == []
        assert not _gone(worker["pid"])
        assert json.loads(a.tc("status", "--json", check=True).stdout)["healthy"]
    finally:
        a.tc("down")
    assert {p["name"] for p in up["processes"]} == {"store", "worker-1"}


def test_down_says_which_processes_it_had_to_kill(tmp_path):
    from conftest import Cluster

    c = Cluster(tmp_path / "state", None)  # type: ignore[arg-type]
    up = json.loads(c.tc("up", "--workers", "1", "--mem", "32MiB", "--json", check=True).stdout)
    worker = next(p for p in up["processes"] if p["name"] == "worker-1")
    os.kill(worker["pid"], signal.SIGSTOP)  # a worker that does not stop in time
    try:
        proc = c.tc("down", "--timeout", "1", "--json")
    finally:
        try:
            os.kill(worker["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert proc.returncode == 1 and "killed worker-1" in proc.stderr
    down = json.loads(proc.stdout)
    assert [p["name"] for p in down["killed"]] == ["worker-1"] and len(down["stopped"]) == 2
    wait_until(lambda: _gone(worker["pid"]), 30)


def _installed_copy(root: Path) -> Path:
    """A venv where tensorcast is an installed copy (as `pip install .` leaves it), not the
    editable source tree; its other packages come from this venv. Returns its `tc` script."""
    import shutil

    import tensorcast._native

    import tensorcast

    site = root / "site"
    shutil.copytree(Path(tensorcast.__file__).parent, site / "tensorcast")
    shutil.copy(tensorcast._native.__file__, site / "tensorcast")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    pth = next((root / "venv" / "lib").glob("python3*/site-packages"))
    # Every directory this interpreter imports from, after the copy (paths listed in a .pth
    # are not site dirs: their own .pth files, this venv's editable-install hook among them,
    # stay out); not the source tree, which is what an installed package must not see.
    source = str(Path(tensorcast.__file__).parent.parent)
    paths = [p for p in sys.path if p and p != source and Path(p).is_dir()]
    (pth / "paths.pth").write_text("\n".join([str(site), *paths]) + "\n")
    script = root / "venv" / "bin" / "tc"
    script.write_text(
        f"#!{root / 'venv' / 'bin' / 'python'}\n"
        "import sys\nfrom tensorcast.cli.main import run\nsys.exit(run())\n"
    )
    script.chmod(0o755)
    return script


def test_up_from_a_directory_holding_a_tensorcast_tree_starts_the_installed_package(tmp_path):
    """`tc up` run inside a source checkout by a non-editable install: its children must import
    the installed package, not the (unbuilt) tree in the working directory."""
    tc_script = _installed_copy(tmp_path / "install")
    checkout = tmp_path / "checkout"
    (checkout / "tensorcast").mkdir(parents=True)
    (checkout / "tensorcast" / "__init__.py").write_text('raise ImportError("the source tree")\n')
    state = tmp_path / "state"
    env = {**os.environ, "TC_STATE_DIR": str(state)}
    run = subprocess.run(
        [str(tc_script), "up", "--workers", "1", "--mem", "16MiB", "--json"],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    try:
        assert run.returncode == 0, run.stderr
        assert len(json.loads(run.stdout)["processes"]) == 2
    finally:
        subprocess.run([str(tc_script), "down"], cwd=tmp_path, env=env, timeout=120)


def test_killed_worker_is_detected_within_ttl(fresh_cluster):
    ttl_s = float(os.environ["TC_HEARTBEAT_TTL_S"])
    with fresh_cluster.connect() as rt:
        rt.put({"w": torch.ones(4)}, "on-worker")
        os.kill(fresh_cluster.pid("worker-1"), signal.SIGKILL)
        killed_at = time.monotonic()
        wait_until(lambda: not rt.workers()[0].alive, ttl_s + 30)
        # Dead once its last heartbeat is a TTL old; the slack covers a loaded machine only.
        assert time.monotonic() - killed_at <= ttl_s + 10
        status = json.loads(fresh_cluster.tc("status", "--json").stdout)
        assert {x["name"]: x["state"] for x in status["components"]}["worker-1"] == "dead"
        with pytest.raises(tc.Unavailable, match="no live replica"):
            rt.artifact("on-worker").tensor_dict()


def test_store_killed_and_restarted_loses_nothing(fresh_cluster):
    c = fresh_cluster
    with c.connect() as rt:
        data = {f"t{i}": torch.randn(64) for i in range(5)}
        for i in range(20):
            rt.put({"i": torch.tensor(i), **data}, f"durable-{i}")
        rt.register({"x": torch.ones(3)}, "durable-lease", ttl_s=600)
        before = [(a.art_id, a.content_id, a.owner) for a in rt.list_artifacts()]
    store_pid = c.pid("store")
    os.kill(store_pid, signal.SIGKILL)
    wait_until(lambda: _gone(store_pid), 30)
    restarted = c.start_store_again()
    try:

        def reconnect():
            try:
                return c.connect()
            except tc.Unavailable:
                return None

        rt = wait_until(reconnect, 30, 0.2)
        with rt:
            after = [(a.art_id, a.content_id, a.owner) for a in rt.list_artifacts()]
            assert after == before
            # The worker kept heartbeating into the new store process and still serves the data.
            got = wait_until(lambda: rt.artifact("durable-7").info.replicas, 30)
            assert got
            assert int(rt.artifact("durable-7").tensor_dict()["i"]) == 7
    finally:
        restarted.terminate()
        restarted.wait(10)


def test_wrong_or_missing_token_is_rejected(cluster):
    with pytest.raises(tc.Unauthenticated, match="token"):
        tc.connect(cluster.record.store_addr, "wrong-token")
    proc = cluster.tc("ls", "--token", "wrong-token")
    assert proc.returncode == tc.Unauthenticated.exit_code and "token" in proc.stderr
    # The workers' gRPC port and the same-host socket check it too.
    from tensorcast.proto import tensorcast_pb2 as pb
    from tensorcast.sdk.local_client import LocalConnection

    with cluster.connect() as rt:
        worker = rt.workers()[0]
        rt.token = "wrong-token"
        with pytest.raises(tc.Unauthenticated):
            rt.worker_stub(worker).call("Status", pb.Empty())
        with pytest.raises(tc.Unauthenticated):
            LocalConnection(worker.local_socket, "wrong-token", 5.0)
    # Refused before the request is parsed: bytes that are no protobuf get UNAUTHENTICATED
    # without the token, and a parse error (not the servicer) with it.
    import grpc

    from tensorcast.rpc import TOKEN_METADATA_KEY

    with grpc.insecure_channel(cluster.record.store_addr) as channel:
        call = channel.unary_unary("/tensorcast.v1.GlobalStore/GetArtifact")
        for token, code in (
            ("wrong-token", grpc.StatusCode.UNAUTHENTICATED),
            (cluster.token, grpc.StatusCode.INTERNAL),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                call(b"\xff\xff\xff", metadata=[(TOKEN_METADATA_KEY, token)], timeout=30)
            assert refused.value.code() == code


def test_the_same_host_socket_gives_an_unauthenticated_peer_little(cluster):
    """The socket is abstract (any process of the network namespace can connect): before its
    hello is accepted a peer may send a few KiB, within a deadline, then it is cut off."""
    import socket
    import struct

    from tensorcast.transport.unix import socket_address
    from tensorcast.worker.local_server import HELLO_TIMEOUT_S

    with cluster.connect() as rt:
        worker = rt.workers()[0]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as big:
        big.connect(socket_address(worker.local_socket))
        big.settimeout(30)
        big.sendall(struct.pack("<I", 48 << 20) + b"{" * 4096)  # a 48 MiB hello, begun
        assert big.recv(1) == b""  # closed at once, nothing buffered
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as idle:
        idle.connect(socket_address(worker.local_socket))
        idle.settimeout(HELLO_TIMEOUT_S + 30)
        started = time.monotonic()
        assert idle.recv(1) == b""  # never said hello: closed after the hello deadline
        assert time.monotonic() - started >= HELLO_TIMEOUT_S - 1


def test_during_a_token_rotation_servers_accept_both_tokens(tmp_path):
    """Every server started with "new,old" accepts callers presenting either token: the store
    and workers over gRPC, the same-host socket, the page socket, and the data plane between
    workers (which present the first). Anything else is refused."""
    from tensorcast.sdk.cluster_file import write_token

    state = tmp_path / "state"
    write_token(state, "tok-new, tok-old")  # spaces too: every server trims them
    c = Cluster(state, None)  # type: ignore[arg-type]
    up = json.loads(c.tc("up", "--workers", "2", "--mem", "32MiB", "--json", check=True).stdout)
    try:
        for i, token in enumerate(("tok-new", "tok-old")):
            with tc.connect(up["store_addr"], token) as rt:
                assert rt.token == token
                data = torch.full((4096,), float(i))
                art = rt.put({"w": data}, f"rot-{i}", worker="worker-1")  # local socket
                assert art.prefetch("worker-2").bytes_moved > 0  # worker to worker (data plane)
                assert torch.equal(rt.artifact(f"rot-{i}").tensor_dict()["w"], data)
                pages = rt.pages()
                pages.put_pages({f"rot/{i}": data}, ttl_s=60)  # the page socket
                assert torch.equal(pages.get_pages([f"rot/{i}"])[0].tensor(), data)
        with pytest.raises(tc.Unauthenticated):
            tc.connect(up["store_addr"], "tok-other")
        with tc.connect(up["store_addr"], "tok-new,tok-old") as rt:  # a client sends the first
            assert rt.token == "tok-new"
    finally:
        c.tc("down")


def test_pool_full_is_clean(fresh_cluster):
    with fresh_cluster.connect() as rt:
        rt.put({"small": torch.ones(1024)}, "fits")
        used = pool_used(rt)
        with pytest.raises(tc.ResourceExhausted, match="pool full"):
            rt.put({"huge": torch.zeros(80 * 1024 * 1024 // 4)}, "too-big")  # 80 MiB > 64 MiB
        assert pool_used(rt) == used
        assert [a.art_id for a in rt.list_artifacts()] == ["fits"]
        proc = fresh_cluster.tc("ls", "--json", check=True)
        assert [a["art_id"] for a in json.loads(proc.stdout)["artifacts"]] == ["fits"]


def test_files_put_by_reference_must_fit_the_pool_that_reads_them(fresh_cluster, tmp_path):
    """A by-reference put reads nothing until the first load, which loads it whole into the
    registering worker's pool: one larger than that pool was accepted and could then never be
    read anywhere (every read failed with pool full). Refused at the put, nothing recorded."""
    from safetensors.torch import save_file

    path = tmp_path / "big.safetensors"
    save_file({"w": torch.zeros(80 * 1024 * 1024 // 4)}, str(path))  # 80 MiB > 64 MiB
    proc = fresh_cluster.tc("put", "big-ref", str(path), "--by-reference")
    assert proc.returncode == tc.ResourceExhausted.exit_code and "more than" in proc.stderr
    with fresh_cluster.connect() as rt:
        assert rt.list_artifacts() == [] or all(a.art_id != "big-ref" for a in rt.list_artifacts())


def test_get_writes_through_a_symlink_and_down_of_no_cluster_creates_nothing(cluster, tmp_path):
    from safetensors.torch import load_file

    with cluster.connect() as rt:
        rt.put({"w": torch.arange(4.0)}, "via-link")
    target = tmp_path / "target.safetensors"
    target.write_bytes(b"old")
    link = tmp_path / "link.safetensors"
    link.symlink_to(target)
    cluster.tc("get", "via-link", "-o", str(link), check=True)
    assert link.is_symlink() and torch.equal(load_file(target)["w"], torch.arange(4.0))
    typo = tmp_path / "no-such-state-dir"
    proc = subprocess.run(
        [sys.executable, "-m", "tensorcast.cli.main", "down", "--state-dir", str(typo)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and not typo.exists()


def test_cli_errors_have_exit_codes(tmp_path, cluster):
    bad_size = cluster.tc("up", "--mem", "12XB", env={"TC_STATE_DIR": str(tmp_path)})
    assert bad_size.returncode == tc.InvalidArgument.exit_code and "bad size" in bad_size.stderr
    unreachable = cluster.tc("ls", "--addr", "127.0.0.1:1", "--token", "x")
    assert unreachable.returncode == tc.Unavailable.exit_code
    assert "cannot reach" in unreachable.stderr
    no_cluster = subprocess.run(
        [sys.executable, "-m", "tensorcast.cli.main", "ls", "--state-dir", str(tmp_path / "none")],
        capture_output=True,
        text=True,
    )
    assert no_cluster.returncode == tc.Unavailable.exit_code and "tc up" in no_cluster.stderr
    missing_file = cluster.tc("put", "x", str(tmp_path / "nope.safetensors"))
    assert missing_file.returncode == tc.InvalidArgument.exit_code
