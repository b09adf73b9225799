"""`tc top`: workers, artifacts, engine instances, KV shards and recent plans of a cluster, live.
Reads through a `Source`, so it runs against any cluster address (and against fixed data in
snapshot tests)."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any, Protocol

from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.markup import escape
from textual.screen import ModalScreen
from textual.widgets import (
    DataTable,
    Footer,
    Header,
    Input,
    Label,
    Static,
    TabbedContent,
    TabPane,
)

from tensorcast.config import format_size
from tensorcast.tui.snapshot import ClusterSnapshot, RateHistory
from tensorcast.types import ArtifactInfo

COLUMNS = {
    "workers": ("NAME", "ROLES", "MEMORY", "REPLICAS", "RATE", "TREND", "HEARTBEAT", "HEALTH"),
    "artifacts": ("ID", "SIZE", "TENSORS", "OWNER", "EXPIRES", "REPLICAS", "PINNED ON"),
    "instances": (
        "ID",
        "ENGINE",
        "WORKER",
        "ENDPOINT",
        "WAITING",
        "RUNNING",
        "CACHED TOKENS",
        "REQUESTS",
        "HEARTBEAT",
        "HEALTH",
    ),
    "shards": ("SHARD", "HOME", "TOKEN", "LEASE LEFT", "STATE"),
    "plans": ("TRACE", "KEY", "STATUS", "STARTED", "DURATION", "STEPS", "ERROR"),
}
TITLES = {
    "workers": "Workers [1]",
    "artifacts": "Artifacts [2]",
    "instances": "Instances [3]",
    "shards": "Shards [4]",
    "plans": "Plans [5]",
}
# Shown when `tc top --router HOST:PORT` names a running router (tc router start).
ROUTER_COLUMNS = {
    "router": ("INSTANCE", "IN FLIGHT", "REPORTED", "EWMA LOAD", "SESSIONS", "ROUTED"),
    "migrations": ("SESSION", "FROM", "TO", "STATUS", "BYTES", "TIME", "AGE", "KEY"),
}
ROUTER_TITLES = {"router": "Router [6]", "migrations": "Migrations [7]"}


class Source(Protocol):
    """Where `tc top` gets data and sends operations; errors are raised as TensorcastError."""

    def fetch(self) -> ClusterSnapshot: ...
    def pin(self, art_id: str, worker: str) -> None: ...
    def unpin(self, art_id: str, worker: str) -> None: ...
    def prefetch(self, art_id: str, worker: str) -> None: ...


class ConfirmWorker(ModalScreen[str | None]):
    """Asks which worker an operation targets; Enter confirms, Escape cancels."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel")]

    def __init__(self, prompt: str, default: str) -> None:
        super().__init__()
        self.prompt = prompt
        self.default = default

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(escape(self.prompt))
            yield Input(value=self.default, placeholder="worker name", id="worker")
            yield Label("Enter to confirm, Escape to cancel", classes="hint")

    @on(Input.Submitted)
    def confirm(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)


class ArtifactDetail(ModalScreen[None]):
    BINDINGS = [Binding("escape", "dismiss", "Close"), Binding("enter", "dismiss", "Close")]

    def __init__(self, info: ArtifactInfo, names: dict[str, str]) -> None:
        super().__init__()
        self.info = info
        self.names = names

    def compose(self) -> ComposeResult:
        a = self.info
        names = self.names
        replicas = ", ".join(
            f"{names.get(r.worker_id, r.worker_id)} ({r.tier}{', pinned' if r.pinned else ''})"
            for r in a.replicas
        )
        with Vertical(id="dialog"):
            # Names are anyone's text: never markup (a "[/]" in one closed nothing and
            # crashed tc top).
            yield Label(
                f"[b]{escape(a.art_id)}[/b]  {format_size(a.size_bytes)}, owner {escape(a.owner)}"
            )
            yield Label(f"content {a.content_id}")
            yield Label(f"replicas: {escape(replicas or 'none live')}")
            table: DataTable = DataTable(id="tensors", cursor_type="row")
            table.add_columns("TENSOR", "DTYPE", "SHAPE", "BYTES")
            for t in a.tensors[:500]:
                table.add_row(
                    Text(t.name), t.dtype, "x".join(map(str, t.shape)) or "()", str(t.size_bytes)
                )
            yield table


class TopApp(App[None]):
    TITLE = "tc top"
    CSS = """
    #banner { background: $error; color: $text; padding: 0 1; display: none; }
    #banner.visible { display: block; }
    #status { color: $text-muted; padding: 0 1; }
    #filter { display: none; }
    #filter.visible { display: block; }
    ConfirmWorker, ArtifactDetail { align: center middle; }
    #dialog { width: 80%; height: auto; max-height: 80%; border: thick $primary;
              background: $surface; padding: 1 2; }
    .hint { color: $text-muted; }
    """
    BINDINGS = [
        Binding("1", "show('workers')", "Workers"),
        Binding("2", "show('artifacts')", "Artifacts"),
        Binding("3", "show('instances')", "Instances"),
        Binding("4", "show('shards')", "Shards"),
        Binding("5", "show('plans')", "Plans"),
        Binding("6", "show('router')", "Router", show=False),
        Binding("7", "show('migrations')", "Migrations", show=False),
        Binding("s", "sort", "Sort"),
        Binding("slash", "filter", "Filter"),
        Binding("enter", "detail", "Detail", show=False),
        Binding("p", "operate('pin')", "Pin"),
        Binding("u", "operate('unpin')", "Unpin"),
        Binding("f", "operate('prefetch')", "Prefetch"),
        Binding("r", "refresh", "Refresh"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(
        self,
        source: Source,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        show_router: bool = False,
    ) -> None:
        super().__init__()
        self.source = source
        self.interval_s = interval_s
        self.clock = clock
        self.snapshot = ClusterSnapshot(taken_at=0.0)
        self.rates = RateHistory()
        self.show_router = show_router
        self.columns = {**COLUMNS, **(ROUTER_COLUMNS if show_router else {})}
        self.titles = {**TITLES, **(ROUTER_TITLES if show_router else {})}
        self.sort_column = dict.fromkeys(self.columns, 0)
        self.sort_column["plans"] = COLUMNS["plans"].index("STARTED")  # most recent first
        if show_router:
            self.sort_column["migrations"] = ROUTER_COLUMNS["migrations"].index("AGE")
        self.filter_text = ""

    def compose(self) -> ComposeResult:
        yield Header()
        yield Static("", id="banner")
        yield Input(placeholder="filter (Enter to apply, empty to clear)", id="filter")
        with TabbedContent(initial="workers"):
            for view, title in self.titles.items():
                with TabPane(title, id=view):
                    yield DataTable(id=f"{view}-table", cursor_type="row", zebra_stripes=True)
        yield Static("connecting...", id="status")
        yield Footer()

    def on_mount(self) -> None:
        # Kept, not queried later: while a dialog is open, queries search the dialog's screen.
        self.banner = self.query_one("#banner", Static)
        self.status = self.query_one("#status", Static)
        self.filter_box = self.query_one("#filter", Input)
        self.tabs = self.query_one(TabbedContent)
        self.tables = {view: self.query_one(f"#{view}-table", DataTable) for view in self.columns}
        for view, columns in self.columns.items():
            self.tables[view].add_columns(*columns)
        self.tables["workers"].focus()
        self.action_refresh()
        self.set_interval(self.interval_s, self.action_refresh)

    # -- data ----------------------------------------------------------------------------------

    @work(thread=True, exclusive=True, group="fetch")
    def action_refresh(self) -> None:
        try:
            snapshot = self.source.fetch()
        except Exception as e:
            snapshot = ClusterSnapshot(taken_at=self.clock(), error=str(e).splitlines()[0])
        self.call_from_thread(self.apply, snapshot)

    def apply(self, snapshot: ClusterSnapshot) -> None:
        banner = self.banner
        if snapshot.error:
            banner.update(
                f"cluster unreachable: {escape(snapshot.error)} (retrying every "
                f"{self.interval_s:g}s; showing the last data)"
            )
            banner.add_class("visible")
            return
        banner.remove_class("visible")
        self.snapshot = snapshot
        self.rates.add(snapshot)
        self.render_tables()

    def render_tables(self) -> None:
        s = self.snapshot
        names = {w.worker_id: w.name for w in s.workers}
        replicas: dict[str, int] = {}
        for a in s.artifacts:
            for r in a.replicas:
                replicas[r.worker_id] = replicas.get(r.worker_id, 0) + 1
        rows = []
        for w in s.workers:
            health = "healthy" if w.alive else "dead"
            rate = self.rates.latest(w.worker_id)
            rows.append(
                (
                    w.worker_id,
                    [
                        w.name,
                        ",".join(w.roles),
                        f"{format_size(w.mem_used_bytes)} / {format_size(w.mem_cap_bytes)}"
                        + (f" +disk {format_size(w.disk_used_bytes)}" if w.disk_used_bytes else ""),
                        str(replicas.get(w.worker_id, 0)),
                        f"{rate / 1e6:.1f} MB/s",
                        self.rates.sparkline(w.worker_id),
                        f"{w.heartbeat_age_s:.1f}s",
                        health,
                    ],
                )
            )
        self._fill("workers", rows)
        now = self.clock()
        rows = []
        for a in s.artifacts:
            pinned = ",".join(names.get(r.worker_id, "?") for r in a.replicas if r.pinned)
            rows.append(
                (
                    a.art_id,
                    [
                        a.art_id,
                        format_size(a.size_bytes),
                        str(len(a.tensors)),
                        a.owner,
                        f"{a.expires_at - now:.0f}s" if a.expires_at else "-",
                        str(len(a.replicas)) if a.replicas else "0 lost",
                        pinned or "-",
                    ],
                )
            )
        self._fill("artifacts", rows)
        self._fill("instances", self._instance_rows(names))
        self._fill("shards", self._shard_rows(names))
        self._fill("plans", self._plan_rows())
        if self.show_router:
            self._fill("router", self._router_rows())
            self._fill("migrations", self._migration_rows())
        alive = sum(w.alive for w in s.workers)
        self.status.update(
            f"store {escape(s.store_addr)} | {alive}/{len(s.workers)} workers alive | "
            f"{len(s.artifacts)} artifacts | {len(s.instances)} instances | "
            + (_router_status(s.router) if self.show_router else "")
            + f"filter: {escape(self.filter_text or '-')}"
        )

    def _instance_rows(self, names: dict[str, str]) -> list[tuple[str, list[str]]]:
        return [
            (
                i.instance_id,
                [
                    i.instance_id,
                    i.engine,
                    i.worker_name or names.get(i.worker_id, i.worker_id),
                    i.endpoint or "-",
                    str(i.waiting),
                    str(i.running),
                    str(i.cached_tokens),
                    str(len(i.requests)),
                    f"{i.heartbeat_age_s:.1f}s",
                    "healthy" if i.alive else "dead",
                ],
            )
            for i in self.snapshot.instances
        ]

    def _shard_rows(self, names: dict[str, str]) -> list[tuple[str, list[str]]]:
        table = self.snapshot.shards
        if table is None:
            return []
        return [
            (
                str(lease.shard),
                [
                    str(lease.shard),
                    names.get(lease.holder_worker_id, lease.holder_worker_id or "-"),
                    str(lease.token),
                    f"{lease.expires_in_s:.1f}s" if lease.held else "-",
                    "held" if lease.held else "free",
                ],
            )
            for lease in table.leases
        ]

    def _plan_rows(self) -> list[tuple[str, list[str]]]:
        now = self.clock()
        return [
            (
                p.idempotency_key,  # unique; trace ids are chosen by callers and may repeat
                [
                    p.trace_id,
                    p.idempotency_key,
                    p.status,
                    f"{now - p.created_at:.0f}s ago",
                    f"{p.finished_at - p.created_at:.3f}s" if p.finished_at else "-",
                    str(len(p.result.get("steps", []))),
                    (p.result.get("error") or {}).get("kind", ""),
                ],
            )
            for p in self.snapshot.plans
        ]

    def _router_rows(self) -> list[tuple[str, list[str]]]:
        router = self.snapshot.router or {}
        return [
            (
                i["instance_id"],
                [
                    i["instance_id"],
                    str(i["inflight"]),
                    f"{i['reported_waiting']}+{i['reported_running']}",
                    f"{i['ewma_load']:.2f}",
                    str(i["sessions"]),
                    str(i["routed"]),
                ],
            )
            for i in router.get("instances", [])
        ]

    def _migration_rows(self) -> list[tuple[str, list[str]]]:
        router = self.snapshot.router or {}
        now = self.clock()
        return [
            (
                f"{m.get('key', '')}#{n}",
                [
                    m["req_id"],
                    m["source"],
                    m["target"],
                    m.get("status", "?"),
                    format_size(int(m.get("bytes", 0))),
                    f"{m.get('duration_s', 0.0):.3f}s",
                    f"{max(0.0, now - m.get('at', now)):.0f}s ago",
                    m.get("key", ""),
                ],
            )
            for n, m in enumerate(router.get("migrations", []))
        ]

    def _fill(self, view: str, rows: list[tuple[str, list[str]]]) -> None:
        table = self.tables[view]
        if self.filter_text:
            rows = [r for r in rows if any(self.filter_text in c for c in r[1])]
        column = self.sort_column[view]
        rows.sort(key=lambda r: _sort_key(r[1][column]))
        selected = self._selected_key(table)
        table.clear()
        for key, cells in rows:
            table.add_row(*(Text(c) for c in cells), key=key)  # text, never markup
        if selected is not None:
            for i, (key, _) in enumerate(rows):
                if key == selected:
                    table.move_cursor(row=i)

    @staticmethod
    def _selected_key(table: DataTable) -> str | None:
        if table.row_count == 0:
            return None
        return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value

    # -- actions -------------------------------------------------------------------------------

    def _view(self) -> str:
        return self.tabs.active or "workers"

    def action_show(self, view: str) -> None:
        if view not in self.tables:
            self.notify("no router view: start tc top with --router HOST:PORT", severity="warning")
            return
        self.tabs.active = view
        self.tables[view].focus()

    def action_sort(self) -> None:
        view = self._view()
        columns = self.columns[view]
        self.sort_column[view] = (self.sort_column[view] + 1) % len(columns)
        self.notify(f"sorted by {columns[self.sort_column[view]]}")
        self.render_tables()

    def action_filter(self) -> None:
        self.filter_box.add_class("visible")
        self.filter_box.focus()

    @on(Input.Submitted, "#filter")
    def apply_filter(self, event: Input.Submitted) -> None:
        self.filter_text = event.value.strip()
        event.input.remove_class("visible")
        self.tables[self._view()].focus()
        self.render_tables()

    def _selected_artifact(self) -> ArtifactInfo | None:
        if self._view() != "artifacts":
            self.notify("select an artifact first (press 2)", severity="warning")
            return None
        key = self._selected_key(self.tables["artifacts"])
        return next((a for a in self.snapshot.artifacts if a.art_id == key), None)

    def action_detail(self) -> None:
        info = self._selected_artifact()
        if info is not None:
            names = {w.worker_id: w.name for w in self.snapshot.workers}
            self.push_screen(ArtifactDetail(info, names))

    def action_operate(self, operation: str) -> None:
        info = self._selected_artifact()
        if info is None:
            return
        default = next((w.name for w in self.snapshot.workers if w.alive), "")
        prompt = f"{operation} {info.art_id} on which worker?"

        def run(worker: str | None) -> None:
            if worker:
                self._operate(operation, info.art_id, worker)

        self.push_screen(ConfirmWorker(prompt, default), run)

    @work(thread=True, group="operations")
    def _operate(self, operation: str, art_id: str, worker: str) -> None:
        try:
            getattr(self.source, operation)(art_id, worker)
        except Exception as e:
            self.call_from_thread(self.notify, escape(f"{operation} failed: {e}"), severity="error")
            return
        self.call_from_thread(self.notify, escape(f"{operation} {art_id} on {worker}: done"))
        self.call_from_thread(self.action_refresh)


_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_NUMBER = re.compile(r"(\d+(?:\.\d+)?)(s)?(?: (B|KiB|MiB|GiB|TiB)\b)?")


def _sort_key(cell: str) -> tuple[int, float, str]:
    """Cells that start with a number ("12", "0.4s", "3s ago", "1.5 GiB / 8.0 GiB") in numeric
    order, sizes by their unit, before any text."""
    match = _NUMBER.match(cell)
    if match is None:
        return (1, 0.0, cell)
    return (0, float(match.group(1)) * _UNITS.get(match.group(3) or "B", 1), cell)


def _router_status(router: dict | None) -> str:
    if not router:
        return "router: - | "
    if "error" in router:
        return f"router unreachable: {escape(str(router['error']))} | "
    return (
        f"router {router.get('policy')}: {router.get('sessions', 0)} sessions, "
        f"{router.get('migrations_ok', 0)} migrations, "
        f"{format_size(int(router.get('migrated_bytes', 0)))} moved | "
    )


class SdkSource:
    """The real source: a Runtime, reconnected after any failure (store restarts, etc.)."""

    def __init__(self, connect: Callable[[], object], router: str | None = None) -> None:
        self._connect = connect
        self._rt: Any = None
        self.router = router

    def _runtime(self):
        if self._rt is None:
            self._rt = self._connect()
        return self._rt

    def _call(self, fn):
        try:
            return fn(self._runtime())
        except Exception:
            rt, self._rt = self._rt, None
            if rt is not None:
                rt.close()  # type: ignore[attr-defined]
            raise

    def fetch(self) -> ClusterSnapshot:
        from dataclasses import replace

        from tensorcast.tui.snapshot import fetch

        snapshot = self._call(fetch)
        if self.router is None:
            return snapshot
        from tensorcast.engine.server import engine_request

        try:
            state = engine_request(self.router, "GET", "/router/state", timeout_s=5.0)
        except Exception as e:  # the cluster view stays; the router row says why
            state = {"error": str(e).splitlines()[0]}
        return replace(snapshot, router=state)

    def pin(self, art_id: str, worker: str) -> None:
        self._call(lambda rt: rt.artifact(art_id).pin(worker))

    def unpin(self, art_id: str, worker: str) -> None:
        self._call(lambda rt: rt.artifact(art_id).unpin(worker))

    def prefetch(self, art_id: str, worker: str) -> None:
        self._call(lambda rt: rt.artifact(art_id).prefetch(worker))
