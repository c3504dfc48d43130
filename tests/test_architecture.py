"""The README's architecture map and the exception tree in ``localllm/__init__.py`` cannot go stale (issue 45): every
module of ``localllm/`` and ``backends/`` is named in the map and every path it names exists; the tree draws every
error class under its real parent, and nothing that is not one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import localllm

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("localllm", "backends")
ROOTS = ("LocalLLMError", "BackendError")


def map_paths() -> set[str]:
    """The paths the README's architecture map names, ``dir/{a,b}.py`` expanded (a brace may wrap lines)."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Architecture\n\n```\n", 1)[1].split("\n```", 1)[0].replace("│", " ")
    out: set[str] = set()
    for m in re.finditer(r"([\w/]*)\{([^}]*)\}\.py|([\w/]+\.py)", block):
        if m.group(3):
            out.add(m.group(3))
        else:
            out.update(f"{m.group(1)}{name.strip()}.py" for name in m.group(2).split(",") if name.strip())
    return out


def modules() -> set[str]:
    return {p.relative_to(ROOT).as_posix() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def test_the_architecture_map_names_every_module_and_only_modules_that_exist():
    named, there = map_paths(), modules()
    assert sorted(there - named) == [], "modules missing from the README's architecture map"
    assert sorted(named - there) == [], "paths in the README's architecture map that do not exist"


def error_tree() -> dict[str, str]:
    """Every class of ``localllm/`` and ``backends/`` below LocalLLMError or BackendError: name -> its parent there."""
    bases: dict[str, list[str]] = {}
    for path in modules():
        for node in ast.walk(ast.parse((ROOT / path).read_text())):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]

    def under_a_root(name: str, seen: frozenset[str] = frozenset()) -> bool:
        return name in ROOTS or (name not in seen and any(under_a_root(b, seen | {name})
                                                           for b in bases.get(name, []) if b != name))

    tree = {}
    for name, its in bases.items():
        parent = next((b for b in its if b != name and under_a_root(b)), None)
        if name not in ROOTS and parent is not None:
            tree[name] = parent
    return tree


def drawn_tree() -> dict[str, str]:
    """The tree drawn in ``localllm/__init__.py``'s docstring: name -> parent, read from the drawing's columns."""
    out: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in (localllm.__doc__ or "").splitlines():
        m = re.match(r"^(    [\s│├└─]*)([A-Z][A-Za-z]+)(?:\s{2,}|$)", line)  # the drawing: indented, a class name
        if not m:
            continue
        col, name = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= col:
            stack.pop()
        if stack:
            out[name] = stack[-1][1]
        elif name not in ROOTS:
            out[name] = "?"  # drawn at the top, but not one of the roots
        stack.append((col, name))
    return out


def test_the_exception_tree_draws_every_error_under_its_parent():
    assert drawn_tree() == error_tree()
