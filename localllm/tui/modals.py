"""Modal screens: confirm, one-line text (rename), conversation settings, help."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Input, Label, Select, Static, TextArea

from localllm.errors import LocalLLMError


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

    def __init__(self, model: str | None, models: list[str], system: str, params: dict[str, Any]):
        super().__init__()
        self.model, self.models, self.system, self.params = model, models, system, params

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
            yield Static("", id="settings-error", classes="error")
            with Horizontal(classes="buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def action_save(self) -> None:
        values = {key: self.query_one(f"#param-{key}", Input).value for key, _, _ in PARAM_FIELDS}
        try:
            params = parse_params(values)
        except LocalLLMError as e:
            self.query_one("#settings-error", Static).update(str(e))
            return
        model = self.query_one("#model", Select).value
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
