"""Ollama's Modelfile: parse it into a :class:`Modelfile`, check it, and write one back (``show --modelfile``).

A Modelfile describes a model of one's own over a base model::

    # a terse assistant
    FROM smollm2:135m
    PARAMETER temperature 0
    PARAMETER stop "<|im_end|>"
    PARAMETER stop "User:"
    SYSTEM \"\"\"You answer in one short sentence.\"\"\"
    MESSAGE user Is Paris in France?
    MESSAGE assistant Yes.

Instructions (case-insensitive, one per line, ``#`` starts a comment line, a value in ``\"\"\"`` may span
lines, a value in ``"`` is unquoted), as Ollama parses them (``parser/parser.go``):

* ``FROM`` (required, once): a catalog name, an installed model, a local ``.gguf`` path, or a blob digest
  ``sha256:<hex>``; what it means is the store's (:meth:`localllm.store.Store.create`).
* ``PARAMETER NAME VALUE``: an option of Ollama's (the names and types of :data:`PARAMETERS`); ``stop`` may
  repeat and adds a stop sequence each time; any other name set twice keeps the last value.
* ``SYSTEM``, ``TEMPLATE``, ``LICENSE`` (may repeat: each is one license text), ``MESSAGE ROLE TEXT``
  (``system``, ``user``, ``assistant``, ``tool``: a history that starts every chat).
* ``TEMPLATE`` is a Jinja chat template as GGUF files carry it, or Ollama's Go-template form (``{{ .Prompt }}``,
  ``{{ range .Messages }}``), translated to Jinja for the constructs Ollama's library uses
  (:mod:`localllm.gotemplate`); any other construct is refused with its line.
* ``ADAPTER PATH [SCALE]``: a LoRA adapter in GGUF, applied through llama.cpp's adapter API with ``SCALE``
  (ours; default 1.0). Ollama's form has no scale.
* ``DRAFT NAME`` (ours): the draft model for speculative decoding, as ``run --draft NAME`` takes it
  (``ngram``, ``none``, an installed name); it replaces the catalog's pairing for this model.
* ``PROJECTOR PATH`` (ours, once): the model's vision or audio projector (``mmproj`` GGUF), a path (relative to
  the Modelfile's folder, like ``FROM``) or an uploaded blob ``sha256:<hex>``. Ollama names it with a second
  ``FROM``; a ``FROM ./model.gguf`` with an ``mmproj*.gguf`` beside it takes that one without the line.

Every mistake is a :class:`ModelfileError`: one sentence that names the line.

>>> mf = parse('FROM smollm2:135m\\nparameter temperature 0\\nPARAMETER stop "a b"\\nPARAMETER stop x\\nSYSTEM hi')
>>> mf.from_, mf.parameters, mf.system
('smollm2:135m', {'temperature': 0.0, 'stop': ['a b', 'x']}, 'hi')
>>> try:
...     parse("SYSTEM hi")
... except ModelfileError as e:
...     print(e)
The Modelfile has no FROM line: say which model it builds on (FROM smollm2:135m).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from localllm.errors import LocalLLMError

if TYPE_CHECKING:
    from backends.contract.specs import GenerateRequest

# Ollama's option names (api.Options + api.Runner) → the type PARAMETER takes
INTEGER, NUMBER, BOOLEAN, STRING = "integer", "number", "boolean", "string"
PARAMETERS: dict[str, str] = {
    "num_ctx": INTEGER, "num_batch": INTEGER, "num_gpu": INTEGER, "main_gpu": INTEGER, "num_thread": INTEGER,
    "num_keep": INTEGER, "seed": INTEGER, "num_predict": INTEGER, "top_k": INTEGER, "repeat_last_n": INTEGER,
    "draft_num_predict": INTEGER, "num_cpu_moe": INTEGER,
    "temperature": NUMBER, "top_p": NUMBER, "min_p": NUMBER, "typical_p": NUMBER, "repeat_penalty": NUMBER,
    "presence_penalty": NUMBER, "frequency_penalty": NUMBER,
    "use_mmap": BOOLEAN, "numa": BOOLEAN, "low_vram": BOOLEAN, "penalize_newline": BOOLEAN, "cpu_moe": BOOLEAN,
    "stop": STRING,
}
ROLES = ("system", "user", "assistant", "tool")
INSTRUCTIONS = ("from", "parameter", "system", "template", "message", "license", "adapter", "draft", "projector")

# Go-template actions Ollama's library uses: {{ .Prompt }}, {{- range .Messages }}, {{ end }}, {{ if .System }}
_GO_ACTION = re.compile(r"\{\{-?\s*(\.|\$|range\b|end\b|if\s|else\b|with\b|template\b|define\b|block\b|json\b)")


class ModelfileError(LocalLLMError):
    """A Modelfile that cannot be used; the message names the line."""


@dataclass
class Modelfile:
    """What a Modelfile says. ``parameters`` holds typed values (``stop``: a list of strings)."""

    from_: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    system: str | None = None
    template: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)
    license: list[str] = field(default_factory=list)
    adapters: list[str] = field(default_factory=list)
    draft: str | None = None
    projector: str | None = None  # a projector GGUF's path or blob digest (the store records it apart)

    def render(self) -> str:
        """The Modelfile text that recreates this (what ``show --modelfile`` prints; :func:`parse` reads it
        back to an equal :class:`Modelfile`)."""
        out = [f"FROM {self.from_}"]
        out += [f"ADAPTER {a}" for a in self.adapters]
        if self.template is not None:
            out.append(f"TEMPLATE {_quote(self.template)}")
        if self.system is not None:
            out.append(f"SYSTEM {_quote(self.system)}")
        for key, value in self.parameters.items():
            for v in value if isinstance(value, list) else [value]:
                out.append(f"PARAMETER {key} {_param_text(v)}")
        for m in self.messages:
            out.append(f"MESSAGE {m['role']} {_quote(m['content'])}")
        out += [f"LICENSE {_quote(text)}" for text in self.license]
        if self.draft:
            out.append(f"DRAFT {self.draft}")
        if self.projector:
            out.append(f"PROJECTOR {_param_text(self.projector)}")
        return "\n".join(out) + "\n"

    def as_dict(self) -> dict[str, Any]:
        """What a derived model's manifest keeps (everything but FROM, which is the base)."""
        return {"parameters": dict(self.parameters), "system": self.system, "template": self.template,
                "messages": [dict(m) for m in self.messages], "license": list(self.license),
                "adapters": list(self.adapters), "draft": self.draft}


def split_adapter(value: str) -> tuple[str, float]:
    """An ``ADAPTER`` value → (path or digest, scale): a last word that is a number is the scale (default 1).

    >>> split_adapter("./my lora.gguf 0.5"), split_adapter("./lora.gguf")
    (('./my lora.gguf', 0.5), ('./lora.gguf', 1.0))
    """
    head, _, last = value.strip().rpartition(" ")
    if head:
        try:
            return head.strip(), float(last)
        except ValueError:
            pass
    return value.strip(), 1.0


def _param_text(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v.is_integer():
        return str(int(v)) if abs(v) < 1e15 else repr(v)
    if isinstance(v, str):
        return json.dumps(v) if (not v or any(c.isspace() for c in v) or v.startswith(('"', "'"))
                                 or "\\" in v) else v
    return str(v)


def _quote(text: str) -> str:
    """A value written so :func:`parse` gives it back: bare when it is one plain line, else in triple quotes."""
    if text and "\n" not in text and text == text.strip() and not text.startswith('"'):
        return text
    if '"""' in text or text.startswith('"') or text.endswith('"'):
        return json.dumps(text)  # a one-line "..." value with escapes
    return f'"""{text}"""'


def parse_parameter(name: str, raw: str, line: int | None = None) -> Any:
    """One ``PARAMETER`` value as its type (Ollama's names), or a :class:`ModelfileError` naming the line.

    >>> parse_parameter("top_k", "40"), parse_parameter("temperature", "0.2"), parse_parameter("use_mmap", "false")
    (40, 0.2, False)
    """
    where = f"line {line}: " if line is not None else ""
    key = name.lower()
    kind = PARAMETERS.get(key)
    if kind is None:
        raise ModelfileError(f"{where}unknown parameter {name!r} (known: {', '.join(sorted(PARAMETERS))}).")
    value = raw if kind == STRING else raw.strip()
    try:
        if kind == INTEGER:
            return int(value)
        if kind == NUMBER:
            f = float(value)
            if f != f or f in (float("inf"), float("-inf")):
                raise ValueError
            return f
        if kind == BOOLEAN:
            low = value.lower()
            if low in ("true", "1", "t"):
                return True
            if low in ("false", "0", "f"):
                return False
            raise ValueError
    except ValueError:
        raise ModelfileError(f"{where}PARAMETER {key} must be {'an' if kind == INTEGER else 'a'} {kind}, "
                             f"got {value!r}.") from None
    return value


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] == '"':
        try:
            out = json.loads(value)
            if isinstance(out, str):
                return out
        except ValueError:
            pass
        return value[1:-1]
    return value


def _split(text: str) -> list[tuple[int, str, str]]:
    """(line number, instruction, raw value) per instruction; a ``\"\"\"`` value runs to its closing quotes."""
    lines = text.replace("\r\n", "\n").split("\n")
    out: list[tuple[int, str, str]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        n = i + 1
        i += 1
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        word, _, rest_full = line.lstrip().partition(" ")
        if "\t" in word:
            word, _, more = word.partition("\t")
            rest_full = more + " " + rest_full
        rest_full = rest_full.lstrip()  # the text after an opening """ keeps its trailing whitespace
        rest = rest_full.rstrip()
        inst = word.lower()
        if inst not in INSTRUCTIONS:
            raise ModelfileError(f"line {n}: unknown instruction {word!r} (a Modelfile takes "
                                 f"{', '.join(s.upper() for s in INSTRUCTIONS)}).")
        start = rest_full.find('"""')
        if start >= 0:
            # the value (or, for PARAMETER/MESSAGE, its last part) is in triple quotes and may span lines
            head, body = rest_full[:start], rest_full[start + 3:]
            parts: list[str] = []
            while True:
                end = body.find('"""')
                if end >= 0:
                    parts.append(body[:end])
                    tail = body[end + 3:].strip()
                    if tail and not tail.startswith("#"):
                        raise ModelfileError(f"line {i}: unexpected text after the closing \"\"\": {tail[:30]!r}.")
                    break
                parts.append(body)
                if i >= len(lines):
                    raise ModelfileError(f"line {n}: the \"\"\" opened here is never closed.")
                body = lines[i]
                i += 1
            out.append((n, inst, head + "\x00" + "\n".join(parts)))  # \x00: the quoted part follows
        else:
            out.append((n, inst, rest))
    return out


def _value(raw: str) -> str:
    """A whole value: triple-quoted (kept as is), quoted (unquoted) or bare."""
    if "\x00" in raw:
        head, body = raw.split("\x00", 1)
        return (head + body) if head.strip() else body
    return _unquote(raw)


def is_go_template(template: str) -> bool:
    """Whether ``template`` is Ollama's Go-template form rather than Jinja.

    >>> is_go_template("{{ if .System }}{{ .System }}{{ end }}"), is_go_template("{% if x %}{{ m.content }}{% endif %}")
    (True, False)
    """
    return bool(_GO_ACTION.search(template))


def check_template(template: str, line: int | None = None) -> str:
    """The Jinja template to render for a ``TEMPLATE``: Jinja as it is, Ollama's Go-template form translated
    (:mod:`localllm.gotemplate`: the constructs Ollama's library uses); anything else is refused in one sentence
    with the line and what is not supported."""
    where = f"line {line}: " if line is not None else ""
    if _GO_ACTION.search(template):
        from localllm.gotemplate import GoTemplateError, to_jinja

        try:
            template = to_jinja(template)
        except (GoTemplateError, ValueError, KeyError, IndexError, TypeError) as e:  # whatever a bad text does
            raise ModelfileError(f"{where}TEMPLATE is in Ollama's Go-template form and {e} here (translated: "
                                 f"if/else/range/end, variables, eq/ne/and/or/not/len/slice/index/json and the "
                                 f"fields of Ollama's library templates).") from None
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except ImportError:  # pragma: no cover - jinja2 comes with llama-cpp-python
        return template
    except Exception as e:  # noqa: BLE001 - jinja's TemplateSyntaxError and friends
        lineno = getattr(e, "lineno", None)
        raise ModelfileError(f"{where}TEMPLATE is not a readable Jinja template"
                             f"{f' (its line {lineno})' if lineno else ''}: {e}.") from None
    return template


def parse(text: str) -> Modelfile:
    """A Modelfile's text → :class:`Modelfile`, or :class:`ModelfileError` (one sentence with the line)."""
    mf = Modelfile()
    seen_from = False
    for n, inst, raw in _split(text):
        if inst == "from":
            value = _value(raw).strip()
            if not value:
                raise ModelfileError(f"line {n}: FROM needs a model name, a .gguf path or a blob digest.")
            if seen_from:
                raise ModelfileError(f"line {n}: a second FROM; a Modelfile builds on one model.")
            mf.from_, seen_from = value, True
        elif inst == "parameter":
            if "\x00" in raw:
                head, body = raw.split("\x00", 1)
                name, value = head.strip(), body
            else:
                name, _, value = raw.partition(" ")
                value = _unquote(value.strip())
            if not name or (value == "" and "\x00" not in raw):
                raise ModelfileError(f"line {n}: PARAMETER needs a name and a value (PARAMETER temperature 0.7).")
            typed = parse_parameter(name, value, n)
            key = name.lower()
            if key == "stop":
                mf.parameters.setdefault("stop", []).append(typed)
            else:
                mf.parameters[key] = typed
        elif inst == "message":
            if "\x00" in raw:
                head, body = raw.split("\x00", 1)
                role, content = head.strip(), body
            else:
                role, _, content = raw.partition(" ")
                content = _unquote(content.strip())
            if role.lower() not in ROLES:
                raise ModelfileError(f"line {n}: MESSAGE role must be one of {', '.join(ROLES)}, got {role!r}.")
            mf.messages.append({"role": role.lower(), "content": content})
        elif inst == "system":
            mf.system = _value(raw)
        elif inst == "template":
            mf.template = check_template(_value(raw), n)
        elif inst == "license":
            mf.license.append(_value(raw))
        elif inst == "adapter":
            value = _value(raw).strip()
            if not value:
                raise ModelfileError(f"line {n}: ADAPTER needs the path of a LoRA adapter GGUF.")
            mf.adapters.append(value)
        elif inst == "draft":
            value = _value(raw).strip()
            if not value:
                raise ModelfileError(f"line {n}: DRAFT needs a model name (or ngram, or none).")
            mf.draft = value
        elif inst == "projector":
            value = _value(raw).strip()
            if not value:
                raise ModelfileError(f"line {n}: PROJECTOR needs the path of a projector (mmproj) GGUF.")
            if mf.projector is not None:
                raise ModelfileError(f"line {n}: a second PROJECTOR; a model has one projector.")
            mf.projector = value
    if not seen_from:
        raise ModelfileError("The Modelfile has no FROM line: say which model it builds on (FROM smollm2:135m).")
    return mf


def check_parameters(parameters: dict[str, Any]) -> dict[str, Any]:
    """JSON ``parameters`` (``/api/create``) → typed values by :data:`PARAMETERS` (``stop``: a list), or a
    :class:`ModelfileError` naming the parameter.

    >>> check_parameters({"temperature": 0, "stop": "x", "num_ctx": 512.0})
    {'temperature': 0.0, 'stop': ['x'], 'num_ctx': 512}
    """
    out: dict[str, Any] = {}
    for name, value in parameters.items():
        key = name.lower()
        kind = PARAMETERS.get(key)
        if kind is None:
            raise ModelfileError(f"unknown parameter {name!r}.")
        if key == "stop":
            values = value if isinstance(value, list) else [value]
            if not all(isinstance(v, str) for v in values):
                raise ModelfileError('parameter "stop" must be a string or a list of strings.')
            out["stop"] = list(values)
            continue
        if isinstance(value, str):
            out[key] = parse_parameter(key, value)
            continue
        ok = {INTEGER: isinstance(value, int) and not isinstance(value, bool)
              or isinstance(value, float) and value.is_integer(),
              NUMBER: isinstance(value, int | float) and not isinstance(value, bool),
              BOOLEAN: isinstance(value, bool)}.get(kind, False)
        if ok and kind == NUMBER and float(value) in (float("inf"), float("-inf")):
            ok = False
        if ok and kind == NUMBER and float(value) != float(value):  # NaN
            ok = False
        if not ok:
            raise ModelfileError(f'parameter "{key}" must be of type {kind}.')
        out[key] = int(value) if kind == INTEGER else float(value) if kind == NUMBER else value
    return out


# ------------------------------------------------------------------------------------------ applying a model's
# Ollama's layering: what a request sets wins over the model's PARAMETERs, which win over the defaults. A
# request's sampling reaches the engine as a filled-in Sampling that names the fields the request chose
# (``Sampling.given``, filled by every face): those win even when they equal the default (``temperature: 0.8``
# over ``PARAMETER temperature 0``); the model's PARAMETERs replace the rest (an API's own defaults too, as
# OpenAI's temperature 1.0).
_SAMPLING_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                    "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n",
                    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                    "seed": "seed", "num_predict": "max_tokens", "stop": "stop"}


def apply_to_request(mf: Modelfile, request: GenerateRequest) -> GenerateRequest:
    """``request`` with what a derived model adds: its PARAMETERs where the request did not choose the sampling
    field (:meth:`~backends.contract.specs.Sampling.chosen`), and for a chat its SYSTEM (unless the request starts with
    its own system message) and its MESSAGE history, between the system message and the request's turns. A raw prompt
    takes the parameters only."""
    from dataclasses import fields, replace

    from backends.contract.specs import Sampling

    chosen = request.sampling.chosen()
    changes: dict[str, Any] = {}
    names = {f.name for f in fields(Sampling)}
    for key, attr in _SAMPLING_FIELDS.items():
        if key not in mf.parameters or attr not in names:
            continue
        if attr in chosen:
            continue  # the request set it
        value = mf.parameters[key]
        if key == "seed":
            value = None if int(value) < 0 else int(value) % (1 << 32)
        elif key == "num_predict":
            value = -1 if int(value) < 0 else int(value)
        elif key == "stop":
            value = [s for s in value if s]
        changes[attr] = value
    out = replace(request, sampling=replace(request.sampling, **changes)) if changes else request
    if out.messages is None or (mf.system is None and not mf.messages):
        return out
    msgs = list(out.messages)
    lead: list[dict[str, Any]] = []
    while msgs and msgs[0].get("role") == "system":
        lead.append(msgs.pop(0))
    if not lead and mf.system:
        lead = [{"role": "system", "content": mf.system}]
    return replace(out, messages=lead + [dict(m) for m in mf.messages] + msgs)
