"""The project type-checks: ``mypy`` (configured in pyproject.toml: ``files = ["localllm", "backends"]``) reports
no error. Its cache lives in the test cache, so a run after the first checks only what changed (seconds)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_is_clean(test_cache):
    r = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(test_cache / "mypy")], cwd=ROOT,
                       capture_output=True, text=True, timeout=580)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert r.stdout.startswith("Success: no issues found"), r.stdout


def _imports(path, module: str, package: bool, known: set[str], *, type_only: bool = True) -> set[str]:
    """The project modules ``module`` imports, lazy imports in functions included, and (``type_only``) the
    ones under ``if TYPE_CHECKING:`` too: a cycle of type-only imports is still two modules that each need
    the other (what both need belongs in a third)."""
    import ast

    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if not type_only and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for b in node.body for n in ast.walk(b))
    out: set[str] = set()
    base = module.split(".") if package else module.split(".")[:-1]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                mod = ".".join(base[: len(base) - node.level + 1] + ([mod] if mod else []))
            subs = {f"{mod}.{a.name}" for a in node.names} & known  # `from pkg import module`
            out.update(subs or {mod})
    return {m for m in out if m.split(".")[0] in ("localllm", "backends")}


def test_no_import_cycles_in_localllm_and_backends():
    """No cycle among the project's modules, counting imports inside functions (the run ⇄ interactive kind) and
    type-only ones (``if TYPE_CHECKING:``)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    modules: dict[str, Path] = {}
    for pkg in ("localllm", "backends"):
        for p in (root / pkg).rglob("*.py"):
            parts = list(p.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = p
    known = set(modules)
    graph = {m: {i for i in _imports(p, m, p.name == "__init__.py", known) if i in modules and i != m}
             for m, p in modules.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert len(graph) > 40 and any(graph.values())


def test_the_layers_of_design_md_hold():
    """Faces (cli, server, tui) never import ``backends`` (they go through the engine and the services), and
    ``backends`` imports nothing from ``localllm``: every import, also those inside functions."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]

    def imports(path: Path) -> list[tuple[int, str]]:
        out = []
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                out += [(node.lineno, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                out.append((node.lineno, node.module))
        return out

    bad = [f"{p.relative_to(root)}:{n}: {m}" for face in ("cli", "server", "tui")
           for p in sorted((root / "localllm" / face).rglob("*.py"))
           for n, m in imports(p) if m == "backends" or m.startswith("backends.")]
    bad += [f"{p.relative_to(root)}:{n}: {m}" for p in sorted((root / "backends").rglob("*.py"))
            for n, m in imports(p) if m == "localllm" or m.startswith("localllm.")]
    assert not bad, bad
