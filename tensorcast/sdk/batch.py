"""Creating artifacts: one artifact or a batch, each batch named in ONE Global Store transaction.

Same host (the common case): small contents travel inline with the request to the local worker,
larger ones are written into regions reserved first (one more round trip, to reserve them all);
then one `put` request makes the worker commit and hash-check every content and name every
artifact with a single PutArtifacts call. A small put therefore costs one round trip to the local
worker and, from there, one to the Global Store. Contents the cluster already holds move no bytes
when they are large (one HeldContents request asks first); small ones are sent anyway (cheaper
than asking). Other hosts: contents are streamed to a remote worker one by one, then named
together (one PutArtifacts, no replicas), kept from the store's sweep of unnamed contents until
then however long the batch takes. All or nothing: a bad member changes nothing, and the
error names it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from tensorcast.errors import (
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    TensorcastError,
    Unavailable,
)
from tensorcast.proto import tensorcast_pb2 as pb
from tensorcast.rpc.convert import artifact_from_pb
from tensorcast.store.base import member
from tensorcast.types import ArtifactInfo, TensorMeta, WorkerInfo

if TYPE_CHECKING:
    from tensorcast.sdk.runtime import Progress, Runtime
    from tensorcast.sdk.writes import Filler

# A content this small travels inline with the put request (no region to reserve and map).
INLINE_ITEM_BYTES = 256 * 1024
# At most this much inline per request; larger contents go through reserved regions.
INLINE_TOTAL_BYTES = 16 * 1024 * 1024
# Writes of one batch whose held contents another caller's delete freed before they were named.
NAME_ATTEMPTS = 4


@dataclass(frozen=True)
class Spec:
    """An artifact to create and how to produce its content's bytes."""

    art_id: str
    owner: str
    ttl_s: float
    metas: list[TensorMeta]  # with hashes when the caller computed them (checked by the worker)
    size_bytes: int
    fill: Filler  # writes the content's bytes at dest[base:]
    content_id: str | None = None  # known before writing (tensors: from their hashes)
    parent: str = ""
    on_written: Callable[[str], None] | None = None  # told the content id once it is written


def tensor_specs(items: Sequence[tuple[str, Any]], owner: str, ttl_s: float) -> list[Spec]:
    """Specs for (art_id, {name: tensor}) pairs: layouts, and every tensor's hash computed in
    one native pass over all of them (the content ids follow from the hashes)."""
    from tensorcast import tensors as tmod
    from tensorcast.identity import content_id
    from tensorcast.sdk import writes
    from tensorcast.transport import native
    from tensorcast.types import pack_layout

    layouts = []
    sources: list[Any] = []
    for i, (art_id, tensors) in enumerate(items):
        try:
            checked = tmod.check_tensors(tensors)
            metas, size = pack_layout(
                [(n, tmod.dtype_name(t.dtype), tuple(t.shape)) for n, t in checked]
            )
            buffers = [tmod.tensor_bytes(t) for _, t in checked]
        except InvalidArgument as e:  # which member, when several share tensor names
            raise InvalidArgument(f"{member(i, art_id, len(items))}: {e}") from None
        layouts.append((metas, size, buffers))
        sources += buffers
    hashes = iter(native.hash_buffers(sources))
    specs = []
    for (art_id, _), (metas, size, buffers) in zip(items, layouts):
        metas = [replace(m, hash_hex=next(hashes)) for m in metas]
        specs.append(
            Spec(
                art_id,
                owner,
                ttl_s,
                metas,
                size,
                writes.buffer_filler(metas, buffers),
                content_id(metas),
            )
        )
    return specs


def put_batch(
    runtime: Runtime,
    specs: list[Spec],
    worker: str | None,
    progress: Progress | None = None,
    brief: bool = False,
) -> list[ArtifactInfo]:
    """Create every artifact of `specs` or none (see the module's docstring). `brief`: the
    caller needs no ArtifactInfo back (returns []), so neither the store nor the worker build
    them (a 700-tensor publish's answer is most of its metadata work otherwise)."""
    assert not (brief and any(s.on_written for s in specs)), "on_written needs the infos"
    if not specs:
        return []
    use_held = True
    for attempt in range(NAME_ATTEMPTS):
        targets = runtime.cached_write_targets(worker)
        held = _held(runtime, specs) if use_held else set()
        try:
            infos = _put_once(runtime, specs, targets, held, progress, brief)
            return [] if brief else infos
        except NotFound:
            # A content the cluster held was freed (another caller deleted its last name)
            # before this batch named it: write every content this time.
            if not held or attempt == NAME_ATTEMPTS - 1:
                raise
            use_held = False
        except Unavailable:
            if attempt == NAME_ATTEMPTS - 1:
                raise
            runtime.forget_workers()  # a worker we knew went away: list them again
    raise AssertionError("unreachable")


def _held(runtime: Runtime, specs: list[Spec]) -> set[str]:
    """Which large contents the cluster holds already (their bytes need not move)."""
    big = [s.content_id for s in specs if s.content_id and s.size_bytes > INLINE_ITEM_BYTES]
    if not big:
        return set()
    reply = runtime.store.call("HeldContents", pb.HeldContentsRequest(content_ids=big))
    return set(reply.content_ids)


def _put_once(
    runtime: Runtime,
    specs: list[Spec],
    targets: list[WorkerInfo],
    held: set[str],
    progress: Progress | None,
    brief: bool,
) -> list[ArtifactInfo]:
    last_error: TensorcastError | None = None
    for target in targets:
        try:
            if runtime.is_local(target):
                return _put_local(runtime, target, specs, held, progress, brief)
            return _put_remote(runtime, target, specs, held, progress)
        except ResourceExhausted as e:
            last_error = e  # this worker is full: try the next one
    assert last_error is not None
    raise last_error


def _put_local(
    runtime: Runtime,
    worker: WorkerInfo,
    specs: list[Spec],
    held: set[str],
    progress: Progress | None,
    brief: bool,
) -> list[ArtifactInfo]:
    conn = runtime.local_connection(worker)
    items: list[dict[str, Any]] = []
    inline: list[tuple[Spec, int]] = []
    reserved: list[tuple[Spec, dict[str, Any]]] = []
    inline_bytes = 0
    for spec in specs:
        item: dict[str, Any] = {"art_id": spec.art_id, "owner": spec.owner}
        if spec.ttl_s:
            item["ttl_s"] = spec.ttl_s
        if spec.parent:
            item["parent"] = spec.parent
        if spec.content_id is not None and spec.content_id in held:
            item["content_id"] = spec.content_id
        else:
            item["tensors"] = [t.to_json() for t in spec.metas]
            if (
                spec.size_bytes <= INLINE_ITEM_BYTES
                and inline_bytes + spec.size_bytes <= INLINE_TOTAL_BYTES
            ):
                item["blob_offset"] = inline_bytes
                item["size_bytes"] = spec.size_bytes
                inline.append((spec, inline_bytes))
                inline_bytes += spec.size_bytes
            else:
                reserved.append((spec, item))
        items.append(item)
    blob = bytearray(inline_bytes) if inline else None
    for spec, offset in inline:
        spec.fill(blob, offset, progress)
    if reserved:
        reply = conn.request({"op": "reserve_many", "sizes": [s.size_bytes for s, _ in reserved]})
        regions = reply["reservations"]
        try:
            for (spec, item), (reservation_id, offset) in zip(reserved, regions):
                item["reservation_id"] = reservation_id
                mm, base = conn.map(offset, spec.size_bytes, writable=True)
                try:
                    spec.fill(mm, base, progress)
                finally:
                    mm.close()
        except BaseException:
            for reservation_id, _ in regions:
                try:
                    conn.request({"op": "abort", "reservation_id": reservation_id})
                except TensorcastError:
                    pass  # the connection is gone: the worker aborted them already
            raise
    message: dict[str, Any] = {"op": "put", "items": items}
    if brief:
        message["brief"] = True
    reply = conn.request(message, blob=blob)
    infos = [ArtifactInfo.from_wire(a) for a in reply["artifacts"]]
    _tell_written(specs, infos)
    return infos


def _put_remote(
    runtime: Runtime,
    worker: WorkerInfo,
    specs: list[Spec],
    held: set[str],
    progress: Progress | None,
) -> list[ArtifactInfo]:
    """No worker on this host: stream each content to `worker` (it registers the replica),
    then name them all in one transaction."""
    from tensorcast.sdk import writes

    content_ids: list[str] = []
    with _kept_unnamed(runtime, content_ids):
        for spec in specs:
            if spec.content_id is not None and spec.content_id in held:
                content_ids.append(spec.content_id)
                continue
            committed = writes.write_remote(
                runtime, worker, spec.metas, spec.size_bytes, spec.fill, progress
            )
            content_ids.append(committed.content_id)
        infos = name_batch(runtime, specs, content_ids)
    _tell_written(specs, infos)
    return infos


@contextlib.contextmanager
def _kept_unnamed(runtime: Runtime, content_ids: list[str]) -> Iterator[None]:
    """While the body runs, keep the contents in `content_ids` (written so far, named by no
    artifact until the batch is named at the end) from the store's unreferenced sweep: a batch
    taking longer than its grace would lose its first contents and fail. A background thread
    marks them new again every quarter of the grace (the store's reply says how long it is)."""
    stop = threading.Event()

    def keep() -> None:
        every = 1.0  # a batch done sooner asks nothing; the store's reply gives the grace
        while not stop.wait(every):
            try:
                reply = runtime.store.call(
                    "HeldContents",
                    pb.HeldContentsRequest(content_ids=list(content_ids), touch=True),
                )
                every = max(0.1, reply.unreferenced_grace_s / 4)
            except TensorcastError:
                every = 1.0  # the store is away: try again (the put itself will say)

    thread = threading.Thread(target=keep, name="tc-keep-unnamed", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(runtime.timeout_s)


def name_batch(
    runtime: Runtime, specs: Sequence[Spec], content_ids: Sequence[str]
) -> list[ArtifactInfo]:
    """Create artifacts naming contents the cluster holds: one PutArtifacts, no replicas."""
    reply = runtime.store.call(
        "PutArtifacts",
        pb.PutArtifactsRequest(
            artifacts=[
                pb.NewArtifact(
                    art_id=s.art_id,
                    content_id=c,
                    owner=s.owner,
                    ttl_s=s.ttl_s,
                    parent=s.parent,
                )
                for s, c in zip(specs, content_ids)
            ]
        ),
        timeout_s=max(runtime.timeout_s, 0.01 * len(specs)),
    )
    return [artifact_from_pb(a) for a in reply.artifacts]


def _tell_written(specs: list[Spec], infos: list[ArtifactInfo]) -> None:
    for spec, info in zip(specs, infos):
        if spec.on_written is not None:
            spec.on_written(info.content_id)
