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
    modules = _modules()
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


def _modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for pkg in ("localllm", "backends"):
        for p in (ROOT / pkg).rglob("*.py"):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return modules


def _defined(path: Path) -> set[str]:
    """The names a module defines at its top level (in ``if``/``try`` blocks too), not the ones it imports."""
    import ast

    out: set[str] = set()

    def walk(body: list) -> None:
        for n in body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(n.name)
            elif isinstance(n, ast.Assign):
                out.update(x.id for t in n.targets for x in ast.walk(t) if isinstance(x, ast.Name))
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                out.add(n.target.id)
            elif isinstance(n, (ast.If, ast.Try)):
                walk(n.body)
                walk(n.orelse)
                for h in getattr(n, "handlers", []):
                    walk(h.body)

    walk(ast.parse(path.read_text(encoding="utf-8")).body)
    return out


def test_every_name_is_imported_from_where_it_is_defined():
    """One home per type: ``from M import X`` in the project names the module that defines ``X``. Two exceptions,
    both deliberate: :mod:`localllm.api`, the one seam the faces take the backend contract from, and a package's
    ``__init__`` naming what its own modules define (``localllm.store``, ``localllm.planner``)."""
    import ast

    modules = _modules()
    defined = {m: _defined(p) for m, p in modules.items()}

    def home(module: str, name: str, depth: int = 0) -> str:  # where ``name`` seen in ``module`` comes from
        if name in defined[module] or depth > 8:
            return module
        for n in ast.walk(ast.parse(modules[module].read_text(encoding="utf-8"))):
            if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module in modules:
                if any((a.asname or a.name) == name for a in n.names):
                    return home(n.module, next(a.name for a in n.names if (a.asname or a.name) == name), depth + 1)
        return module

    bad = []
    for p in modules.values():
        for n in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if not (isinstance(n, ast.ImportFrom) and n.level == 0 and n.module in modules):
                continue
            for a in n.names:
                if a.name in defined[n.module] or f"{n.module}.{a.name}" in modules or n.module == "localllm.api":
                    continue
                origin = home(n.module, a.name)
                if modules[n.module].name == "__init__.py" and origin.startswith(n.module + "."):
                    continue
                bad.append(f"{p.relative_to(ROOT)}:{n.lineno}: {a.name} from {n.module} (defined in {origin})")
    assert not bad, "\n".join(bad)


def test_faces_take_the_backend_contract_from_the_seam():
    """The CLI, the server, the TUI and the remote client import the request and event types from
    :mod:`localllm.api`, not from the engine (which they may still construct); no module but the seam keeps a
    list of another's names (``noqa: F401`` re-exports)."""
    import ast

    faces = [p for face in ("cli", "server", "tui") for p in (ROOT / "localllm" / face).rglob("*.py")]
    faces += [ROOT / "localllm" / "client.py", ROOT / "localllm" / "session.py"]
    bad = [f"{p.relative_to(ROOT)}:{n.lineno}: {a.name}" for p in faces
           for n in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
           if isinstance(n, ast.ImportFrom) and n.module == "localllm.engine" for a in n.names if a.name != "Engine"]
    assert not bad, bad
    reexports = [f"{p.relative_to(ROOT)}:{i}" for p in _modules().values() if p != ROOT / "localllm" / "api.py"
                 for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
                 if "noqa: F401" in line and ("re-export" in line or "for the faces" in line)]
    assert not reexports, reexports
    assert "backends.base" not in _modules()


def test_backends_is_one_contract_one_core_and_its_engines():
    """``backends/`` at a glance: the contract, the serving core, one package per engine, and beside them only the
    descriptors, the registry and the GGUF header reader (a new module goes into the package of its concern)."""
    top = {p.name for p in (ROOT / "backends").iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()}
    assert top == {"__init__.py", "descriptor.py", "registry.py", "gguf_header.py", "contract", "core", "llamacpp",
                   "mlx"}, sorted(top)


# The modules of localllm/ that offer what only one backend has, and import it from that backend's package: MLX
# weights (conversion, pulls), llama.cpp's device list and RPC workers, an MTP drafter's memory, GGUF quantization.
BACKEND_FEATURES = {"localllm/mlxmodels.py": "mlx", "localllm/mlxpull.py": "mlx", "localllm/devices.py": "llamacpp",
                    "localllm/planner/estimation.py": "llamacpp", "localllm/store/create.py": "llamacpp"}


def test_nothing_outside_backends_decides_by_a_backends_name():
    """A decision about a backend reads its descriptor (``memory``, ``mtp``, ``devices``...), never its name: no
    string in ``localllm/`` (docstrings and help texts aside) is a backend's name, and only the modules of
    :data:`BACKEND_FEATURES` import a backend's package, each the one package of its feature."""
    import ast

    from backends import descriptor

    names = set(descriptor.names())
    spelled, imports = [], {}
    for p in (ROOT / "localllm").rglob("*.py"):
        rel = p.relative_to(ROOT).as_posix()
        for n in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(n, ast.Constant) and n.value in names:
                spelled.append(f"{rel}:{n.lineno}: {n.value!r}")
            modules = ([n.module or ""] + [f"{n.module}.{a.name}" for a in n.names] if isinstance(n, ast.ImportFrom)
                       else [a.name for a in n.names] if isinstance(n, ast.Import) else [])
            for m in modules:
                parts = m.split(".")
                if parts[0] == "backends" and len(parts) > 1 and parts[1] in names:
                    imports.setdefault(rel, set()).add(parts[1])
    assert not spelled, spelled
    assert imports == {k: {v} for k, v in BACKEND_FEATURES.items()}
