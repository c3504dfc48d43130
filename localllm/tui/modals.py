"""Modal screens: confirm, one-line text (rename), conversation settings (with its MCP servers and tools),
the confirmation of a tool call, help."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, DataTable, Input, Label, Select, SelectionList, Static, TextArea

from localllm.errors import LocalLLMError

if TYPE_CHECKING:
    from localllm.mcp.host import McpHost, ServerStatus
    from localllm.mcp.loop import ToolCall


class ConfirmModal(ModalScreen[bool]):
    """Yes / no. Dismisses with True on yes."""

    BINDINGS = [
        Binding("escape", "dismiss(False)", "Cancel", id="modal.cancel"),
        Binding("y", "dismiss(True)", "Yes", id="modal.yes", show=False),
        Binding("n", "dismiss(False)", "No", id="modal.no", show=False),
    ]

    def __init__(self, question: str, yes: str = "Delete"):
        super().__init__()
        self.question, self.yes = question, yes

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.question, classes="question")
            with Horizontal(classes="buttons"):
                yield Button(self.yes, variant="error", id="yes")
                yield Button("Cancel", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.id == "yes")


class TextModal(ModalScreen[str | None]):
    """Ask for one line of text (the new title of a conversation). None when cancelled."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel", id="modal.cancel")]

    def __init__(self, title: str, value: str = ""):
        super().__init__()
        self.title_text, self.value = title, value

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.title_text, classes="question")
            yield Input(self.value, id="text")
            with Horizontal(classes="buttons"):
                yield Button("OK", variant="primary", id="ok")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        text = self.query_one("#text", Input)
        text.focus()
        text.select_all()  # typing replaces the old title

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value.strip() or None)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(self.query_one("#text", Input).value.strip() or None if event.button.id == "ok" else None)


class VariantModal(ModalScreen[dict[str, Any] | None]):
    """Make a variant of an installed model (``localllm create`` from the model manager): a name, a system
    prompt and a few parameters. Dismisses with ``{"name", "system", "parameters"}`` or None when cancelled; a
    value that does not parse is one sentence under the form and the modal stays open."""

    BINDINGS = [Binding("escape", "dismiss(None)", "Cancel", id="modal.cancel")]
    FIELDS: list[tuple[str, str, str]] = [("temperature", "Temperature", "0.8"), ("top_p", "Top p", "0.9"),
                                          ("num_ctx", "Context (tokens)", "planner decides")]

    def __init__(self, base: str):
        super().__init__()
        self.base = base

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog", id="variant-dialog"):
            yield Label(f"A variant of {self.base}", classes="question")
            yield Input(placeholder="name, e.g. pirate", id="variant-name")
            yield TextArea("", id="variant-system")
            for key, label, hint in self.FIELDS:
                yield Input(placeholder=f"{label} ({hint})", id=f"variant-{key}")
            yield Static("", id="variant-error")
            with Horizontal(classes="buttons"):
                yield Button("Create", variant="primary", id="ok")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        system = self.query_one("#variant-system", TextArea)
        system.border_title = "System prompt"
        system.styles.height = 5  # the form fits a small terminal, buttons included
        self.query_one("#variant-name", Input).focus()

    def result(self) -> dict[str, Any]:
        """The form as ``create`` takes it (raises :class:`LocalLLMError` in one sentence)."""
        from localllm.names import parse_name

        name = self.query_one("#variant-name", Input).value.strip()
        if not name:
            raise LocalLLMError("Give the variant a name.")
        parse_name(name, allow_path=False)
        values = {k: self.query_one(f"#variant-{k}", Input).value for k, _, _ in self.FIELDS}
        params = parse_params(values)
        system = self.query_one("#variant-system", TextArea).text.strip()
        return {"name": name, "system": system or None, "parameters": params}

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id != "ok":
            self.dismiss(None)
            return
        try:
            self.dismiss(self.result())
        except LocalLLMError as e:
            self.query_one("#variant-error", Static).update(str(e))


PARAM_FIELDS: list[tuple[str, str, str]] = [
    # key, label, placeholder
    ("temperature", "Temperature", "0.8"),
    ("top_p", "Top p", "0.9"),
    ("seed", "Seed", "random"),
    ("num_ctx", "Context (tokens)", "planner decides"),
    ("draft", "Draft", "auto | none | ngram | MODEL"),
    ("think", "Think", "model default | on | off | low | medium | high"),
]
THINK_WORDS = {"on": "on", "true": "on", "yes": "on", "off": "off", "false": "off", "no": "off",
               "low": "low", "medium": "medium", "high": "high", "max": "high"}


def parse_params(values: dict[str, str]) -> dict[str, Any]:
    """Validate the settings form; one clear sentence per mistake.

    >>> parse_params({"temperature": "0.2", "seed": "7", "top_p": "", "num_ctx": "2048", "draft": "ngram",
    ...               "think": "Off"})
    {'temperature': 0.2, 'seed': 7, 'num_ctx': 2048, 'draft': 'ngram', 'think': 'off'}
    """
    out: dict[str, Any] = {}
    for key, label, _ in PARAM_FIELDS:
        raw = (values.get(key) or "").strip()
        if not raw:
            continue
        try:
            if key in ("temperature", "top_p"):
                value: Any = float(raw)
                if value < 0 or (key == "top_p" and value > 1) or value > 5:
                    raise ValueError
            elif key in ("seed", "num_ctx"):
                value = int(raw)
                if key == "num_ctx" and not 128 <= value <= 1 << 20:
                    raise ValueError
            elif key == "think":
                value = THINK_WORDS[raw.lower()]
            else:
                value = raw
        except (ValueError, KeyError):
            hint = {"temperature": "a number from 0 to 5", "top_p": "a number from 0 to 1",
                    "seed": "a whole number", "num_ctx": "a whole number of tokens from 128",
                    "think": "on, off, low, medium or high"}[key]
            raise LocalLLMError(f"{label} must be {hint}, got {raw!r}.") from None
        out[key] = value
    return out


class SettingsModal(ModalScreen[dict[str, Any] | None]):
    """The conversation's model, system prompt and parameters. Dismisses with
    ``{"model", "system", "params"}`` or None."""

    BINDINGS = [
        Binding("escape", "dismiss(None)", "Cancel", id="modal.cancel"),
        Binding("ctrl+s", "save", "Save", id="settings.save"),
    ]

    def __init__(self, model: str | None, models: list[str], system: str, params: dict[str, Any],
                 mcp: McpHost | None = None, enabled: list[str] | None = None):
        super().__init__()
        self.model, self.models, self.system, self.params = model, models, system, params
        self.mcp = mcp
        self.enabled = list(enabled or [])  # the servers this chat uses
        self.off = set(params.get("mcp_off") or [])  # single tools turned off: "server/tool"
        self._unsubscribe: Any = None

    def compose(self) -> ComposeResult:
        names = list(dict.fromkeys([*(self.models or []), *([self.model] if self.model else [])]))
        with VerticalScroll(classes="dialog settings"):
            yield Label("Conversation settings", classes="question")
            yield Label("Model")
            yield Select([(n, n) for n in names], value=self.model if self.model in names else Select.BLANK,
                         allow_blank=True, id="model", compact=True)
            yield Label("System prompt")
            yield TextArea(self.system, id="system", soft_wrap=True)
            with Grid(classes="params"):
                for key, label, placeholder in PARAM_FIELDS:
                    yield Label(label)
                    value = self.params.get(key)
                    yield Input("" if value is None else str(value), placeholder=placeholder, id=f"param-{key}",
                                compact=True)
            if self.mcp is not None:
                yield from self._compose_mcp(self.mcp)
            yield Static("", id="settings-error", classes="error")
            with Horizontal(classes="buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    # ---- MCP servers: each with its state, enabled or not for this chat; their tools, each on or off

    def _compose_mcp(self, mcp: McpHost) -> ComposeResult:
        where = mcp.config.path or "mcp.json"
        yield Label("Tools (MCP servers)", classes="mcp-title")
        if not mcp.names:
            yield Static(f"No MCP servers: add them to {where} (the README shows how).", classes="hint",
                         markup=False)
            return
        for i, status in enumerate(mcp.statuses()):
            with Horizontal(classes="mcp-server"):
                yield Checkbox(status.name, status.name in self.enabled, id=f"mcp-{i}", compact=True)
                yield Static(_state_text(status), id=f"mcp-state-{i}", classes="mcp-state", markup=False)
        yield Label("Their tools (unchecked: not offered to the model)", classes="hint")
        yield SelectionList[str](*self._tool_options(), id="mcp-tools", compact=True)

    def _tool_options(self) -> list[tuple[str, str, bool]]:
        assert self.mcp is not None
        out = []
        for tool in self.mcp.tools(self.enabled):
            key = f"{tool.server}/{tool.name}"
            out.append((f"{tool.public} ({tool.server})", key, key not in self.off))
        return out

    def on_mount(self) -> None:
        if self.mcp is not None:
            self._unsubscribe = self.mcp.subscribe(self._host_changed)

    def on_unmount(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()

    def _host_changed(self, status: ServerStatus) -> None:
        try:
            self.app.call_from_thread(self.refresh_mcp)
        except RuntimeError:  # already on the app's thread (a start asked from here)
            self.call_later(self.refresh_mcp)

    def refresh_mcp(self) -> None:
        """The servers' states and the tool list, as they are now."""
        if self.mcp is None or not self.is_attached:
            return
        for i, status in enumerate(self.mcp.statuses()):
            for w in self.query(f"#mcp-state-{i}"):
                if isinstance(w, Static):
                    w.update(_state_text(status))
        for tools in self.query("#mcp-tools"):
            if isinstance(tools, SelectionList):
                tools.clear_options()
                tools.add_options(self._tool_options())

    def on_checkbox_changed(self, event: Checkbox.Changed) -> None:
        event.stop()
        if self.mcp is None or not (event.checkbox.id or "").startswith("mcp-"):
            return
        name = self.mcp.names[int((event.checkbox.id or "mcp-0")[4:])]
        if event.value and name not in self.enabled:
            self.enabled.append(name)
            self.mcp.start([name], retry=True)  # in the background (a failed one again): its state shows here
        elif not event.value and name in self.enabled:
            self.enabled.remove(name)
        self.refresh_mcp()

    def on_selection_list_selection_toggled(self, event: SelectionList.SelectionToggled) -> None:
        event.stop()
        key = str(event.selection.value)
        if key in event.selection_list.selected:
            self.off.discard(key)
        else:
            self.off.add(key)

    def action_save(self) -> None:
        values = {key: self.query_one(f"#param-{key}", Input).value for key, _, _ in PARAM_FIELDS}
        try:
            params = parse_params(values)
        except LocalLLMError as e:
            self.query_one("#settings-error", Static).update(str(e))
            return
        model = self.query_one("#model", Select).value
        if self.mcp is not None and self.mcp.names:  # no mcp.json: nothing to say
            params["mcp"] = [n for n in self.mcp.names if n in self.enabled]
            if self.off:
                params["mcp_off"] = sorted(self.off)
        self.dismiss({
            "model": None if model is Select.BLANK else str(model),
            "system": self.query_one("#system", TextArea).text,
            "params": params,
        })

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if event.button.id == "save":
            self.action_save()
        else:
            self.dismiss(None)


def _state_text(status: ServerStatus) -> str:
    """``ready, 2 tools`` / ``starting…`` / ``failed: reason`` / ``off (starts when a chat uses it)``."""
    if status.state == "off":
        return "off (starts when a chat uses it)"
    if status.state == "starting":
        return "starting…"
    return status.line().split(": ", 1)[1]


class ToolConfirmModal(ModalScreen[str]):
    """The first call of a tool in a chat: allow once, allow for this chat, or deny; the arguments shown."""

    BINDINGS = [
        Binding("escape", "dismiss('deny')", "Deny", id="tool.deny"),
        Binding("o", "dismiss('once')", "Allow once", id="tool.once", show=False),
        Binding("a", "dismiss('chat')", "Allow for this chat", id="tool.chat", show=False),
        Binding("d", "dismiss('deny')", "Deny", id="tool.deny_key", show=False),
    ]

    def __init__(self, call: ToolCall):
        super().__init__()
        self.call = call

    def compose(self) -> ComposeResult:
        where = f" of the MCP server “{self.call.server}”" if self.call.server else ""
        with Vertical(classes="dialog tool-confirm"):
            yield Label(f"The model wants to call {self.call.tool}{where}.", classes="question", markup=False)
            yield Static(json.dumps(self.call.arguments, indent=2, ensure_ascii=False), id="tool-arguments",
                         markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Allow once (o)", variant="primary", id="once")
                yield Button("Allow for this chat (a)", id="chat")
                yield Button("Deny (d)", variant="error", id="deny")

    def on_mount(self) -> None:
        self.query_one("#once", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.id or "deny")


class HelpScreen(ModalScreen[None]):
    """Every binding: its id (for ``[keymap]``), its keys now, and what it does."""

    BINDINGS = [Binding("escape,f1,q", "dismiss", "Close", id="help.close")]

    def __init__(self, rows: list[tuple[str, str, str, str]]):
        super().__init__()
        self.rows = rows

    def compose(self) -> ComposeResult:
        from localllm.config import paths

        with Vertical(classes="dialog help"):
            yield Label("Keys", classes="question")
            table: DataTable = DataTable(id="help-table", cursor_type="row", zebra_stripes=True)
            table.add_columns("Where", "Keys", "Action", "Binding id")
            for row in self.rows:
                table.add_row(*row)
            yield table
            yield Static(
                f"Remap any key in {paths().config_file}:\n[keymap]\n\"chat.new\" = \"ctrl+n\"",
                classes="hint", markup=False,
            )
