"""Prometheus metrics and health over plain HTTP (`/metrics`, `/healthz`), with no dependency.

Processes record RPC latencies into the process-wide `RPC_LATENCY` histogram; gauges are
collected on each scrape by a callback, so nothing is computed when nobody asks.
"""

from __future__ import annotations

import bisect
import json
import threading
from collections.abc import Callable

Sample = tuple[str, dict[str, str], float]  # name, labels, value

MAX_SCRAPES = 16  # connections served at once; more are closed unanswered
SCRAPE_TIMEOUT_S = 10.0
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name = name
        self.help_text = help_text
        self.buckets = buckets
        # label value -> a count per bucket and one for +Inf, then sum, then count
        self._series: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def observe(self, label: str, value: float) -> None:
        with self._lock:
            series = self._series.setdefault(label, [0.0] * (len(self.buckets) + 3))
            series[bisect.bisect_left(self.buckets, value)] += 1
            series[-2] += value
            series[-1] += 1

    def render(self, label_name: str) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        with self._lock:
            items = sorted((k, list(v)) for k, v in self._series.items())
        for label, series in items:
            cumulative = 0.0
            for bound, count in zip((*self.buckets, float("inf")), series[:-2]):
                cumulative += count
                le = "+Inf" if bound == float("inf") else repr(bound)
                labels = _labels({label_name: label, "le": le})
                lines.append(f"{self.name}_bucket{labels} {_fmt(cumulative)}")
            labels = _labels({label_name: label})
            lines.append(f"{self.name}_sum{labels} {_fmt(series[-2])}")
            lines.append(f"{self.name}_count{labels} {_fmt(series[-1])}")
        return lines


RPC_LATENCY = Histogram(
    "tc_rpc_duration_seconds", "gRPC handling time by method", LATENCY_BUCKETS_S
)


def rpc_counts(metrics_text: str) -> dict[str, float]:
    """Requests served per method, read back from a /metrics page (RPC_LATENCY's counts)."""
    prefix = f'{RPC_LATENCY.name}_count{{method="'
    counts = {}
    for line in metrics_text.splitlines():
        if line.startswith(prefix):
            method, _, value = line[len(prefix) :].partition('"} ')
            counts[method] = float(value)
    return counts


def _fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _escape(value: str) -> str:
    """A label value as the text format writes it: backslash, quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def render(samples: list[Sample], help_texts: dict[str, str]) -> str:
    """The text format: each metric's samples together under its HELP and TYPE (the format
    forbids a metric's lines in separate groups), metrics in order of first appearance."""
    by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
    for name, labels, value in samples:
        by_name.setdefault(name, []).append((labels, value))
    lines = []
    for name, series in by_name.items():
        lines.append(f"# HELP {name} {help_texts.get(name, name)}")
        lines.append(f"# TYPE {name} {'counter' if name.endswith('_total') else 'gauge'}")
        lines += [
            f"{name}{_labels(dict(sorted(labels.items())))} {_fmt(v)}" for labels, v in series
        ]
    lines += RPC_LATENCY.render("method")
    return "\n".join(lines) + "\n"


class MetricsServer:
    """Serves /metrics (Prometheus text format) and /healthz (JSON; 200 healthy, 503 not)."""

    def __init__(
        self,
        listen: str,
        collect: Callable[[], list[Sample]],
        help_texts: dict[str, str],
        health: Callable[[], tuple[bool, dict]],
    ) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer  # servers only

        host, _, port = listen.rpartition(":")

        scrapes = threading.BoundedSemaphore(MAX_SCRAPES)

        class Handler(BaseHTTPRequestHandler):
            timeout = SCRAPE_TIMEOUT_S  # a client that stalls lets go of its thread

            def handle(self) -> None:
                if not scrapes.acquire(blocking=False):  # bounded threads, whoever connects
                    return
                try:
                    super().handle()
                finally:
                    scrapes.release()

            def do_GET(self) -> None:
                try:
                    if self.path == "/metrics":
                        body = render(collect(), help_texts).encode()
                        self._reply(200, "text/plain; version=0.0.4", body)
                    elif self.path == "/healthz":
                        ok, detail = health()
                        self._reply(
                            200 if ok else 503,
                            "application/json",
                            json.dumps({"ok": ok, **detail}).encode(),
                        )
                    else:
                        self._reply(404, "text/plain", b"not found: try /metrics or /healthz\n")
                except Exception as e:  # a scrape that fails says so (it closed silently)
                    failure = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                    self._reply(503, "application/json", json.dumps(failure).encode())

            def _reply(self, code: int, content_type: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass  # scrapes are not worth a log line each

        self.httpd = ThreadingHTTPServer((host, int(port)), Handler)
        self.httpd.daemon_threads = True
        self.addr = f"{host}:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, name="metrics", daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
