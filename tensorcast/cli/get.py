"""Write an artifact's tensors out as a safetensors file (atomically: a partial file never
appears). A model directory's other files (config.json, tokenizer, ...) are not tensors and are
not written; `Artifact.files()` returns them."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tensorcast.cli.common import (
    AddrOpt,
    JsonOpt,
    StateDirOpt,
    TokenOpt,
    connect,
    emit,
    progress_bar,
)

NAME = "get"


def command(
    art_id: Annotated[str, typer.Argument(help="Artifact id.")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Destination .safetensors file.")],
    state_dir: StateDirOpt = None,
    addr: AddrOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    import os
    import time

    from tensorcast.config import format_size
    from tensorcast.errors import InvalidArgument
    from tensorcast.safetensors_file import encode_header
    from tensorcast.tensors import tensor_bytes

    # Checked before any byte moves (the temporary file goes beside the output). A symlink is
    # written through (replacing it would leave its target as it was); only regular files.
    output = output.resolve()
    if output.is_dir():
        raise InvalidArgument(f"--output {output} is a directory: name the file to write")
    if output.exists() and not output.is_file():
        raise InvalidArgument(f"--output {output} is not a regular file: name a file to write")
    parent = output.absolute().parent
    if not parent.is_dir():
        raise InvalidArgument(f"--output {output}: directory {parent} does not exist")
    with connect(state_dir, addr, token) as rt:
        started = time.perf_counter()
        art = rt.artifact(art_id)
        tensors = art.tensor_dict()
        metas = sorted(
            (t for t in art.info.tensors if t.name in tensors), key=lambda t: t.offset_bytes
        )
        size = sum(t.size_bytes for t in metas)
        tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
        try:
            with (
                progress_bar(size, f"get {art_id}", not as_json) as advance,
                open(tmp, "wb") as f,
            ):
                f.write(encode_header([(t.name, t.dtype, t.shape, t.size_bytes) for t in metas]))
                for t in metas:
                    f.write(tensor_bytes(tensors[t.name]).data)
                    if advance:
                        advance(t.size_bytes)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, output)
        finally:
            tmp.unlink(missing_ok=True)
        elapsed = time.perf_counter() - started
    emit(
        as_json,
        {
            "art_id": art_id,
            "output": str(output),
            "size_bytes": size,
            "elapsed_s": round(elapsed, 4),
        },
        f"wrote {art_id} to {output} ({format_size(size)}, {elapsed:.2f}s)",
    )
