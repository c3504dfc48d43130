"""The interactive ``>>>`` prompt of ``localllm run`` (Ollama's ``cmd/interactive.go``); what a user types
after it::

    Why is the sky blue?
    \"\"\"A message
    over several lines\"\"\"
    /set parameter temperature 0
    /show info
    /bye

Ctrl+C stops the answer being written (the prompt comes back); Ctrl+D or ``/bye`` exits. Input
history lives in ``<data>/history`` unless ``LOCALLLM_NOHISTORY`` is set. ``/set think`` / ``/set nothink``
turn a thinking model's reasoning on or off (its reasoning is printed grey before the answer unless
``--hidethinking``). With ``--mcp NAME`` the model can call the tools of those MCP servers (the loop is
:mod:`localllm.mcp.loop`'s): each call is printed (tool, arguments, result), the first call of each tool asks
on the terminal (allow once / always for this session / deny), and ``/tools`` lists what the model can call.
A face: it talks to a :class:`~localllm.session.Session` (models and runner, in-process
or on a server), never to the engine or a backend.
"""

from __future__ import annotations

import os
import shlex
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import IO, TYPE_CHECKING, Any

from localllm.api import BackendError, Done
from localllm.cli.answer import (
    RunSettings,
    ctrl_c_sets,
    ensure_model,
    loaded_plan,
    overflow_note,
    parse_think_flag,
    placement_lines,
    print_stats,
    stream_answer,
    user_message,
)
from localllm.cli.display import isatty
from localllm.errors import LocalLLMError

if TYPE_CHECKING:
    from localllm.api import Installed
    from localllm.mcp.loop import Decision, ToolCall, ToolChat
    from localllm.session import Session

HELP = """Available Commands:
  /set            Set session variables
  /show           Show model information
  /load <model>   Load a session or model
  /save <model>   Save this session as a model (system prompt, parameters, messages)
  /clear          Clear session context
  /image <path>   Attach an image to the next message (a vision model; a path in a message works too)
  /audio <path>   Attach a WAV, MP3 or FLAC file to the next message (a model that takes audio)
  /tools          List the MCP tools the model can call
  /bye            Exit
  /?, /help       Help for a command
  /? shortcuts    Help for keyboard shortcuts

Use \"\"\" to begin a multi-line message.
"""

SET_HELP = """Available Commands:
  /set parameter ...     Set a parameter
  /set system <string>   Set system message
  /set history           Enable history
  /set nohistory         Disable history
  /set format json       Enable JSON mode
  /set noformat          Disable formatting
  /set verbose           Show LLM stats
  /set quiet             Disable LLM stats
  /set think             Enable thinking
  /set nothink           Disable thinking
"""

PARAM_HELP = """Available Parameters:
  /set parameter seed <int>             Random number seed
  /set parameter num_predict <int>      Max number of tokens to predict
  /set parameter top_k <int>            Pick from top k num of tokens
  /set parameter top_p <float>          Pick token based on sum of probabilities
  /set parameter min_p <float>          Pick token based on top token probability * min_p
  /set parameter num_ctx <int>          Set the context size
  /set parameter temperature <float>    Set creativity level
  /set parameter repeat_penalty <float> How strongly to penalize repetitions
  /set parameter repeat_last_n <int>    Set how far back to look for repetitions
  /set parameter stop <string> <string> ...   Set the stop parameters
"""

SHOW_HELP = """Available Commands:
  /show info         Show details for this model
  /show license      Show model license
  /show modelfile    Show Modelfile for this model
  /show parameters   Show parameters for this model
  /show system       Show system message
  /show template     Show prompt template
"""

SHORTCUTS = """Available keyboard shortcuts:
  Ctrl + a            Move to the beginning of the line (Home)
  Ctrl + e            Move to the end of the line (End)
  Ctrl + k            Delete the sentence after the cursor
  Ctrl + u            Delete the sentence before the cursor
  Ctrl + w            Delete the word before the cursor
  Ctrl + l            Clear the screen
  Ctrl + c            Stop the model from responding
  Ctrl + d            Exit localllm (/bye)
"""

# name -> (Sampling attribute or LoadOptions attribute, type); num_ctx lives on the load options.
PARAMETERS: dict[str, tuple[str, type]] = {
    "seed": ("seed", int),
    "num_predict": ("max_tokens", int),
    "top_k": ("top_k", int),
    "top_p": ("top_p", float),
    "min_p": ("min_p", float),
    "temperature": ("temperature", float),
    "repeat_penalty": ("repeat_penalty", float),
    "repeat_last_n": ("repeat_last_n", int),
    "num_ctx": ("num_ctx", int),
    "stop": ("stop", list),
}


class Repl:
    """One interactive session on one model.

    ``read`` returns the next line (raising EOFError at the end); by default it is :func:`input`
    with readline editing and history when stdin is a terminal.
    """

    def __init__(self, session: Session, model: str, settings: RunSettings, *,
                 out: IO[str] | None = None, err: IO[str] | None = None,
                 read: Callable[[str], str] | None = None, tools: ToolChat | None = None,
                 tool_choice: str = "auto"):
        self.models = session.models
        self.runner = session.runner
        self.model = model
        self.settings = settings.copy()
        self.messages: list[dict[str, Any]] = []
        self.pending_images: list[bytes] = []  # /image files for the next message
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self._read = read or input
        self._history_file: str | None = None
        self.history = os.environ.get("LOCALLLM_NOHISTORY", "") in ("", "0")
        self.tools = tools  # the MCP servers of this session (None: no --mcp)
        self.tool_choice = tool_choice  # "required": the first generation of each turn must call a tool
        self._tools_supported: bool | None = None

    # -------------------------------------------------------------------------------- main loop

    def run(self) -> None:
        """Load the model, then read and answer until /bye or Ctrl+D."""
        self.runner.load(self.model, self.settings.load, keep_alive=self.settings.keep_alive)
        self.start_tools()
        self._setup_readline()
        try:
            while True:
                try:
                    line = self._read_message()
                except EOFError:
                    self.out.write("\n")
                    break
                except KeyboardInterrupt:  # Ctrl+C at the prompt: a fresh line, as Ollama does
                    self.out.write("\nUse Ctrl + d or /bye to exit.\n")
                    continue
                if line is None:
                    continue
                if line.startswith("/"):
                    if self.command(line) == "exit":
                        break
                    continue
                self.ask(line)
        finally:
            self._save_history()

    def _read_message(self) -> str | None:
        """One message: a line, or a \"\"\"-delimited block. None for a blank line."""
        line = self._read(">>> ")
        stripped = line.strip()
        if not stripped:
            return None
        if not stripped.startswith('"""'):
            return stripped
        body = stripped[3:]
        if body.endswith('"""') and len(body) >= 3:
            return body[:-3].strip() or None
        lines = [body] if body else []
        while True:
            more = self._read("... ")
            if more.rstrip().endswith('"""'):
                lines.append(more.rstrip()[:-3])
                break
            lines.append(more)
        text = "\n".join(lines).strip()
        return text or None

    # -------------------------------------------------------------------------------- answering

    def ask(self, text: str) -> None:
        """Send ``text`` as the next user turn and stream the answer (through the tool loop with ``--mcp``)."""
        if self.tools is not None and self._use_tools():
            self._ask_with_tools(text)
            return
        s = self.settings
        try:
            message = user_message(text, self.pending_images, self.err)
            request = s.request(self.messages + [message])
            answer = stream_answer(self.runner, self.model, request, s.load, out=self.out,
                                   show_thinking=not s.hide_thinking, keep_alive=s.keep_alive)
        except (LocalLLMError, BackendError) as e:  # one sentence; the session goes on
            self.err.write(f"Error: {e}\n")
            return
        self.out.write("\n\n" if not answer.cancelled else "\n")
        self.out.flush()
        if answer.cancelled:  # the question and its partial answer are left out of the history
            return
        self.pending_images = []  # sent: they stay in the conversation (the next turns reuse them, not re-encode)
        self.messages += [message, {"role": "assistant", "content": answer.text}]
        self._after(answer.done)

    def _after(self, done: Done | None) -> None:
        """After an answer: the turns the backend dropped to fit leave our history too; --verbose stats."""
        if done is None:
            return
        dropped = done.stats.dropped_messages
        if dropped:
            self.err.write(f"{overflow_note(done.stats)}\n")
            del self.messages[:dropped]  # the backend left them out; keep our copy in step
        if self.settings.verbose:
            print_stats(done.stats, self.err, loaded_plan(self.runner, self.model))
            self.err.writelines(line + "\n" for line in placement_lines(self.runner, self.model))

    # -------------------------------------------------------------------------------- tools (MCP)

    def start_tools(self, timeout: float = 60.0) -> None:
        """Start the ``--mcp`` servers and wait for them (one line each: ready with N tools, or why not)."""
        if self.tools is None:
            return
        self.tools.start()
        self.tools.host.wait(self.tools.servers, timeout)
        for name in self.tools.servers:
            self.err.write(f"MCP {self.tools.host.status(name).line()}\n")  # stderr: stdout is the conversation
        self._use_tools()

    def _use_tools(self) -> bool:
        """Whether the model gets the tools: its chat template must render them (said once when it does not)."""
        if self._tools_supported is None:
            info = self._installed()
            self._tools_supported = info is None or "tools" in info.capabilities
            if not self._tools_supported:
                self.err.write(f"The chat template of {self.model} does not support tools: the MCP tools are not "
                               "given to it.\n")
        return self._tools_supported

    def tools_text(self) -> str:
        """``/tools``: each server's state and the tools the model can call."""
        from localllm.mcp.config import config_path

        if self.tools is None or not self.tools.servers:
            return (f"No MCP servers in this session: start it with --mcp NAME (the servers are in "
                    f"{config_path()}).\n")
        lines: list[str] = []
        for name in self.tools.servers:
            lines.append(self.tools.host.status(name).line())
            for tool in self.tools.tools():
                if tool.server == name:
                    allowed = " (allowed)" if f"{name}/{tool.name}" in self.tools.allowed else ""
                    desc = tool.description.strip().splitlines()[0][:70] if tool.description.strip() else ""
                    lines.append(f"  {tool.public:<28}{desc}{allowed}")
        if self._tools_supported is False:
            lines.append(f"(the chat template of {self.model} does not support tools)")
        return "\n".join(lines) + "\n"

    def _ask_with_tools(self, text: str) -> None:
        """One user turn through the tool loop: generate; for each call the model makes show it, ask the first
        time, run it, show the result; generate again with the results; until it answers in words."""
        assert self.tools is not None
        s = self.settings
        try:
            user = user_message(text, self.pending_images, self.err)  # images attach as in a turn without tools
        except (LocalLLMError, BackendError) as e:
            self.err.write(f"Error: {e}\n")
            return
        self.pending_images = []
        turn = self.tools.turn(self.messages + [user], force=self.tool_choice == "required")
        while True:
            tools, fmt = turn.next_request()
            request = s.request(turn.messages)
            request.tools = tools
            if fmt is not None:
                request.format = fmt
            try:
                answer = stream_answer(self.runner, self.model, request, s.load, out=self.out,
                                       show_thinking=not s.hide_thinking, keep_alive=s.keep_alive)
            except (LocalLLMError, BackendError) as e:  # one sentence; the session goes on
                self.err.write(f"Error: {e}\n")
                return
            if answer.cancelled:  # the question and its partial turn are left out of the history
                self.out.write("\n")
                return
            calls = turn.answered(answer.text, answer.tool_calls)
            if not calls:
                break
            for call in calls:
                if not self._run_call(turn, call):
                    self.out.write("Stopped.\n")
                    return
        self.out.write("\n\n")
        self.out.flush()
        self.messages = turn.messages[:] + [{"role": "assistant", "content": answer.text}]
        self._after(answer.done)

    def _run_call(self, turn: Any, call: ToolCall) -> bool:
        """Show, confirm, run and show one call; False when Ctrl+C stopped it."""
        assert self.tools is not None
        import json

        where = f" ({call.server})" if call.server else ""
        self._say(f"⚙ {call.tool}{where} {json.dumps(call.arguments, ensure_ascii=False)}")
        if call.info is None:
            turn.done(call, None)
            self._say(f"  ✗ {call.result}")
            return True
        if self.tools.needs_asking(call):
            if not self.tools.grant(call, self._confirm(call)):
                turn.done(call, None, denied=True)
                self._say("  ✗ denied")
                return True
        cancel = threading.Event()
        try:
            with ctrl_c_sets(cancel):  # Ctrl+C sets it: the call is abandoned on the server within 0.1 s
                result = self.tools.run(call, cancel)
        except KeyboardInterrupt:  # outside the main thread, where the handler cannot be ours
            cancel.set()
        if cancel.is_set():
            turn.done(call, None, stopped=True)
            return False
        turn.done(call, result)
        mark = "✗" if result.is_error else "→"
        shown = result.text if len(result.text) <= 600 else result.text[:600] + " …"
        self._say(f"  {mark} " + shown.replace("\n", "\n    "))
        return True

    def _confirm(self, call: ToolCall) -> Decision:
        """Ask on the terminal: allow once, always (for this session), or deny (also on Ctrl+D / Ctrl+C)."""
        prompt = f"Allow {call.tool}? [o]nce, [a]lways in this session, [d]eny: "
        while True:
            try:
                word = self._read(prompt).strip().lower()
            except (EOFError, KeyboardInterrupt):
                self.out.write("\n")
                return "deny"
            self._forget_last_line()
            if word in ("o", "once", "y", "yes"):
                return "once"
            if word in ("a", "always", "c", "chat"):
                return "chat"
            if word in ("d", "deny", "n", "no", ""):
                return "deny"

    # -------------------------------------------------------------------------------- commands

    def command(self, line: str) -> str | None:
        """Run a /command; returns "exit" for /bye."""
        try:
            words = shlex.split(line)
        except ValueError:
            words = line.split()
        cmd, args = words[0].lower(), words[1:]
        if cmd in ("/bye", "/exit"):
            return "exit"
        if cmd in ("/?", "/help"):
            if args and args[0] == "shortcuts":
                self._say(SHORTCUTS)
            elif args and args[0] == "set":
                self._say(SET_HELP)
            elif args and args[0] == "show":
                self._say(SHOW_HELP)
            else:
                self._say(HELP)
        elif cmd == "/set":
            self._set(line, args)
        elif cmd == "/show":
            self._show(args)
        elif cmd == "/image":
            self._image(args)
        elif cmd == "/audio":
            self._audio(args)
        elif cmd == "/clear":
            self.messages.clear()
            self.pending_images.clear()
            self._say("Cleared session context")
        elif cmd == "/load":
            self._load(args)
        elif cmd == "/save":
            self._save(args)
        elif cmd == "/tools":
            self._say(self.tools_text())
        else:
            self._say(f"Unknown command '{words[0]}'. Type /? for help")
        return None

    def _image(self, args: list[str]) -> None:
        from localllm.images import read_image

        if not args:
            self._say("Usage: /image <path>")
            return
        path = " ".join(args)
        try:
            self.pending_images.append(read_image(path))
        except LocalLLMError as e:
            self.err.write(f"Error: {e}\n")
            return
        self._say(f"Added image '{path}' to the next message")

    def _audio(self, args: list[str]) -> None:
        from localllm.audio import duration_label, read_audio

        if not args:
            self._say("Usage: /audio <path>")
            return
        path = " ".join(args)
        try:
            self.pending_images.append(read_audio(path))  # clips ride with the images, as in Ollama's API
        except LocalLLMError as e:
            self.err.write(f"Error: {e}\n")
            return
        self._say(f"Added audio '{path}' ({duration_label(self.pending_images[-1])}) to the next message")

    def _set(self, line: str, args: list[str]) -> None:
        s = self.settings
        if not args:
            self._say(SET_HELP)
            return
        what = args[0].lower()
        if what == "parameter":
            if len(args) < 3:
                self._say(PARAM_HELP)
                return
            self._set_parameter(args[1], args[2:])
        elif what == "system":
            # everything after "/set system", quotes and spacing kept as typed
            rest = line.split(None, 2)[2] if len(line.split(None, 2)) > 2 else ""
            rest = rest.strip()
            if len(rest) >= 2 and rest[0] == rest[-1] and rest[0] in "\"'":
                rest = rest[1:-1]
            s.system = rest or None
            self._say("Set system message.")
        elif what == "format":
            if args[1:] != ["json"]:
                self._say("Invalid or missing format. For 'json' mode use '/set format json'")
                return
            s.format = "json"
            self._say("Set format to 'json' mode.")
        elif what == "noformat":
            s.format = None
            self._say("Disabled format.")
        elif what == "verbose":
            s.verbose = True
            self._say("Set 'verbose' mode.")
        elif what == "quiet":
            s.verbose = False
            self._say("Set 'quiet' mode.")
        elif what == "history":
            self.history = True
            self._say("Set 'history' mode.")
        elif what == "nohistory":
            self.history = False
            self._say("Set 'nohistory' mode.")
        elif what == "think":
            self._set_think(args[1] if len(args) > 1 else None)
        elif what == "nothink":
            s.think = False
            self._warn_if_it_cannot_think()
            self._say("Set 'nothink' mode.")
        else:
            self._say(f"Unknown command '/set {args[0]}'. Type /? for help")

    def _set_think(self, level: str | None) -> None:
        """``/set think [low|medium|high]`` (Ollama's: the level is checked by the model's template)."""
        try:
            value = parse_think_flag(level or "true")
        except LocalLLMError as e:
            self._say(str(e))
            return
        self.settings.think = value
        self._warn_if_it_cannot_think()
        self._say(f"Set 'think' mode to '{level}'." if level else "Set 'think' mode.")

    def _warn_if_it_cannot_think(self) -> None:
        """Ollama's warning (stderr) when the model's template does not think."""
        info = self._installed()
        if info is not None and "thinking" not in info.capabilities:
            self.err.write(f"warning: model {self.model!r} does not support thinking output\n")

    def _set_parameter(self, name: str, values: list[str]) -> None:
        name = name.lower()
        if name not in PARAMETERS:
            self._say(f"Unknown parameter '{name}'. Type '/set parameter' to see them.")
            return
        attr, kind = PARAMETERS[name]
        try:
            value: Any = list(values) if kind is list else kind(values[0])
        except ValueError:
            self._say(f"Couldn't set parameter: '{name}' needs a {kind.__name__}, got '{values[0]}'.")
            return
        s = self.settings
        if name == "num_ctx":
            if value < 1:
                self._say("Couldn't set parameter: 'num_ctx' must be positive.")
                return
            s.load = replace(s.load, num_ctx=value)  # the engine reloads with it on the next answer
        else:
            s.sampling.choose(**{attr: value})  # the user's choice: it wins over the model's PARAMETER
        shown = ", ".join(values) if kind is list else values[0]
        self._say(f"Set parameter '{name}' to '{shown}'")

    def _show(self, args: list[str]) -> None:
        if not args:
            self._say(SHOW_HELP)
            return
        what = args[0].lower()
        if what == "info":
            self._say(self.info_text())
        elif what == "parameters":
            self._say(self.parameters_text())
        elif what == "system":
            info = self._installed()
            self._say(self.settings.system or (info.system if info else None)
                      or "No system message was specified for this model.")
        elif what == "modelfile":
            info = self._installed()
            self._say(info.modelfile.rstrip("\n") if info and info.modelfile else f"FROM {self.model}")
        elif what == "template":
            info = self._installed()
            self._say((info.chat_template if info else None) or "No prompt template was specified for this model.")
        elif what == "license":
            info = self._installed()
            self._say((info.license if info else None) or "No license was specified for this model.")
        else:
            self._say(f"Unknown command '/show {args[0]}'. Type /? for help")

    def _save(self, args: list[str]) -> None:
        """``/save NAME``: a model made of this session (Ollama's ``/save``): the model it runs, the system prompt,
        the parameters set with ``/set parameter`` and the conversation so far as its MESSAGE history."""
        from localllm.modelfile import Modelfile

        if len(args) != 1:
            self._say("Usage:\n  /save <modelname>")
            return
        s = self.settings
        names = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                 "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n", "seed": "seed",
                 "max_tokens": "num_predict", "stop": "stop"}
        chosen = s.sampling.chosen()  # what --flags and /set chose, default values included
        params = {key: getattr(s.sampling, attr) for attr, key in names.items() if attr in chosen}
        if s.load.num_ctx:
            params["num_ctx"] = s.load.num_ctx
        history = [{"role": str(m["role"]), "content": str(m.get("content") or "")} for m in self.messages
                   if m.get("role") in ("user", "assistant")]
        mf = Modelfile(from_=self.model, parameters=params, system=s.system, messages=history)
        try:
            made = self.models.create(args[0], mf)
        except LocalLLMError as e:
            self.err.write(f"Error: {e}\n")
            return
        self._say(f"Created new model '{made.name}'")

    def _load(self, args: list[str]) -> None:
        if len(args) != 1:
            self._say("Usage:\n  /load <modelname>")
            return
        try:
            name = ensure_model(self.models, args[0]).name
            self._say(f"Loading model '{name}'")
            self.runner.load(name, self.settings.load, keep_alive=self.settings.keep_alive)
        except (LocalLLMError, BackendError) as e:
            self.err.write(f"Error: {e}\n")
            return
        if name != self.model:
            self.runner.unload(self.model)
        self.model = name
        self.messages.clear()
        self._tools_supported = None
        if self.tools is not None:
            self._use_tools()

    # -------------------------------------------------------------------------------- /show text

    def _installed(self) -> Installed | None:
        try:
            return self.models.show(self.model)
        except LocalLLMError:
            return None

    def info_text(self) -> str:
        """Ollama's ``/show info`` sections, plus how this session loaded the model."""
        m = self._installed()
        rows: list[tuple[str, str]] = []
        if m is not None:
            rows += [("architecture", m.architecture or "?"), ("parameters", m.parameter_label or "?"),
                     ("context length", str(m.context_length or "?")),
                     ("embedding length", str(m.embedding_length or "?")), ("quantization", m.quantization or "?")]
        lines = ["  Model"] + [f"    {k:<20}{v}" for k, v in rows]
        if m is not None and m.capabilities:
            lines += ["", "  Capabilities"] + [f"    {c}" for c in m.capabilities]
        running = next((r for r in self.runner.ps() if r.name == self.model), None)
        if running is not None:
            lines += ["", "  Session"]
            session = [("backend", running.backend), ("context", str(running.context_length)),
                       ("kv cache", running.kv_cache_type),
                       ("gpu layers", f"{running.n_gpu_layers}/{running.n_layers}" if running.n_layers else ""),
                       ("draft", running.draft or ("none" if running.backend else "")),
                       ("processor", running.processor)]
            lines += [f"    {k:<20}{v}" for k, v in session if v]
        if m is not None and m.license:
            lines += ["", "  License", f"    {m.license.splitlines()[0]}"]
        return "\n".join(lines) + "\n"

    def parameters_text(self) -> str:
        s = self.settings.sampling
        rows = [("temperature", s.temperature), ("top_k", s.top_k), ("top_p", s.top_p), ("min_p", s.min_p),
                ("repeat_penalty", s.repeat_penalty), ("repeat_last_n", s.repeat_last_n),
                ("seed", s.seed), ("num_predict", s.max_tokens), ("num_ctx", self.settings.load.num_ctx),
                ("stop", " ".join(s.stop) if s.stop else None),
                ("think", None if self.settings.think is None else str(self.settings.think).lower())]
        lines = ["Model defined parameters:", "No additional parameters were specified for this model.", "",
                 "User defined parameters:"]
        lines += [f"{k:<30}{v}" for k, v in rows if v is not None]
        return "\n".join(lines) + "\n"

    def _say(self, text: str) -> None:
        self.out.write(text if text.endswith("\n") else text + "\n")
        self.out.flush()

    # -------------------------------------------------------------------------------- readline

    def _setup_readline(self) -> None:
        if self._read is not input or not isatty(sys.stdin):
            return
        try:
            import readline
        except ImportError:  # Windows without pyreadline: plain input()
            return
        from localllm.config import paths

        path = paths().data / "history"
        self._history_file = str(path)
        readline.set_history_length(1000)
        if self.history and path.exists():
            try:
                readline.read_history_file(self._history_file)
            except OSError:
                pass

    def _forget_last_line(self) -> None:
        """Keep a confirmation's answer out of the prompt history (Up recalls messages, not "o")."""
        if not self._history_file:
            return
        import readline

        n = readline.get_current_history_length()
        if n:
            readline.remove_history_item(n - 1)

    def _save_history(self) -> None:
        if not self._history_file or not self.history:
            return
        import readline

        try:
            os.makedirs(os.path.dirname(self._history_file), exist_ok=True)
            readline.write_history_file(self._history_file)
        except OSError:
            pass
