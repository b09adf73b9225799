"""Configuration: the only module that reads `TC_*` environment variables, plus size parsing.

Stays import-light (no torch, grpc) because `tc --help` imports it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
from dataclasses import dataclass
from pathlib import Path

from tensorcast.errors import InvalidArgument

DEFAULT_STORE_PORT = 7400
DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
DEFAULT_HEARTBEAT_TTL_S = 5.0
# A content committed by a worker but not yet named by an artifact survives this long.
DEFAULT_UNREFERENCED_GRACE_S = 120.0
# A batch of artifacts being staged on etcd longer than this is rolled back by any store's sweep.
DEFAULT_BATCH_TIMEOUT_S = 60.0
DEFAULT_RPC_TIMEOUT_S = 30.0
DEFAULT_WORKER_MEM = "1GiB"
# gRPC messages carry metadata and chunks of bulk data for remote callers; cap them.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
STREAM_CHUNK_BYTES = 4 * 1024 * 1024

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Parse "512MiB", "2GiB", "1.5G", "4096" into bytes. Decimal units are powers of 1000."""
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _SIZE_UNITS:
        raise InvalidArgument(
            f"bad size {text!r}: use a number with an optional unit, e.g. 512MiB, 2GiB, 1.5GB"
        )
    size_bytes = int(float(match.group(1)) * _SIZE_UNITS[unit])
    if size_bytes <= 0:
        raise InvalidArgument(f"bad size {text!r}: must be greater than zero")
    return size_bytes


def format_size(size_bytes: int) -> str:
    value = float(size_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def parse_host_port(text: str, default_port: int = 0) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = text, str(default_port)
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidArgument(f"bad address {text!r}: use HOST:PORT, e.g. 127.0.0.1:7400")
    return host.strip("[]"), int(port)


def parse_store_addrs(addrs: str) -> list[str]:
    """ "h1:7400,h2:7400" -> ["h1:7400", "h2:7400"]: the members of a Global Store."""
    members = [a.strip() for a in addrs.split(",") if a.strip()]
    if not members:
        raise InvalidArgument(f"no store address in {addrs!r}: use HOST:PORT[,HOST:PORT...]")
    for member in members:
        if parse_host_port(member)[1] == 0:
            raise InvalidArgument(f"bad store address {member!r}: use HOST:PORT, e.g. h1:7400")
    return members


TLS_DIR = "tls"  # in the state dir: ca.pem, cert.pem, key.pem (written by `tc up --tls`)


@dataclass(frozen=True)
class TLSFiles:
    """PEM files for mutual TLS: the CA that signs every member's certificate, and this
    process's own certificate and key (a server's identity, and a client's proof)."""

    ca: str
    cert: str
    key: str

    def read(self) -> tuple[bytes, bytes, bytes]:
        try:
            return tuple(Path(p).read_bytes() for p in (self.ca, self.cert, self.key))  # type: ignore[return-value]
        except OSError as e:
            raise InvalidArgument(f"cannot read a TLS file: {e}") from None


def tls_files(
    state_dir: Path | None = None,
    ca: str | None = None,
    cert: str | None = None,
    key: str | None = None,
) -> TLSFiles | None:
    """The TLS files to use: flags, else TC_TLS_CA/TC_TLS_CERT/TC_TLS_KEY, else the state dir's
    tls/ folder when it holds them; None (plaintext) when none of these names any. All three
    or none."""
    given = [
        ca or os.environ.get("TC_TLS_CA") or None,
        cert or os.environ.get("TC_TLS_CERT") or None,
        key or os.environ.get("TC_TLS_KEY") or None,
    ]
    if not any(given) and state_dir is not None:
        folder = state_dir / TLS_DIR
        if (folder / "ca.pem").exists():
            given = [str(folder / n) for n in ("ca.pem", "cert.pem", "key.pem")]
    if not any(given):
        return None
    if not all(given):
        raise InvalidArgument("TLS needs all of --tls-ca, --tls-cert and --tls-key (or TC_TLS_*)")
    return TLSFiles(*given)  # type: ignore[arg-type]


def default_state_dir() -> Path:
    if env := os.environ.get("TC_STATE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "tensorcast"


def env_addr() -> str | None:
    return os.environ.get("TC_ADDR") or None


def send_token(token: str) -> str:
    """The token a client sends: the first of a comma-separated list ("new,old": a server
    accepts every one listed while the cluster token rotates, docs/operators.md)."""
    return token.split(",")[0].strip()


def accepted_tokens(accepted: str) -> str:
    """The comma-separated accepted tokens without surrounding spaces: the native servers
    compare each verbatim ("new, old" refused "old" on the data port and page sockets)."""
    return ",".join(t.strip() for t in accepted.split(",") if t.strip())


def token_accepted(accepted: str, given: str) -> bool:
    """`given` is one of the comma-separated `accepted` tokens (constant-time comparisons)."""
    ok = False
    for token in accepted_tokens(accepted).split(","):
        ok |= bool(token) and hmac.compare_digest(token.encode(), given.encode())
    return ok


def env_token() -> str | None:
    return os.environ.get("TC_TOKEN") or None


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise InvalidArgument(f"{name}={raw!r} is not a number") from None


@dataclass(frozen=True)
class Timing:
    """Liveness timing shared by the store (TTL) and workers (interval)."""

    heartbeat_interval_s: float
    heartbeat_ttl_s: float
    rpc_timeout_s: float
    unreferenced_grace_s: float
    batch_timeout_s: float = DEFAULT_BATCH_TIMEOUT_S


def timing() -> Timing:
    return Timing(
        heartbeat_interval_s=_env_float("TC_HEARTBEAT_INTERVAL_S", DEFAULT_HEARTBEAT_INTERVAL_S),
        heartbeat_ttl_s=_env_float("TC_HEARTBEAT_TTL_S", DEFAULT_HEARTBEAT_TTL_S),
        rpc_timeout_s=_env_float("TC_RPC_TIMEOUT_S", DEFAULT_RPC_TIMEOUT_S),
        unreferenced_grace_s=_env_float("TC_UNREFERENCED_GRACE_S", DEFAULT_UNREFERENCED_GRACE_S),
        batch_timeout_s=_env_float("TC_BATCH_TIMEOUT_S", DEFAULT_BATCH_TIMEOUT_S),
    )


def host_id() -> str:
    """Identity of this host as seen by the data plane: same host means shared memory works.

    Boot id plus network namespace, so workers in separate namespaces count as separate hosts.
    """
    if env := os.environ.get("TC_HOST_ID"):
        return env
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = os.uname().nodename
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = ""
    return hashlib.sha256(f"{boot_id}|{netns}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class FaultInjection:
    """Test hooks (never set in production). The data server: corrupt the checksum of the next
    N chunks sent, or drop a connection after N chunks, as a dying or faulty source would. The
    Global Store: die (exit at once, as kill -9) while writing a batch of at least N artifacts,
    before it commits (`store_exit_in_batch`) or just after (`store_exit_after_commit`)."""

    corrupt_chunks: int = 0
    close_after_chunks: int = 0
    store_exit_in_batch: int = 0
    store_exit_after_commit: int = 0


def fault_injection() -> FaultInjection:
    return FaultInjection(
        corrupt_chunks=int(_env_float("TC_FAULT_CORRUPT_CHUNKS", 0)),
        close_after_chunks=int(_env_float("TC_FAULT_CLOSE_AFTER_CHUNKS", 0)),
        store_exit_in_batch=int(_env_float("TC_FAULT_STORE_EXIT_IN_BATCH", 0)),
        store_exit_after_commit=int(_env_float("TC_FAULT_STORE_EXIT_AFTER_COMMIT", 0)),
    )


def cache_dir() -> Path:
    if env := os.environ.get("TC_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tensorcast"


CUDA_COPY_METHODS = ("auto", "register", "staging")


def cuda_copy_method() -> str:
    """How pool bytes reach a caller's GPU (`TC_CUDA_COPY`): "auto" (default) lets a same-host
    worker with a GPU tier copy them by DMA, else copies them here through pinned staging
    buffers; "staging" and "register" (page-lock the mapped region chunk by chunk) always copy
    here (architecture.md decision 53)."""
    method = os.environ.get("TC_CUDA_COPY", "auto").strip().lower() or "auto"
    if method not in CUDA_COPY_METHODS:
        raise InvalidArgument(
            f"TC_CUDA_COPY={method!r}: choose one of {', '.join(CUDA_COPY_METHODS)}"
        )
    return method
