"""Mutual TLS with real processes: `tc up --tls` (a local CA, every process and `tc` speaking
TLS), and what is refused: plaintext clients, a wrong CA, no client certificate, an expired
certificate, a TLS client to a plaintext store. The token check stays under TLS."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import grpc
import pytest
import torch
from conftest import Cluster

import tensorcast as tc
from tensorcast.config import TLSFiles
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.proto import tensorcast_pb2_grpc as pb_grpc
from tensorcast.sdk.runtime import Runtime
from tensorcast.sdk.tls_certs import issue


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("tls") / "state", None)  # type: ignore[arg-type]
    up = json.loads(
        c.tc("up", "--tls", "--workers", "2", "--mem", "64MiB", "--json", check=True).stdout
    )
    c.record = type("R", (), {"store_addr": up["store_addr"]})()  # type: ignore[assignment]
    yield c
    c.tc("down")


def _status(addr: str, token: str, tls: TLSFiles | None) -> None:
    rt = Runtime(addr, token, 10.0, tls)
    try:
        rt.store_status()
    finally:
        rt.close()


def test_everything_speaks_tls_and_tc_finds_the_files_in_the_state_dir(tls_cluster, tmp_path):
    c = tls_cluster
    assert sorted(p.name for p in (c.state_dir / "tls").iterdir()) == [
        "ca-key.pem",
        "ca.pem",
        "cert.pem",
        "key.pem",
    ]
    assert (c.state_dir / "tls" / "key.pem").stat().st_mode & 0o777 == 0o600
    status = json.loads(c.tc("status", "--json", check=True).stdout)
    assert status["healthy"] and len(status["components"]) == 3
    with c.connect() as rt:
        assert rt.store_status().frame_port == 0  # no plaintext frame port on a TLS store
        art = rt.put({"w": torch.arange(1000.0)}, "secret", worker="worker-1")
        assert art.prefetch("worker-2").bytes_moved > 0  # worker to worker, under TLS
        rt.host_id = "elsewhere"  # a remote caller: bytes come over the (TLS) gRPC stream
        assert torch.equal(rt.artifact("secret").tensor_dict()["w"], torch.arange(1000.0))
    out = tmp_path / "out.safetensors"
    c.tc("get", "secret", "-o", str(out), check=True)
    assert out.stat().st_size > 4000


def test_remote_pages_speak_tls_on_the_data_port(tls_cluster, tmp_path):
    """A caller on another host reaches the homes' data ports under mutual TLS; one without
    the cluster's files is told why, and one with another CA is refused."""
    c = tls_cluster
    files = TLSFiles(*(str(c.state_dir / "tls" / n) for n in ("ca.pem", "cert.pem", "key.pem")))
    data = {f"kv/tls/{i}": torch.full((4096,), float(i)) for i in range(12)}
    rt = Runtime(c.record.store_addr, c.token, 10.0, files)
    try:
        rt.host_id = "elsewhere"  # every home is remote: its data port, under TLS
        pages = rt.pages()
        pages.put_pages(data, ttl_s=60)
        got = pages.get_pages(list(data))
        assert all(torch.equal(g.tensor(), t) for g, t in zip(got, data.values()))
        assert pages.exists_pages(list(data)) == [True] * len(data)
    finally:
        rt.close()
    # The store reached under TLS, but the data ports in plaintext: refused with the reason.
    plain = Runtime(c.record.store_addr, c.token, 10.0, files)  # its store stub keeps TLS
    try:
        plain.host_id = "elsewhere"
        plain.tls = None
        with pytest.raises(tc.Unavailable, match="speaks TLS only"):
            plain.pages().get_pages(list(data))
        plain.tls = issue(tmp_path / "other")  # a CA the workers do not trust
        with pytest.raises(tc.Unavailable, match="TLS with page home"):
            plain.pages().exists_pages(list(data))
    finally:
        plain.close()


def test_clients_without_the_clusters_certificates_are_refused(tls_cluster, tmp_path):
    c = tls_cluster
    addr, token = c.record.store_addr, c.token
    files = TLSFiles(*(str(c.state_dir / "tls" / n) for n in ("ca.pem", "cert.pem", "key.pem")))
    _status(addr, token, files)  # the right files get through
    with pytest.raises(tc.Unavailable, match="TLS server closes plaintext"):
        _status(addr, token, None)
    other_ca = issue(tmp_path / "other")
    with pytest.raises(tc.Unavailable, match="TLS with global store"):
        _status(addr, token, other_ca)
    expired = issue(
        tmp_path / "expired",
        ca_files=(c.state_dir / "tls" / "ca.pem", c.state_dir / "tls" / "ca-key.pem"),
        not_before=datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc),
        not_after=datetime.datetime(2021, 1, 1, tzinfo=datetime.timezone.utc),
    )
    with pytest.raises(tc.Unavailable):
        _status(addr, token, expired)
    # A client that trusts the CA but shows no certificate of its own: mutual TLS refuses it.
    channel = grpc.secure_channel(
        addr, grpc.ssl_channel_credentials(root_certificates=Path(files.ca).read_bytes())
    )
    with pytest.raises(grpc.RpcError) as info:
        pb_grpc.GlobalStoreStub(channel).Status(
            pb.Empty(), metadata=(("x-tensorcast-token", token),), timeout=10
        )
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    channel.close()
    with pytest.raises(tc.Unauthenticated):  # TLS does not replace the token
        _status(addr, "wrong-token", files)
    bad = c.tc(
        "status",
        env={
            "TC_TLS_CA": str(other_ca.ca),
            "TC_TLS_CERT": other_ca.cert,
            "TC_TLS_KEY": other_ca.key,
        },
    )
    assert bad.returncode == tc.Unavailable.exit_code and "TLS" in bad.stdout + bad.stderr


def test_a_tls_client_is_refused_by_a_plaintext_store(cluster, tmp_path):
    with pytest.raises(tc.Unavailable, match="TLS with global store"):
        _status(cluster.record.store_addr, cluster.token, issue(tmp_path / "ca"))


def test_tls_files_come_as_three_or_not_at_all(tmp_path, monkeypatch):
    from tensorcast.config import tls_files

    monkeypatch.delenv("TC_TLS_CA", raising=False)
    assert tls_files(tmp_path) is None
    with pytest.raises(tc.InvalidArgument, match="all of"):
        tls_files(tmp_path, ca="ca.pem")
    with pytest.raises(tc.InvalidArgument, match="cannot read"):
        TLSFiles("/nope/ca.pem", "/nope/c.pem", "/nope/k.pem").read()
    c = Cluster(tmp_path / "state", None)  # type: ignore[arg-type]
    c.tc("up", "--mem", "16MiB", check=True)
    try:
        proc = c.tc("up", "--tls")
        assert proc.returncode == tc.InvalidArgument.exit_code and "plaintext" in proc.stderr
    finally:
        c.tc("down")


def test_the_native_data_plane_is_mutual_tls_too(tmp_path):
    """Worker-to-worker pulls: a TLS data server serves TLS clients holding the CA's
    certificates, and refuses plaintext clients and clients of another CA, each with a message
    that says so; a TLS client of a plaintext server is refused as clearly."""
    import numpy as np

    from tensorcast.transport import native

    ca = issue(tmp_path / "ca")
    other = issue(tmp_path / "other")
    pool = np.arange(4 << 20, dtype=np.uint8)
    tls_server = native.data_server("127.0.0.1", pool, "tok", tls=ca)
    plain_server = native.data_server("127.0.0.1", pool, "tok")
    try:
        ticket = tls_server.open_ticket(0, pool.size, 60_000)
        addr = f"127.0.0.1:{tls_server.port}"
        dest = bytearray(pool.size)
        native.pull(addr, "tok", ticket, 0, pool.size, dest, 0, streams=2, tls=ca)
        assert bytes(dest) == pool.tobytes()
        with pytest.raises(tc.Unavailable, match="speaks TLS only"):
            native.pull(addr, "tok", ticket, 0, 4096, bytearray(4096), 0, tls=None)
        with pytest.raises(tc.Unavailable, match="certificate verification failed"):
            native.pull(addr, "tok", ticket, 0, 4096, bytearray(4096), 0, tls=other)
        plain_ticket = plain_server.open_ticket(0, 4096, 60_000)
        with pytest.raises(tc.Unavailable, match="TLS with the data server"):
            native.pull(
                f"127.0.0.1:{plain_server.port}",
                "tok",
                plain_ticket,
                0,
                4096,
                bytearray(4096),
                0,
                tls=ca,
            )
        with pytest.raises(tc.InvalidArgument, match="data server"):
            native.data_server("127.0.0.1", pool, "tok", tls=TLSFiles(ca.ca, ca.cert, other.key))
    finally:
        tls_server.stop()
        plain_server.stop()
