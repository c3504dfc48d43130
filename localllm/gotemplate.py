"""Ollama's Go-template chat templates → Jinja, for the constructs Ollama's library uses, so that a Modelfile's
``TEMPLATE`` in Ollama's form renders here (through the same Jinja path as a GGUF's own template).

Translated: text; ``{{- ... -}}`` trim markers (Jinja's ``-`` trims the same whitespace; ``+`` is added where
Go does not trim, so ``trim_blocks``/``lstrip_blocks`` change nothing); ``if``/``else if``/``else``/``end``;
``range .X``, ``range $i, $_ := .X`` and ``range $x := .X`` (``$i`` is the loop index); ``$x := pipeline``;
``break``/``continue``; comments; the fields ``.System``, ``.Prompt``, ``.Response``, ``.Messages``, ``.Tools``,
``.Think``, ``.IsThinkSet`` and, inside a range, ``.Role``, ``.Content``, ``.ToolCalls``, ``.Function.Name``,
``.Function.Arguments`` (any CamelCase field → its snake_case key), ``$.X`` for the top level; the functions
``eq ne lt le gt ge and or not len slice index json``; parentheses and ``|`` pipelines. A value that is not a
string is printed as JSON (as Go prints a tool or its arguments). ``.System`` is the chat's system messages
joined (Ollama's ``collate``); system messages stay in ``.Messages`` as Ollama keeps them.

A template without ``.Messages`` (the older ``.System``/``.Prompt``/``.Response`` form) is rendered once per
turn as Ollama does, the last turn cut at ``{{ .Response }}``.

Anything else (``with``, ``define``, ``template``, ``printf``, reassigning a variable, ...) raises
:class:`GoTemplateError` naming the line and the construct.

>>> from jinja2.sandbox import ImmutableSandboxedEnvironment as Env
>>> go = "{{ if .System }}S:{{ .System }};{{ end }}{{ range .Messages }}{{ .Role }}:{{ .Content }};{{ end }}"
>>> Env(trim_blocks=True, lstrip_blocks=True).from_string(to_jinja(go)).render(
...     messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
'S:be brief;system:be brief;user:hi;'
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

ROOT = {"System": "system", "Prompt": "prompt", "Response": "response", "Messages": "messages", "Tools": "tools",
        "Think": "think", "ThinkLevel": "think_level", "IsThinkSet": "is_think_set", "Suffix": "suffix"}
_ACTION = re.compile(r"\{\{(-[ \t\r\n])?(.*?)([ \t\r\n]-)?\}\}", re.S)
_TOKEN = re.compile(r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<raw>`[^`]*`)|(?P<num>-?\d+(?:\.\d+)?)|(?P<p>[()|])|'
                    r'(?P<var>\$[A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)|(?P<field>(?:\.[A-Za-z_][A-Za-z0-9_]*)+|\.)'
                    r'|(?P<ident>[A-Za-z_][A-Za-z0-9_]*))')
SYSTEM_PRELUDE = ("{%- set system = messages | selectattr('role', 'equalto', 'system') | map(attribute='content') "
                  "| join('\\n\\n') -%}")


class GoTemplateError(ValueError):
    """A Go template construct this translator does not take: the message names it (and its line)."""


def _snake(name: str) -> str:
    """``ToolCalls`` → ``tool_calls``."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


@dataclass
class _Scope:
    kind: str  # "if" | "range"
    item: str = ""  # the loop's item variable (range)
    index_var: str = ""  # Go's $i (range)


class _Translator:
    def __init__(self, text: str) -> None:
        self.text = text
        self.scopes: list[_Scope] = []
        self.vars: dict[str, str] = {}  # Go $name → Jinja expression
        self.depth = 0
        self.line = 1

    def fail(self, what: str) -> GoTemplateError:
        return GoTemplateError(f"its line {self.line}: {what} is not supported")

    # -------------------------------------------------------------------------------- expressions
    def dot(self) -> str:
        for s in reversed(self.scopes):
            if s.kind == "range":
                return s.item
        return ""

    def field(self, chain: str, base: str) -> str:
        parts = [p for p in chain.split(".") if p]
        if not base:  # the top level
            if not parts:
                raise self.fail("'.' at the top level")
            head = ROOT.get(parts[0])
            if head is None:
                raise self.fail(f"the field .{parts[0]}")
            return ".".join([head] + [_snake(p) for p in parts[1:]])
        return ".".join([base] + [_snake(p) for p in parts])

    def tokens(self, expr: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        pos = 0
        expr = expr.strip()
        while pos < len(expr):
            m = _TOKEN.match(expr, pos)
            if not m or m.end() == pos:
                raise self.fail(f"the expression {expr[pos:pos + 20]!r}")
            kind = m.lastgroup or ""
            out.append((kind, m.group(kind)))
            pos = m.end()
            while pos < len(expr) and expr[pos].isspace():
                pos += 1
        return out

    def expr(self, text: str) -> str:
        toks = self.tokens(text)
        value, rest = self.pipeline(toks)
        if rest:
            raise self.fail(f"the expression {text.strip()[:30]!r}")
        return value

    def pipeline(self, toks: list[tuple[str, str]]) -> tuple[str, list[tuple[str, str]]]:
        value, toks = self.command(toks, None)
        while toks and toks[0] == ("p", "|"):
            value, toks = self.command(toks[1:], value)
        return value, toks

    def command(self, toks: list[tuple[str, str]], piped: str | None) -> tuple[str, list[tuple[str, str]]]:
        if not toks:
            raise self.fail("an empty command")
        kind, val = toks[0]
        if kind == "ident" and val not in ("true", "false", "nil"):
            args: list[str] = []
            toks = toks[1:]
            while toks and toks[0] not in (("p", ")"), ("p", "|")):
                a, toks = self.operand(toks)
                args.append(a)
            if piped is not None:
                args.append(piped)
            return self.call(val, args), toks
        value, toks = self.operand(toks)
        if piped is not None:
            raise self.fail("a pipeline into a value")
        return value, toks

    def operand(self, toks: list[tuple[str, str]]) -> tuple[str, list[tuple[str, str]]]:
        kind, val = toks[0]
        toks = toks[1:]
        if (kind, val) == ("p", "("):
            inner, toks = self.pipeline(toks)
            if not toks or toks[0] != ("p", ")"):
                raise self.fail("an unclosed '('")
            return f"({inner})", toks[1:]
        if kind == "str":
            return json.dumps(json.loads(val)), toks
        if kind == "raw":
            return json.dumps(val[1:-1]), toks
        if kind == "num":
            return val, toks
        if kind == "ident":
            return {"true": "true", "false": "false", "nil": "none"}[val], toks
        if kind == "field":
            base = self.dot()
            if val == ".":
                if not base:
                    raise self.fail("'.' at the top level")
                return base, toks
            return self.field(val, base), toks
        if kind == "var":
            name, _, chain = val.partition(".")
            if name == "$":
                if not chain:
                    raise self.fail("'$' alone")
                return self.field(chain, ""), toks
            if name not in self.vars:
                raise self.fail(f"the variable {name} (never set)")
            head = self.vars[name]
            return (self.field(chain, head) if chain else head), toks
        raise self.fail(f"{val!r}")

    def call(self, fn: str, args: list[str]) -> str:
        binary = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
        if fn in binary and len(args) >= 2:
            if fn == "eq" and len(args) > 2:
                return "(" + " or ".join(f"{args[0]} == {a}" for a in args[1:]) + ")"
            return f"({args[0]} {binary[fn]} {args[1]})"
        if fn in ("and", "or") and args:
            return "(" + f" {fn} ".join(args) + ")"
        if fn == "not" and len(args) == 1:
            return f"(not {args[0]})"
        if fn == "len" and len(args) == 1:
            return f"({args[0]} | length)"
        if fn == "slice" and len(args) in (2, 3):
            return f"{args[0]}[{args[1]}:{args[2] if len(args) == 3 else ''}]"
        if fn == "index" and len(args) == 2:
            return f"{args[0]}[{args[1]}]"
        if fn in ("json", "toJson") and len(args) == 1:
            return f"({args[0]} | tojson)"
        raise self.fail(f"the function {fn}")

    # -------------------------------------------------------------------------------- actions
    def block(self, body: str, left: bool, right: bool) -> str:
        return f"{{%{'-' if left else '+'} {body} {'-' if right else '+'}%}}"

    def action(self, body: str, left: bool, right: bool) -> str:
        b = body.strip()
        if b.startswith("/*"):
            return f"{{#{'-' if left else ''} go comment {'-' if right else ''}#}}"
        word = b.split(None, 1)[0] if b else ""
        rest = b[len(word):].strip()
        if word == "if":
            self.scopes.append(_Scope("if"))
            return self.block(f"if {self.expr(rest)}", left, right)
        if word == "else":
            if not self.scopes or self.scopes[-1].kind != "if":
                raise self.fail("'else' outside an if")
            if rest.startswith("if "):
                return self.block(f"elif {self.expr(rest[3:])}", left, right)
            if rest:
                raise self.fail(f"'else {rest.split()[0]}'")
            return self.block("else", left, right)
        if word == "end":
            if not self.scopes:
                raise self.fail("an 'end' without its opening")
            s = self.scopes.pop()
            if s.kind == "range":
                for v in [k for k, e in self.vars.items() if e in (s.item, "loop.index0")]:
                    del self.vars[v]
            return self.block("endif" if s.kind == "if" else "endfor", left, right)
        if word == "range":
            m = re.match(r"^(\$\w*)\s*(?:,\s*(\$\w*)\s*)?:=\s*(.*)$", rest, re.S)
            index_var = item_var = ""
            if m:
                if m.group(2):
                    index_var, item_var = m.group(1), m.group(2)
                else:
                    item_var = m.group(1)
                rest = m.group(3)
            seq = self.expr(rest)
            self.depth += 1
            item = f"it{self.depth}"
            self.scopes.append(_Scope("range", item, index_var))
            if index_var:
                self.vars[index_var] = "loop.index0"
            if item_var:
                self.vars[item_var] = item
            return self.block(f"for {item} in {seq}", left, right)
        if word in ("break", "continue") and not rest:
            return self.block(word, left, right)
        if word in ("with", "define", "template", "block"):
            raise self.fail(f"'{word}'")
        m = re.match(r"^(\$\w+)\s*(:?=)\s*(.*)$", b, re.S)
        if m:
            name, op, value = m.groups()
            if op == "=" and name in self.vars:
                raise self.fail(f"reassigning {name}")
            jname = "v_" + name[1:]
            out = self.block(f"set {jname} = {self.expr(value)}", left, right)
            self.vars[name] = jname
            return out
        value = self.expr(b)
        shown = (f"('' if {value} is undefined or {value} is none else ({value} if {value} is string "
                 f"else {value} | tojson))")
        return f"{{{{{'-' if left else ''} {shown} {'-' if right else ''}}}}}"

    def run(self, text: str, cut_response: bool = False) -> str:
        out: list[str] = []
        pos = 0
        cut = False
        for m in _ACTION.finditer(text):
            chunk = text[pos:m.start()]
            out.append(_escape(chunk))
            self.line += chunk.count("\n")
            body = m.group(2)
            if cut_response and not cut and body.strip() == ".Response" and not self.scopes:
                out.append("{%+ if not final +%}")  # the last turn ends where the answer would begin
                cut = True
            out.append(self.action(body, bool(m.group(1)), bool(m.group(3))))
            self.line += m.group(0).count("\n")
            pos = m.end()
        out.append(_escape(text[pos:]))
        if self.scopes:
            raise GoTemplateError(f"an '{self.scopes[-1].kind}' is never closed with 'end'")
        if cut:
            out.append("{%+ endif +%}")
        return "".join(out)


def _escape(text: str) -> str:
    """Template text as Jinja literal text (its own ``{%``, ``{{``, ``{#`` would start tags)."""
    if not any(t in text for t in ("{%", "{{", "{#")):
        return text
    return "{% raw %}" + text + "{% endraw %}"


def uses_messages(template: str) -> bool:
    return bool(re.search(r"\.Messages\b", template))


def to_jinja(template: str) -> str:
    """The Jinja template that renders what Ollama renders from the Go ``template`` (a :class:`GoTemplateError`
    naming the construct and its line for what is not translated)."""
    if uses_messages(template):
        return SYSTEM_PRELUDE + _Translator(template).run(template)
    body = _Translator(template).run(template, cut_response=True)
    # Ollama's older form: the template per turn (system, prompt, response), the last one cut at the answer
    return (
        "{%- macro turn(system, prompt, response, final) -%}" + body + "{%- endmacro -%}"
        "{%- set ns = namespace(system='', prompt='', response='', out='') -%}"
        "{%- for m in messages -%}"
        "{%- if m.role == 'system' -%}"
        "{%- if ns.prompt or ns.response -%}{%- set ns.out = ns.out + turn(ns.system, ns.prompt, ns.response, false)"
        " -%}{%- set ns.system = '' -%}{%- set ns.prompt = '' -%}{%- set ns.response = '' -%}{%- endif -%}"
        "{%- set ns.system = m.content -%}"
        "{%- elif m.role == 'user' -%}"
        "{%- if ns.response -%}{%- set ns.out = ns.out + turn(ns.system, ns.prompt, ns.response, false) -%}"
        "{%- set ns.system = '' -%}{%- set ns.prompt = '' -%}{%- set ns.response = '' -%}{%- endif -%}"
        "{%- set ns.prompt = m.content -%}"
        "{%- elif m.role == 'assistant' -%}{%- set ns.response = m.content -%}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{{- ns.out -}}{{- turn(ns.system, ns.prompt, ns.response, not ns.response) -}}"
    )
