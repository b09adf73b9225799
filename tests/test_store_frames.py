"""The Global Store's frame port (tensorcast/rpc/frames.py, architecture.md decision 76): unary
store calls as frames on a kept-open socket, with gRPC as the fallback. Real store process."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

import tensorcast as tc
from tensorcast.errors import NotFound, TensorcastError, Unauthenticated
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.rpc import frames
from tensorcast.rpc.frames import FrameClient, FrameTransportError
from tensorcast.sdk.cluster_file import ClusterRecord
from tensorcast.transport.unix import recv_exact


def _frame_client(rt, token=None) -> FrameClient:
    port = rt.store_status().frame_port
    assert port > 0
    host = rt.store_addr.rpartition(":")[0]
    return FrameClient(host, port, token or rt.token)


def test_store_calls_go_by_frames_and_answer_as_grpc_does(rt):
    rt.put({"w": torch.arange(8.0)}, "frames/a")
    client = _frame_client(rt)
    try:
        by_frames = client.call("GetArtifact", pb.ArtifactRequest(art_id="frames/a"), 5.0)
        by_grpc = super(type(rt.store), rt.store).call(
            "GetArtifact", pb.ArtifactRequest(art_id="frames/a")
        )
        assert by_frames == by_grpc and by_frames.art_id == "frames/a"
        with pytest.raises(NotFound):  # the store's typed error crosses intact
            client.call("GetArtifact", pb.ArtifactRequest(art_id="frames/none"), 5.0)
        # The SDK's own store client found the port and uses it.
        assert rt.store.call("GetArtifact", pb.ArtifactRequest(art_id="frames/a")) == by_grpc
        assert rt.store._frames is not None
    finally:
        client.close()


def _open_files(pid: int, name: str) -> int:
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            count += name in os.readlink(f"/proc/{pid}/fd/{fd}")
    return count


def test_short_lived_clients_leave_no_open_database_files_in_the_store(cluster, rt):
    """Each frame connection has a thread of its own; its reads must not leave a sqlite
    connection (two descriptors) behind it: the store ran out of them after ~500 clients."""
    from tensorcast.store.sqlite_store import MAX_IDLE_READERS

    store = next(p.pid for p in cluster.record.processes if p.role == "store")
    rt.put({"w": torch.arange(4.0)}, "frames/fd")
    before = _open_files(store, "store.db")
    for _ in range(60):
        client = _frame_client(rt)
        try:
            assert client.call("GetArtifact", pb.ArtifactRequest(art_id="frames/fd"), 5.0).art_id
        finally:
            client.close()
    assert _open_files(store, "store.db") <= before + 2 * MAX_IDLE_READERS


def test_a_wrong_token_is_refused(rt):
    client = _frame_client(rt, token="not-the-token")
    with pytest.raises(Unauthenticated):
        client.call("GetArtifact", pb.ArtifactRequest(art_id="x"), 5.0)


def test_bad_frames_get_an_error_or_a_closed_connection_and_the_store_keeps_serving(rt):
    rt.put({"w": torch.zeros(4)}, "frames/b")
    port = rt.store_status().frame_port
    host = rt.store_addr.rpartition(":")[0]
    token = rt.token.encode()

    def hello() -> socket.socket:
        sock = socket.create_connection((host, port), timeout=5)
        sock.sendall(frames.HELLO.pack(frames.MAGIC, frames.VERSION, len(token)) + token)
        assert recv_exact(sock, frames.HELLO_REPLY.size) == frames.HELLO_REPLY.pack(0, 0)
        return sock

    def reply(sock) -> tuple[int, bytes]:
        size, status = frames.REPLY.unpack(recv_exact(sock, frames.REPLY.size))
        return status, recv_exact(sock, size)

    sock = hello()
    try:
        # An unknown method and a malformed message: error replies, the connection stays.
        name = b"DropEverything"
        sock.sendall(frames.REQUEST.pack(0, len(name)) + name)
        status, body = reply(sock)
        assert status == 1 and json.loads(body)["kind"] == "InvalidArgument"
        assert "no unary method" in json.loads(body)["message"]
        name, junk = b"GetArtifact", b"\xff\xff\xff"
        sock.sendall(frames.REQUEST.pack(len(junk), len(name)) + name + junk)
        status, body = reply(sock)
        assert status == 1 and json.loads(body)["kind"] == "InvalidArgument"
        assert "malformed" in json.loads(body)["message"]
        request = pb.ArtifactRequest(art_id="frames/b").SerializeToString()
        sock.sendall(frames.REQUEST.pack(len(request), len(name)) + name + request)
        status, body = reply(sock)
        assert status == 0 and pb.Artifact.FromString(body).art_id == "frames/b"
        # An oversized frame: the store closes the connection without reading it.
        sock.sendall(frames.REQUEST.pack(1 << 31, len(name)) + name)
        try:
            assert sock.recv(16) == b""
        except ConnectionResetError:
            pass  # closed with the name unread: a reset, as good as a FIN here
    finally:
        sock.close()
    bad = socket.create_connection((host, port), timeout=5)  # not a frame client at all
    try:
        bad.sendall(b"GET / HTTP/1.1\r\n\r\n")
        status, _ = frames.HELLO_REPLY.unpack(recv_exact(bad, frames.HELLO_REPLY.size))
        assert status == 1
    finally:
        bad.close()
    assert rt.info("frames/b").art_id == "frames/b"


def test_a_frame_port_that_fails_sends_the_call_by_grpc(rt):
    rt.put({"w": torch.ones(4)}, "frames/c")
    request = pb.ArtifactRequest(art_id="frames/c")
    rt.store.call("GetArtifact", request)
    broken = rt.store._frames
    assert broken is not None
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    broken.close()
    broken.addr = ("127.0.0.1", dead_port)
    assert rt.store.call("GetArtifact", request).art_id == "frames/c"  # answered by gRPC
    assert rt.store._frames is None  # looked up again later, not per call
    with pytest.raises(FrameTransportError):
        broken.call("GetArtifact", request, 5.0)


def test_an_error_inside_the_store_comes_back_typed_not_as_a_dead_connection(rt):
    client = _frame_client(rt)
    try:
        with pytest.raises(TensorcastError):
            client.call("RenewLease", pb.RenewLeaseRequest(art_id="frames/none", ttl_s=5), 5.0)
        assert client.call("Status", pb.Empty(), 5.0).frame_port > 0  # same connection
    finally:
        client.close()


def test_closing_the_frame_server_ends_its_threads_and_connections():
    """A close from another thread wakes a blocked accept()/recv() only after a shutdown: without
    it every store stop waited out the accept thread's join (5 s)."""

    class Handler:
        def Status(self, request, context):
            return pb.StoreStatus(frame_port=1)

    server = frames.FrameServer(Handler(), "token", "127.0.0.1")
    client = FrameClient("127.0.0.1", server.port, "token")
    assert client.call("Status", pb.Empty(), 5.0).frame_port == 1  # a pooled, idle connection
    server.close()
    assert not server._thread.is_alive()  # the join ended because the thread did
    with pytest.raises(FrameTransportError):
        client.call("Status", pb.Empty(), 5.0)  # the idle connection was ended, not left open
    client.close()


NO_GRPC_SCRIPT = """
import json, sys
import torch
import tensorcast as tc
with tc.connect(state_dir=sys.argv[1]) as rt:
    rt.put({"w": torch.arange(4.0)}, "frames/no-grpc")
    got = rt.artifact("frames/no-grpc").tensor_dict()["w"].tolist()
    workers = len(rt.workers())
print(json.dumps({"grpc": "grpc" in sys.modules, "got": got, "workers": workers}))
"""

CLI_SCRIPT = """
import atexit, sys
atexit.register(lambda: print("grpc loaded:", "grpc" in sys.modules, file=sys.stderr))
from tensorcast.cli.main import run
sys.argv = ["tc", "ls", "--json", "--state-dir", sys.argv[1]]
run()
"""


def test_a_caller_on_the_local_cluster_never_imports_grpc(cluster):
    """The cluster record names the store's frame port, so puts, reads, listings and `tc ls`
    need no gRPC at all (importing it is ~0.1-0.2 s of every command and loader start)."""

    def run(script: str) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [sys.executable, "-c", script, str(cluster.state_dir)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        return proc

    sdk = run(NO_GRPC_SCRIPT)
    assert json.loads(sdk.stdout) == {"grpc": False, "got": [0.0, 1.0, 2.0, 3.0], "workers": 2}
    cli = run(CLI_SCRIPT)
    assert "frames/no-grpc" in {a["art_id"] for a in json.loads(cli.stdout)["artifacts"]}
    assert "grpc loaded: False" in cli.stderr


@pytest.mark.parametrize("stale", ["nothing listening", "another cluster's store"])
def test_a_stale_frame_port_in_the_record_falls_back_to_grpc(cluster, tmp_path, stale):
    """A record whose store port moved (a restart elsewhere) must not break callers, nor make
    another cluster's store on that port (refusing our token) look like this one refusing us."""

    class OtherStore:
        def Status(self, request, context):
            return pb.StoreStatus(frame_port=1)

    other = frames.FrameServer(OtherStore(), "another-token", "127.0.0.1")
    if stale == "nothing listening":
        other.close()  # its port is free again
    try:
        record = ClusterRecord.load(cluster.state_dir)
        assert record is not None and record.store_frame_ports()
        real_port = next(iter(record.store_frame_ports().values()))
        for p in record.processes:
            if p.role == "store":
                p.frame_port = other.port
        record.save(tmp_path)
        shutil.copy(cluster.state_dir / "token", tmp_path / "token")
        with tc.connect(state_dir=tmp_path) as rt:
            assert rt.store_status().frame_port == real_port  # answered by gRPC
            rt.put({"w": torch.ones(2)}, f"frames/stale-{other.port}")
            assert rt.store._frames is not None and rt.store._frames.addr[1] == real_port
            assert rt.info(f"frames/stale-{other.port}").art_id == f"frames/stale-{other.port}"
    finally:
        other.close()
