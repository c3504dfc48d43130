"""The model manager: installed models (with the weight formats installed: GGUF, and MLX where pulled or
converted), the catalog with fit verdicts, pull with progress, delete, the default model; and the
hardware view."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, DataTable, Footer, Input, Label, Markdown, ProgressBar, Static

from .backend_adapter import CatalogRow, ModelRow, PullUpdate, human_size

if TYPE_CHECKING:
    from .app import LocalLLMApp


class ModelsScreen(Screen):
    """Installed models and the catalog; pull, cancel, delete, set default."""

    BINDINGS = [
        Binding("p", "pull", "Pull", id="models.pull"),
        Binding("x", "cancel_pull", "Cancel pull", id="models.cancel"),
        Binding("d,delete", "delete", "Delete", id="models.delete"),
        Binding("s", "set_default", "Set default", id="models.default"),
        Binding("r", "refresh", "Refresh", id="models.refresh"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.installed: list[ModelRow] = []
        self.catalog: list[CatalogRow] = []
        self.pull_cancel: threading.Event | None = None
        self.pulling: str | None = None
        self.last_pull: PullUpdate | None = None
        self.loaded_once = threading.Event()

    @property
    def lapp(self) -> LocalLLMApp:
        return self.app  # type: ignore[return-value]

    def compose(self) -> ComposeResult:
        with Vertical(id="models-pane"):
            yield Label("Installed models", classes="title")
            yield DataTable(id="installed", cursor_type="row", zebra_stripes=True)
            yield Label("Catalog (verdicts for this machine)", classes="title")
            yield DataTable(id="catalog", cursor_type="row", zebra_stripes=True)
            with Horizontal(id="pull-bar"):
                yield Input(placeholder="model to pull, e.g. smollm2:135m", id="pull-name")
                yield Button("Pull", id="pull-button", variant="primary")
                yield Button("Cancel", id="cancel-button")
            with Horizontal(id="pull-progress-row"):
                yield ProgressBar(id="pull-progress", total=None, show_eta=False)
                yield Static("", id="pull-status")
        yield Footer()

    def on_mount(self) -> None:
        inst = self.query_one("#installed", DataTable)
        inst.add_columns("Name", "Size", "Quant", "Backend", "Fit here", "Loaded", "Default", "Formats")
        cat = self.query_one("#catalog", DataTable)
        cat.add_columns("Name", "Size", "Fit here", "Draft", "Installed", "Description")
        self.query_one("#pull-progress-row").display = False
        self.action_refresh()

    def on_screen_resume(self) -> None:
        if self.loaded_once.is_set() and not self.pulling:
            self.action_refresh()  # loaded models and installs may have changed on another screen

    # ------------------------------------------------------------------ data

    def action_refresh(self) -> None:
        self.load_rows()

    @work(thread=True, exclusive=True, group="models-refresh")
    def load_rows(self) -> None:
        try:
            backend = self.lapp.backend
            installed = backend.models()
            catalog = backend.catalog()
        except Exception as e:  # noqa: BLE001 - shown, not raised
            self.app.call_from_thread(self.notify, f"Could not list models: {e}", severity="error")
            return
        self.app.call_from_thread(self.show_rows, installed, catalog)

    def show_rows(self, installed: list[ModelRow], catalog: list[CatalogRow]) -> None:
        self.installed, self.catalog = installed, catalog
        default = self.lapp.default_model_name()
        inst = self.query_one("#installed", DataTable)
        inst.clear()
        for m in installed:
            inst.add_row(m.name, human_size(m.size), m.quantization or "-", m.backend or "-", m.verdict or "-",
                         "yes" if m.loaded else "", "*" if m.name == default else "", m.formats or "GGUF", key=m.name)
        cat = self.query_one("#catalog", DataTable)
        cat.clear()
        for c in catalog:
            cat.add_row(c.name, human_size(c.size), c.verdict or "-", c.draft or "", "yes" if c.installed else "",
                        c.description, key=c.name)
        self.loaded_once.set()

    def _selected(self, table_id: str) -> str | None:
        table = self.query_one(f"#{table_id}", DataTable)
        if table.row_count == 0:
            return None
        try:
            key, _ = table.coordinate_to_cell_key(table.cursor_coordinate)
        except Exception:  # noqa: BLE001
            return None
        return str(key.value)

    # ------------------------------------------------------------------ pull

    def action_pull(self, name: str | None = None) -> None:
        name = name or self.query_one("#pull-name", Input).value.strip()
        if not name:
            focused = self.focused
            table = "installed" if focused is not None and focused.id == "installed" else "catalog"
            name = self._selected(table)
        if not name:
            self.notify("Type a model name or pick one in the catalog.", severity="warning")
            return
        if self.pulling:
            self.notify(f"Already pulling {self.pulling}; x cancels it.", severity="warning")
            return
        self.pulling = name
        self.pull_cancel = threading.Event()
        self.query_one("#pull-progress-row").display = True
        bar = self.query_one("#pull-progress", ProgressBar)
        bar.update(total=None, progress=0)
        self.query_one("#pull-status", Static).update(f"{name}: starting…")
        self.run_pull(name, self.pull_cancel)

    @work(thread=True, group="pull")
    def run_pull(self, name: str, cancel: threading.Event) -> None:
        def progress(update: PullUpdate) -> None:
            self.app.call_from_thread(self.show_progress, name, update)

        error: str | None = None
        try:
            self.lapp.backend.pull(name, progress, cancel)
        except Exception as e:  # noqa: BLE001 - one sentence to the user
            error = str(e) or type(e).__name__
        self.app.call_from_thread(self.pull_finished, name, error, cancel.is_set())

    def show_progress(self, name: str, update: PullUpdate) -> None:
        self.last_pull = update
        bar = self.query_one("#pull-progress", ProgressBar)
        if update.total:
            bar.update(total=update.total, progress=update.completed)
            text = f"{name}: {update.status} {human_size(update.completed)} / {human_size(update.total)}"
        else:
            text = f"{name}: {update.status}"
        self.query_one("#pull-status", Static).update(text)

    def pull_finished(self, name: str, error: str | None, cancelled: bool) -> None:
        self.pulling = None
        self.pull_cancel = None
        status = self.query_one("#pull-status", Static)
        if cancelled:
            status.update(f"{name}: cancelled; pull again to resume.")
            self.notify(f"Pull of {name} cancelled; pulling again resumes it.", timeout=3)
        elif error:
            status.update(f"{name}: {error}")
            self.notify(f"Pull failed: {error}", severity="error", timeout=6)
        else:
            bar = self.query_one("#pull-progress", ProgressBar)
            if bar.total:
                bar.update(progress=bar.total)
            status.update(f"{name}: installed.")
            self.notify(f"{name} installed.", timeout=3)
        self.action_refresh()
        self.lapp.models_changed()

    def action_cancel_pull(self) -> None:
        if self.pull_cancel is not None:
            self.pull_cancel.set()
            self.query_one("#pull-status", Static).update(f"{self.pulling}: cancelling…")

    @on(Button.Pressed, "#pull-button")
    def _pull_button(self) -> None:
        self.action_pull()

    @on(Button.Pressed, "#cancel-button")
    def _cancel_button(self) -> None:
        self.action_cancel_pull()

    @on(Input.Submitted, "#pull-name")
    def _pull_input(self) -> None:
        self.action_pull()

    # ------------------------------------------------------------------ delete / default

    def action_delete(self) -> None:
        name = self._selected("installed")
        if not name:
            self.notify("Pick an installed model first.", severity="warning")
            return
        from .modals import ConfirmModal

        def done(yes: bool | None) -> None:
            if yes:
                self.run_delete(name)

        self.app.push_screen(ConfirmModal(f"Delete the model {name} and free its files?"), done)

    @work(thread=True, group="delete")
    def run_delete(self, name: str) -> None:
        try:
            self.lapp.backend.delete(name)
        except Exception as e:  # noqa: BLE001
            self.app.call_from_thread(self.notify, f"Could not delete {name}: {e}", severity="error")
            return
        self.app.call_from_thread(self.notify, f"Deleted {name}.", timeout=3)
        self.app.call_from_thread(self.action_refresh)
        self.app.call_from_thread(self.lapp.models_changed)

    def action_set_default(self) -> None:
        name = self._selected("installed")
        if not name:
            self.notify("Pick an installed model first.", severity="warning")
            return
        self.lapp.set_default_model(name)
        self.show_rows(self.installed, self.catalog)
        self.notify(f"{name} is the default model now.", timeout=3)


class HardwareScreen(Screen):
    """What the probe found, and the planner's pick for the default model with its reasons."""

    BINDINGS = [Binding("r", "refresh", "Refresh", id="hardware.refresh")]

    @property
    def lapp(self) -> LocalLLMApp:
        return self.app  # type: ignore[return-value]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="hardware-pane"):
            yield Markdown("Probing this machine…", id="hardware")
        yield Footer()

    def on_mount(self) -> None:
        self.action_refresh()

    @work(thread=True, exclusive=True, group="hardware")
    def action_refresh(self) -> None:
        try:
            report = self.lapp.backend.hardware()
            text = hardware_markdown(report)
        except Exception as e:  # noqa: BLE001
            text = f"# Hardware\n\nThe probe failed: {e}"
        self.app.call_from_thread(self.query_one("#hardware", Markdown).update, text)


def hardware_markdown(report: dict[str, Any]) -> str:
    """The hardware view as Markdown, from the adapter's ``hardware()`` report."""
    hw = report.get("probe") or {}
    gib = 1024**3
    lines = ["## This machine", ""]

    def row(k: str, v: Any) -> None:
        lines.append(f"| {k} | {v} |")

    lines += ["| Part | Found |", "|---|---|"]
    row("CPU", hw.get("cpu_model", "?"))
    cores = f"{hw.get('physical_cores', '?')} physical / {hw.get('logical_cores', '?')} logical"
    row("Cores", cores)
    if hw.get("simd"):
        row("SIMD", " ".join(hw["simd"]))
    if hw.get("ram_total"):
        row("RAM", f"{hw.get('ram_available', 0) / gib:.1f} GiB free of {hw['ram_total'] / gib:.1f} GiB")
    gpus = hw.get("gpus") or []
    if not gpus:
        row("GPU", "none found")
    for g in gpus:
        free, total = g.get("free_bytes", 0) or 0, g.get("total_bytes", 0) or 0
        row(f"GPU {g.get('index', '')}".strip(),
            f"{g.get('name', '?')} ({g.get('vendor', '')}) {free / gib:.1f} GiB free of {total / gib:.1f} GiB")
    if hw.get("apple_silicon"):
        row("Metal budget", f"{(hw.get('metal_budget') or 0) / gib:.1f} GiB")
    backends = hw.get("backends") or {}
    for name, status in backends.items():
        if isinstance(status, dict):
            ok = "available" if status.get("available") else "not available"
            extra = ", GPU offload" if status.get("gpu_offload") else ""
            reason = f" ({status['reason']})" if status.get("reason") else ""
            row(f"Backend {name}", f"{ok}{extra}{reason}")
    plan = report.get("plan")
    lines += ["", "## The planner's pick", ""]
    if plan:
        lines.append(f"For **{plan['model']}**: backend **{plan['backend']}**, {plan['verdict']}, "
                     f"{plan.get('n_gpu_layers', 0)} GPU layers, context {plan.get('n_ctx', 0)}, "
                     f"KV cache {plan.get('kv_cache_type', '')}.")
        lines.append("")
        lines += [f"- {r}" for r in plan.get("reasons", [])]
    else:
        lines.append(report.get("plan_error", "No plan."))
    notes = hw.get("notes") or []
    if notes:
        lines += ["", "## Probe notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"
