"""Instances attached to this worker. Each opened one bidirectional stream (`Attach`); the worker
pushes operations down it and matches the replies by call id, so engines open no port of theirs.
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import replace
from typing import Any

from tensorcast import errors
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.rpc.convert import instance_from_pb
from tensorcast.types import InstanceInfo

log = logging.getLogger("tensorcast.worker.instances")

MAX_ATTACHED = 64
# The first command down a stream: the worker took the instance's hello (a stream call only
# connects when read, so until then the instance cannot tell a live worker from a dead address).
ATTACHED_OP = "attached"
MAX_QUEUED_COMMANDS = 64
POLL_S = 0.5


class InstanceSession:
    def __init__(self, info: InstanceInfo) -> None:
        self.info = info
        self.commands: queue.Queue[pb.InstanceCommand] = queue.Queue(MAX_QUEUED_COMMANDS)
        self.pending: dict[int, Future] = {}
        self.closed = threading.Event()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def call(self, op: str, args: dict, timeout_s: float, trace_id: str) -> dict:
        if self.closed.is_set():
            raise errors.Unavailable(f"instance {self.info.instance_id} detached")
        future: Future = Future()
        with self._lock:
            call_id = next(self._ids)
            self.pending[call_id] = future
        command = pb.InstanceCommand(
            call_id=call_id,
            op=op,
            args_json=json.dumps(args),
            timeout_ms=max(1, int(timeout_s * 1000)),
            trace_id=trace_id,
        )
        deadline = time.monotonic() + timeout_s  # one for the queueing and the answer
        try:
            self.commands.put(command, timeout=timeout_s)
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            raise errors.ResourceExhausted(
                f"instance {self.info.instance_id} has {MAX_QUEUED_COMMANDS} operations queued"
            ) from None
        except FutureTimeout:
            raise errors.DeadlineExceeded(
                f"instance {self.info.instance_id} did not finish {op} in {timeout_s:.1f} s"
            ) from None
        finally:
            with self._lock:
                self.pending.pop(call_id, None)

    def on_message(self, message: pb.InstanceMessage) -> None:
        if message.HasField("hello"):
            load = instance_from_pb(message.hello)
            self.info = replace(
                self.info,
                waiting=load.waiting,
                running=load.running,
                cached_tokens=load.cached_tokens,
                requests=load.requests,
            )
        if message.call_id:
            with self._lock:
                future = self.pending.get(message.call_id)
            if future is None or future.done():
                return  # the caller gave up already
            if message.error_kind:
                future.set_exception(errors.error_named(message.error_kind, message.error_message))
            else:
                future.set_result(json.loads(message.result_json or "{}"))

    def close(self) -> None:
        self.closed.set()
        with self._lock:
            pending = list(self.pending.values())
        for future in pending:
            if not future.done():
                future.set_exception(
                    errors.Unavailable(f"instance {self.info.instance_id} detached mid-operation")
                )


class Instances:
    def __init__(self, worker_id: str, worker_name: str) -> None:
        self.worker_id = worker_id
        self.worker_name = worker_name
        self._sessions: dict[str, InstanceSession] = {}
        self._lock = threading.Lock()
        self.on_change = lambda: None  # set by the worker: report to the store at once

    def attach(self, messages: Iterator[pb.InstanceMessage], is_active: Any) -> Iterator[Any]:
        """Serve one attach stream: yields commands until the instance or worker goes away."""
        first = next(messages, None)
        if first is None or not first.HasField("hello") or not first.hello.instance_id:
            raise errors.InvalidArgument("an attach stream starts with a hello naming the instance")
        info = replace(
            instance_from_pb(first.hello), worker_id=self.worker_id, worker_name=self.worker_name
        )
        session = InstanceSession(info)
        with self._lock:
            if len(self._sessions) >= MAX_ATTACHED and info.instance_id not in self._sessions:
                raise errors.ResourceExhausted(f"{MAX_ATTACHED} instances attached already")
            old = self._sessions.get(info.instance_id)
            self._sessions[info.instance_id] = session
        if old is not None:
            old.close()  # the instance reconnected: the new stream wins
        log.info("instance %s (%s) attached", info.instance_id, info.engine)
        reader = threading.Thread(
            target=self._read, args=(session, messages), name="attach-read", daemon=True
        )
        reader.start()
        self.on_change()
        try:
            yield pb.InstanceCommand(op=ATTACHED_OP)  # the instance knows it is attached
            while not session.closed.is_set() and is_active():
                try:
                    yield session.commands.get(timeout=POLL_S)
                except queue.Empty:
                    continue
        finally:
            session.close()
            with self._lock:
                if self._sessions.get(info.instance_id) is session:
                    del self._sessions[info.instance_id]
            log.info("instance %s detached", info.instance_id)
            self.on_change()

    def _read(self, session: InstanceSession, messages: Iterator[pb.InstanceMessage]) -> None:
        try:
            for message in messages:
                session.on_message(message)
        except Exception as e:  # the stream broke: the instance is gone
            log.info("attach stream of %s ended: %s", session.info.instance_id, e)
        finally:
            session.close()

    def call(self, instance_id: str, op: str, args: dict, timeout_s: float, trace_id: str) -> dict:
        with self._lock:
            session = self._sessions.get(instance_id)
        if session is None:
            raise errors.Unavailable(f"instance {instance_id!r} is not attached to this worker")
        return session.call(op, args, timeout_s, trace_id)

    def infos(self) -> list[InstanceInfo]:
        with self._lock:
            return [s.info for s in self._sessions.values()]

    def close(self) -> None:
        with self._lock:
            sessions = list(self._sessions.values())
        for session in sessions:
            session.close()
