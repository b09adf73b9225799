"""The Global Store's frame port (tensorcast/rpc/frames.py, architecture.md decision 76): unary
store calls as frames on a kept-open socket, with gRPC as the fallback. Real store process."""

from __future__ import annotations

import json
import socket

import pytest
import torch

from tensorcast.errors import NotFound, TensorcastError, Unauthenticated
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.rpc import frames
from tensorcast.rpc.frames import FrameClient, FrameTransportError
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
