"""Page RPCs shared by SDK clients and workers copying pages from their homes."""

from __future__ import annotations

import time
from typing import Any

from tensorcast import errors
from tensorcast.proto import tensorcast_pb2 as pb


def get_all(stub: Any, keys: list[pb.PageKey], timeout_s: float) -> list[pb.Page]:
    """GetPages for every key, asking again while replies stop short (size-bounded)."""
    deadline = time.monotonic() + timeout_s
    pages: list[pb.Page] = []
    while len(pages) < len(keys):
        reply = stub.call(
            "GetPages",
            pb.PageKeys(keys=keys[len(pages) :]),
            timeout_s=max(0.001, deadline - time.monotonic()),
        )
        if not reply.served:
            raise errors.Unavailable("a page home answered without serving any page")
        pages.extend(reply.pages[: reply.served])
    return pages
