"""Connect an instance process: find its worker by address (asking it for the store's address)
or by name/id through the usual cluster lookup."""

from __future__ import annotations

from pathlib import Path

from tensorcast.sdk.runtime import Runtime
from tensorcast.types import WorkerInfo


def open_runtime(
    worker: str, state_dir: Path | None, addr: str | None, token: str | None
) -> tuple[Runtime, WorkerInfo]:
    from tensorcast import config
    from tensorcast.errors import InvalidArgument
    from tensorcast.proto import tensorcast_pb2 as pb
    from tensorcast.proto import tensorcast_pb2_grpc as pb_grpc
    from tensorcast.rpc.client import Stub, make_channel
    from tensorcast.sdk.cluster_file import read_token
    from tensorcast.sdk.runtime import connect

    token = token or config.env_token() or read_token(state_dir or config.default_state_dir())
    if not token:
        raise InvalidArgument("no cluster token: pass --token, set TC_TOKEN, or use the state dir")
    if ":" in worker:  # HOST:PORT of the worker: it knows its store
        config.parse_host_port(worker)
        channel = make_channel(worker, config.tls_files(state_dir or config.default_state_dir()))
        try:
            stub = Stub(pb_grpc.WorkerServiceStub(channel), f"worker {worker}", token, 10.0)
            status = stub.call("Status", pb.Empty())
        finally:
            channel.close()
        rt = connect(addr or status.store_addr, token, state_dir=state_dir)
        worker = status.worker.worker_id
    else:
        rt = connect(addr, token, state_dir=state_dir)
    target = rt.resolve_worker(worker)
    if not rt.is_local(target):
        raise InvalidArgument(f"worker {target.name} runs on another host: attach to a local one")
    return rt, target
