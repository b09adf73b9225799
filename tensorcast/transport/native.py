"""Python face of the C++ core (`tensorcast._native`): C++ failures become TensorcastError here."""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from typing import Any

from tensorcast.config import TLSFiles
from tensorcast.errors import InvalidArgument, TensorcastError

_native: Any = importlib.import_module("tensorcast._native")

TREE_HASH_CHUNK_BYTES: int = _native.TREE_HASH_CHUNK_BYTES
# Native classes; their errors are tensorcast.errors classes (native/include/tensorcast/errors.h).
ArenaAllocator: Any = _native.ArenaAllocator
PageIndex: Any = _native.PageIndex
PageServer: Any = _native.PageServer
PageClient: Any = _native.PageClient
MAX_PAGE_BATCH: int = _native.MAX_PAGE_BATCH  # pages per page-index request
PageDirectory: Any = _native.PageDirectory


def directory_reader(fd: int, size_bytes: int) -> Any:
    """A caller's view of a worker's page directory (DirectoryReader), or None when the
    descriptor holds no directory of this version (then every lookup asks the worker)."""
    try:
        return _native.DirectoryReader(fd, size_bytes)
    except _native.IoError:
        return None


def hash_buffer(buf: Any, threads: int = 0) -> str:
    """Tree hash v1 (XXH3-128 over 4 MiB chunks, then over the chunk digests), hex."""
    return bytes(_native.hash_buffer(buf, threads)).hex()


def hash_buffers(bufs: Sequence[Any], threads: int = 0) -> list[str]:
    """Hash many buffers in one pass over all their chunks (fast for many small tensors)."""
    return [bytes(h).hex() for h in _native.hash_buffers(list(bufs), threads)]


# (file index, file offset, length, dest offset)
FileSpan = tuple[int, int, int, int]


def read_files(
    files: Sequence[str | os.PathLike[str]],
    spans: Sequence[FileSpan],
    dest: Any,
    *,
    hash: bool = False,
    threads: int = 0,
) -> list[str] | None:
    """Parallel positional reads of file spans straight into `dest` (a writable buffer), GIL
    released. With `hash`, returns each span's tree hash, every chunk hashed by the thread that
    just read it (spans adjacent in the file and in `dest` are read as one run)."""
    try:
        digests = _native.read_files(
            [os.fspath(f) for f in files], list(spans), dest, hash, threads
        )
    except _native.ShortFileError as e:
        raise InvalidArgument(f"file shorter than declared: {e}") from None
    except _native.IoError as e:
        raise TensorcastError(f"read failed: {e}") from None
    return None if digests is None else [bytes(h).hex() for h in digests]


def read_file_into(
    path: str | os.PathLike[str],
    file_offset: int,
    length: int,
    dest: Any,
    dest_offset: int,
    threads: int = 0,
) -> None:
    """One range of one file into `dest[dest_offset:]` (read_files of a single span)."""
    read_files([path], [(0, file_offset, length, dest_offset)], dest, threads=threads)


def copy_into(dest: Any, dest_offset: int, source: Any, threads: int = 0) -> None:
    """memcpy split across threads, GIL released."""
    _native.copy_into(dest, dest_offset, source, threads)


def copy_many(dests: Sequence[Any], sources: Sequence[Any], threads: int = 0) -> None:
    """Copy each source into the start of its dest (a batch of pages), spread over threads,
    GIL released."""
    _native.copy_many(list(dests), list(sources), threads)


def copy_hash_many(dests: Sequence[Any], sources: Sequence[Any], threads: int = 0) -> list[str]:
    """copy_many that returns the tree hash of each copy (hashed right after copying, while the
    bytes are in cache): what a reader checking its copies needs, for little more than the copy."""
    return [bytes(h).hex() for h in _native.copy_hash_many(list(dests), list(sources), threads)]


def _tls_paths(tls: TLSFiles | None) -> list[str]:
    return [tls.ca, tls.cert, tls.key] if tls else []


def data_server(
    host: str, base: Any, token: str, port: int = 0, tls: TLSFiles | None = None
) -> Any:
    """The worker's native data server over `base` (its pool mapping); serves ticketed ranges.
    With `tls`, every connection is mutual TLS."""
    try:
        return _native.DataServer(host, port, base, token, tls=_tls_paths(tls))
    except ValueError as e:  # unusable TLS files
        raise InvalidArgument(f"data server: {e}") from None


def pull(
    data_addr: str,
    token: str,
    ticket: int,
    source_offset: int,
    length: int,
    dest: Any,
    dest_offset: int,
    *,
    streams: int = 0,
    timeout_s: float = 30.0,
    tls: TLSFiles | None = None,
    relay: Any = None,
    chunk_bytes: int = 0,
) -> dict:
    """Pull [source_offset, +length) of a peer's pool into `dest` over parallel TCP streams.

    Chunks are checksummed and retried on another stream; raises `DeadlineExceeded` past
    `timeout_s`, `Unavailable` when the source cannot serve (try another replica). `relay`: this
    process's DataServer, whose growing range at `dest_offset` (begin_growing) follows the
    verified prefix, so peers read it onward while it arrives (chain fan-out).
    """
    from tensorcast.errors import DeadlineExceeded, Unavailable

    host, _, port = data_addr.rpartition(":")
    try:
        return dict(
            _native.pull(
                host,
                int(port),
                token,
                ticket,
                source_offset,
                length,
                dest,
                dest_offset,
                streams=streams,
                chunk_bytes=chunk_bytes,
                timeout_ms=max(1, int(timeout_s * 1000)),
                tls=_tls_paths(tls),
                relay=relay,
                relay_offset=dest_offset,
            )
        )
    except _native.TransferTimeout as e:
        raise DeadlineExceeded(f"transfer from {data_addr} timed out: {e}") from None
    except _native.TransferError as e:
        if e.reason == "tls":
            raise Unavailable(
                f"TLS with the data server {data_addr} failed: {e}. Both ends need "
                "certificates from one CA (TC_TLS_* or STATE_DIR/tls), or both none"
            ) from None
        raise Unavailable(f"transfer from {data_addr} failed: {e}") from None


# -- KV pages at homes on other hosts (native/include/tensorcast/page_remote.h) ---------------

REMOTE_PAGE_STREAMS: int = _native.REMOTE_PAGE_STREAMS
# A home's share of a batch: its data port and the indexes of the batch's pages it holds.
RemoteHome = tuple[str, int, list[int]]
PageWanted = tuple[str, int, int]  # key, shard, token
# A page read from a remote home: size_bytes, dtype, shape, hash, its bytes (a new bytearray, or
# None when it went into the caller's buffer).
RemotePage = tuple[int, str, tuple[int, ...], str, Any]


def remote_home(data_addr: str, pages: list[int]) -> RemoteHome:
    host, _, port = data_addr.rpartition(":")
    if not host or not port.isdigit():
        raise InvalidArgument(f"bad data address {data_addr!r} (want HOST:PORT)")
    return host.strip("[]"), int(port), pages


def _home_errors(raw: list) -> list[TensorcastError | None]:
    from tensorcast.errors import error_named

    return [None if e is None else error_named(e[0], e[1]) for e in raw]


def remote_get(
    keys: Sequence[PageWanted],
    homes: Sequence[RemoteHome],
    token: str,
    *,
    into: Sequence[Any] | None = None,
    tls: TLSFiles | None = None,
    timeout_s: float = 30.0,
    streams: int = 0,
) -> tuple[list[RemotePage | None], list[TensorcastError | None]]:
    """Pages from their remote homes, every home (and several connections per home for a large
    batch) in parallel, each received straight into its `into` buffer (writable, C-contiguous)
    or a new bytearray and checked against its hash (a mismatch reads as absent). Returns the
    pages by key and, per home, the error that failed its share (its pages then read absent)."""
    pages, errs = _native.remote_get(
        list(keys),
        list(homes),
        None if into is None else list(into),
        token,
        _tls_paths(tls),
        max(1, int(timeout_s * 1000)),
        streams,
    )
    return pages, _home_errors(errs)


def remote_exists(
    keys: Sequence[PageWanted],
    homes: Sequence[RemoteHome],
    token: str,
    *,
    tls: TLSFiles | None = None,
    timeout_s: float = 30.0,
) -> tuple[list[bool], list[TensorcastError | None]]:
    found, errs = _native.remote_exists(
        list(keys), list(homes), token, _tls_paths(tls), max(1, int(timeout_s * 1000))
    )
    return found, _home_errors(errs)


def remote_put(
    pages: Sequence[tuple[str, int, int, str, tuple[int, ...]]],
    sources: Sequence[Any],
    homes: Sequence[RemoteHome],
    token: str,
    *,
    ttl_s: float,
    hashes: Sequence[str] | None = None,
    if_absent: bool = False,
    tls: TLSFiles | None = None,
    timeout_s: float = 30.0,
    streams: int = 0,
    expires_in_s: float = 0.0,
) -> tuple[list[str], list[TensorcastError | None]]:
    """Store pages (key, shard, token, dtype, shape) whose bytes are `sources` at their remote
    homes, sent straight from the caller's buffers. `hashes` (else computed here) are checked by
    the homes against the bytes they receive: a mismatch stores nothing of that request.
    `expires_in_s` (> 0, at most `ttl_s`): the pages' first lease, reads renew them for `ttl_s`
    (a page copied to a new home keeps its expiry). Returns every page's hash and, per home,
    the error that failed its share."""
    got, errs = _native.remote_put(
        [(k, s, t, d, list(sh)) for k, s, t, d, sh in pages],
        list(sources),
        list(hashes or []),
        list(homes),
        ttl_s,
        if_absent,
        token,
        _tls_paths(tls),
        max(1, int(timeout_s * 1000)),
        streams,
        expires_in_s,
    )
    return list(got), _home_errors(errs)
