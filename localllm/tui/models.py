"""The model manager: installed models (with the weight formats installed: GGUF, and MLX where pulled or
converted), the catalog with fit verdicts, pull with progress, delete, the default model; and the
hardware view."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Button, DataTable, Footer, Input, Label, Markdown, ProgressBar, Static
from textual.worker import get_current_worker

from localllm.api import CatalogItem, Fit, PullProgress

if TYPE_CHECKING:
    from localllm.hardware import HardwareInfo
    from localllm.session import Session

    from .host import AppHost


@dataclass
class ModelRow:
    """An installed model as the model manager shows it."""

    name: str
    size: int = 0
    quantization: str = ""
    backend: str = ""  # the backend the planner picks for it here ("server" on a server)
    verdict: str = ""  # "fits on GPU" | "partial offload 20/32 layers" | "CPU" | "too big"
    loaded: bool = False
    formats: str = "GGUF"  # the weight formats installed: "GGUF", "GGUF+MLX"; "+mmproj" with a vision projector
    base: str | None = None  # the model a variant (``localllm create``) was made from
    kind: str = ""  # "embedding" or "rerank" for a model that pools instead of generating (marked after its name)


SERVER_FIT = Fit(text="(server decides)")  # a server picks the backend itself


def model_rows(session: Session) -> list[ModelRow]:
    """The installed models with the planner's verdict here (in-process) and whether each is loaded."""
    try:
        loaded = {r.name for r in session.runner.ps()}
    except Exception:  # noqa: BLE001 - an Ollama without /api/ps still lists its models
        loaded = set()
    rows = []
    for m in session.models.list():
        fit = SERVER_FIT
        if session.advisor is not None:
            try:
                fit = session.advisor.fit(m.name)
            except Exception as e:  # noqa: BLE001 - a verdict that cannot be computed is shown, not raised
                fit = Fit(text=f"? ({e})")
        media = [c for c in ("vision", "audio") if c in m.capabilities]  # what its projector takes
        formats = m.formats + ((["mmproj"] if media == ["vision"] else [f"mmproj({'+'.join(media)})"])
                               if m.projector_path else [])
        rows.append(ModelRow(name=m.name, size=m.size, quantization=m.quantization, backend=fit.backend,
                             verdict=fit.text, loaded=m.name in loaded, formats="+".join(formats) or "GGUF",
                             base=m.base, kind=m.kind))
    return rows


def human_size(n: int | float | None) -> str:
    """Decimal units, as ``ollama list`` shows them.

    >>> human_size(92_900_000)
    '92.9 MB'
    """
    if not n:
        return "-"
    n = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


class ModelsScreen(Screen):
    """Installed models and the catalog; pull, cancel, delete, set default."""

    BINDINGS = [
        Binding("p", "pull", "Pull", id="models.pull"),
        Binding("x", "cancel_pull", "Cancel pull", id="models.cancel"),
        Binding("d,delete", "delete", "Delete", id="models.delete"),
        Binding("s", "set_default", "Set default", id="models.default"),
        Binding("r", "refresh", "Refresh", id="models.refresh"),
        Binding("v", "variant", "Make a variant", id="models.variant", show=False),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.installed: list[ModelRow] = []
        self.catalog: list[CatalogItem] = []
        self.pull_cancel: threading.Event | None = None
        self.pulling: str | None = None
        self.last_pull: PullProgress | None = None
        self.loaded_once = threading.Event()

    @property
    def lapp(self) -> AppHost:
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
        cat.add_columns("Name", "Size", "Fit here", "Capabilities", "Draft", "Installed", "Description")
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
            session = self.lapp.session
            installed = model_rows(session)
            catalog = session.advisor.catalog() if session.advisor is not None else []
        except Exception as e:  # noqa: BLE001 - shown, not raised
            self.app.call_from_thread(self.notify, f"Could not list models: {e}", severity="error")
            return
        # a newer refresh started meanwhile (it cancelled this one: the group is exclusive, but a thread runs on):
        # its rows are the current ones, these would overwrite them (a variant listed, then gone again)
        if not get_current_worker().is_cancelled:
            self.app.call_from_thread(self.show_rows, installed, catalog)

    def show_rows(self, installed: list[ModelRow], catalog: list[CatalogItem]) -> None:
        self.installed, self.catalog = installed, catalog
        default = self.lapp.default_model_name()
        inst = self.query_one("#installed", DataTable)
        inst.clear()
        for m in installed:
            shown = f"{m.name} (from {m.base})" if m.base else m.name  # a variant shows its base
            shown += f" [{m.kind}]" if m.kind else ""  # an embedding / rerank model: it cannot chat
            inst.add_row(shown, human_size(m.size), m.quantization or "-", m.backend or "-", m.verdict or "-",
                         "yes" if m.loaded else "", "*" if m.name == default else "", m.formats or "GGUF", key=m.name)
        cat = self.query_one("#catalog", DataTable)
        cat.clear()
        for c in catalog:
            cat.add_row(c.name, human_size(c.size), c.fit.text or "-", c.capability_text(), c.draft or "",
                        "yes" if c.installed else "", c.description, key=c.name)
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
        def progress(update: PullProgress) -> None:
            self.app.call_from_thread(self.show_progress, name, update)

        error: str | None = None
        try:
            self.lapp.session.models.pull(name, progress=progress, cancel=cancel)
        except Exception as e:  # noqa: BLE001 - one sentence to the user
            error = str(e) or type(e).__name__
        self.app.call_from_thread(self.pull_finished, name, error, cancel.is_set())

    def show_progress(self, name: str, update: PullProgress) -> None:
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
        session = self.lapp.session
        try:
            if name in {r.name for r in session.runner.ps()}:  # its memory goes with its file
                session.runner.unload(name)
            session.models.remove(name)
        except Exception as e:  # noqa: BLE001
            self.app.call_from_thread(self.notify, f"Could not delete {name}: {e}", severity="error")
            return
        self.app.call_from_thread(self.notify, f"Deleted {name}.", timeout=3)
        self.app.call_from_thread(self.action_refresh)
        self.app.call_from_thread(self.lapp.models_changed)

    # ------------------------------------------------------------------ variants

    def action_variant(self) -> None:
        """A variant of the selected installed model: a name, a system prompt and a few parameters (v)."""
        base = self._selected("installed")
        if not base:
            self.notify("Pick an installed model first.", severity="warning")
            return
        from .modals import VariantModal

        def done(form: dict[str, object] | None) -> None:
            if form:
                self.run_variant(base, form)

        self.app.push_screen(VariantModal(base), done)

    @work(thread=True, group="variant")
    def run_variant(self, base: str, form: dict[str, object]) -> None:
        from localllm.modelfile import Modelfile

        params = dict(form.get("parameters") or {})  # type: ignore[call-overload]
        system = form.get("system")
        mf = Modelfile(from_=base, parameters=params, system=str(system) if system else None)
        try:
            made = self.lapp.session.models.create(str(form["name"]), mf)
        except Exception as e:  # noqa: BLE001 - one sentence to the user
            self.app.call_from_thread(self.notify, f"Could not make the variant: {e}", severity="error")
            return
        self.app.call_from_thread(self.notify, f"{made.name} made from {base}.", timeout=3)
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
    def lapp(self) -> AppHost:
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
            text = hardware_markdown(*hardware_report(self.lapp.session, self.lapp.default_model_name()))
        except Exception as e:  # noqa: BLE001
            text = f"# Hardware\n\nThe probe failed: {e}"
        if not get_current_worker().is_cancelled:  # a newer probe started: its report is the current one
            self.app.call_from_thread(self.query_one("#hardware", Markdown).update, text)


def hardware_report(session: Session, model: str) -> tuple[HardwareInfo, Fit | None, str]:
    """(this machine's probe, the plan for ``model`` or None, a note when there is no plan)."""
    advisor = session.advisor
    if advisor is None:
        from localllm.hardware import probe

        return probe(), None, f"Models run on the {session.label}; this is the probe of this machine."
    hw = advisor.hardware()
    try:
        return hw, advisor.fit(model), ""
    except Exception as e:  # noqa: BLE001 - shown in the view
        return hw, None, f"No plan for {model}: {e}"


def hardware_markdown(hw: HardwareInfo, plan: Fit | None, note: str = "") -> str:
    """The hardware view as Markdown: the probe, then the planner's pick for the default model and why."""
    gib = 1024**3
    lines = ["## This machine", ""]

    def row(k: str, v: object) -> None:
        lines.append(f"| {k} | {v} |")

    lines += ["| Part | Found |", "|---|---|"]
    row("CPU", hw.cpu_model or "?")
    row("Cores", f"{hw.physical_cores} physical / {hw.logical_cores} logical")
    if hw.simd:
        row("SIMD", " ".join(hw.simd))
    if hw.ram_total:
        row("RAM", f"{hw.ram_available / gib:.1f} GiB free of {hw.ram_total / gib:.1f} GiB")
    if not hw.gpus:
        row("GPU", "none found")
    for g in hw.gpus:
        memory = (f"{g.free_bytes / gib:.1f} GiB free of {g.total_bytes / gib:.1f} GiB" if g.total_bytes
                  else "memory not reported")
        row(f"GPU {g.index}", f"{g.name} ({g.vendor}) {memory}")
    if hw.apple_silicon:
        row("Metal budget", f"{(hw.metal_budget or 0) / gib:.1f} GiB")
    for d in hw.devices:  # llama.cpp's own device list (RPC workers included)
        where = f"RPC worker {d.endpoint}" if d.remote else d.description
        row(f"llama.cpp {d.name}", f"{d.type}, {where}, {d.free_bytes / gib:.1f} GiB free of "
                                   f"{d.total_bytes / gib:.1f} GiB")
    for name, status in hw.backends.items():
        ok = "available" if status.available else "not available"
        extra = ", GPU offload" if status.gpu_offload else ""
        reason = f" ({status.reason})" if status.reason else ""
        row(f"Backend {name}", f"{ok}{extra}{reason}")
    lines += ["", "## The planner's pick", ""]
    if plan is not None:
        lines.append(f"For **{plan.model}**: backend **{plan.backend}**, {plan.text}, "
                     f"{plan.n_gpu_layers} GPU layers, context {plan.n_ctx}, KV cache {plan.kv_cache_type}.")
        lines.append("")
        lines += [f"- {r}" for r in plan.reasons]
    else:
        lines.append(note or "No plan.")
    if hw.notes:
        lines += ["", "## Probe notes", ""] + [f"- {n}" for n in hw.notes]
    return "\n".join(lines) + "\n"
