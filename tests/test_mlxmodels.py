"""The MLX model service: where MLX builds of installed models live, converting one offline, and the
engine converting on first use of ``--backend mlx``. Every test that converts works in a home of its own
(the default model hard-linked in, no MLX build), so the shared test home is never changed."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from localllm.formats import Weights
from localllm.mlxmodels import (
    ConversionError,
    cannot_convert_sentence,
    convert_installed,
    convertible,
    mlx_dir_for,
    mlx_for_plan,
    mlx_root,
)


def _tiny_gguf(path: Path, arch: str) -> Path:
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tokenizer_model("gpt2")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def own_home(home: Path, installed_default_model) -> Path:
    """``home`` (an empty LOCALLLM_HOME) holding the default model, without an MLX build of it."""
    from tests.support import TEST_HOME, install_copy

    models = home / "data" / "models"
    install_copy(models, TEST_HOME / "data" / "models")
    manifest = models / "manifests" / "library" / "smollm2" / "135m.json"
    manifest.write_text(json.dumps(json.loads(manifest.read_text()) | {"mlx_path": None, "weights": {}}))
    return home


def _installed(name: str = "smollm2:135m"):
    from localllm.store import Store

    return Store().get(name)


def test_an_unconverted_or_digestless_model_has_no_mlx_dir(home: Path):
    assert mlx_dir_for(SimpleNamespace(name="x", weights_digest="sha256:" + "ab" * 32, path="x.gguf")) is None
    assert mlx_dir_for(SimpleNamespace(name="x", weights_digest=None, path="x.gguf")) is None
    assert mlx_root() == home / "data" / "models" / "mlx"


def test_other_architectures_are_refused_with_a_reason(home: Path, tmp_path: Path):
    model = SimpleNamespace(name="blm", weights_digest="sha256:" + "cd" * 32,
                            path=_tiny_gguf(tmp_path / "b.gguf", "bloom"),
                            weights_of=lambda fmt: None)
    ok, why = convertible(model)
    assert not ok and "'bloom' architecture" in why
    sentence = cannot_convert_sentence("blm", why)
    assert sentence.startswith("blm has no MLX weights and its GGUF cannot be converted to MLX: the MLX converter")
    assert sentence.endswith("; run it with --backend llamacpp, or install an MLX build of it.")
    assert mlx_for_plan(model, None, "llamacpp") is None
    pytest.importorskip("mlx.core")
    from localllm.hardware import probe

    with pytest.raises(ConversionError) as e:  # --backend mlx where MLX runs: that one sentence
        mlx_for_plan(model, probe(), "mlx")
    assert str(e.value) == sentence
    with pytest.raises(ConversionError, match="bloom"):
        convert_installed(model)
    assert mlx_dir_for(model) is None and not any(mlx_root().glob("*"))  # nothing half-written is left


def test_mlx_for_plan_says_the_gguf_converts_until_mlx_weights_exist(home: Path, default_model, tmp_path: Path):
    from localllm.hardware import probe

    hw = probe()
    mw = mlx_for_plan(SimpleNamespace(name="x", path=default_model.path, weights_of=lambda fmt: None), hw, "mlx")
    assert mw.convertible and not mw.installed and mw.usable
    built = tmp_path / "mlx-dir"
    built.mkdir()
    with_weights = SimpleNamespace(name="x", path=default_model.path,
                                   weights_of=lambda fmt: Weights(fmt, built))
    assert mlx_for_plan(with_weights, hw, "mlx").installed


def test_convert_installed_builds_once_under_the_digest(home: Path, default_model):
    pytest.importorskip("mlx.core")
    model = SimpleNamespace(name=default_model.name, weights_digest=default_model.weights_digest,
                            path=default_model.path)
    assert convertible(model) == (True, "")
    out = convert_installed(model)
    assert out == mlx_root() / default_model.weights_digest.split(":")[-1]
    assert mlx_dir_for(model) == out
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert convert_installed(model) == out and (out / "model.safetensors").stat().st_mtime_ns == stamp  # cached
    assert convert_installed(model, force=True) == out
    assert (out / "model.safetensors").stat().st_mtime_ns != stamp
    assert [p.name for p in mlx_root().iterdir()] == [out.name]  # no temp dirs left behind


def test_two_processes_converting_one_model_at_once_convert_it_once(home: Path, default_model):
    """``serve`` and ``run --backend mlx`` starting together: the second waits for the first's conversion and
    takes its directory (it converts nothing itself); both end with the same complete directory."""
    pytest.importorskip("mlx.core")
    import subprocess
    import sys

    script = (
        "import sys; from pathlib import Path; from types import SimpleNamespace\n"
        "from localllm.mlxmodels import convert_installed\n"
        "seen = []\n"
        f"m = SimpleNamespace(name='m', weights_digest={default_model.weights_digest!r}, "
        f"path=Path({str(default_model.path)!r}))\n"
        "out = convert_installed(m, progress=lambda d, t: seen.append(d))\n"
        "print(out, len(seen))\n")
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    results = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in results]
    outs = [out.split() for out, _ in results]
    assert outs[0][0] == outs[1][0] == str(mlx_root() / default_model.weights_digest.split(":")[-1])
    assert sorted(int(o[1]) > 0 for o in outs) == [False, True]  # one converted, the other found it done
    assert [p.name for p in mlx_root().iterdir()] == [Path(outs[0][0]).name]  # no temp or swapped-out dirs


def test_convert_command_records_the_mlx_dir_in_the_store(own_home: Path):
    pytest.importorskip("mlx.core")
    from click.testing import CliRunner

    from localllm.cli import cli

    result = CliRunner().invoke(cli, ["convert", "smollm2:135m"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "converting smollm2:135m to MLX (once, offline)…" in result.output
    path = Path(result.output.strip().splitlines()[-1])
    assert path.parent == own_home / "data" / "models" / "mlx"
    assert mlx_dir_for(_installed()) == path and _installed().weights_path("mlx") == path


def test_engine_converts_on_first_use_then_runs_on_mlx(own_home: Path):
    """End to end: store → planner (--backend mlx, no MLX weights yet) → conversion on the model's thread,
    reported to ``on_convert`` → MLX backend on the new directory, recorded in the store."""
    pytest.importorskip("mlx_lm")
    from localllm.api import GenerateRequest, Sampling
    from localllm.engine import Engine
    from localllm.loader import LoadOptions

    events: list = []
    threads: set[str] = set()

    def on_convert(event) -> None:
        import threading

        events.append(event)
        threads.add(threading.current_thread().name)

    engine = Engine(on_convert=on_convert)
    try:
        options = LoadOptions(num_ctx=1024, backend="mlx")
        plan = engine.prepare("smollm2:135m", options).plan
        assert plan.backend == "mlx" and plan.mlx_convert
        assert not (own_home / "data" / "models" / "mlx").exists()  # planning converts nothing
        for draft in ("none", "ngram"):
            req = GenerateRequest(messages=[{"role": "user", "content": "What is the capital of France?"}],
                                  sampling=Sampling(temperature=0.0, max_tokens=12))
            out = list(engine.generate("smollm2:135m", req, LoadOptions(num_ctx=1024, backend="mlx", draft=draft)))
            text = "".join(getattr(e, "text", "") for e in out)
            assert "Paris" in text and out[-1].finish_reason in ("stop", "length")
            assert engine.ps()[0].backend == "mlx"
    finally:
        engine.close()
    stages = [e.stage for e in events]
    assert stages[0] == "start" and stages[-1] == "done" and set(stages[1:-1]) == {"progress"}  # converted once
    assert events[-2].done == events[-2].total > 0 and events[-1].seconds > 0
    assert threads == {"localllm-model-smollm2:135m"}  # on the thread that then runs the model
    installed = _installed()
    hexdigest = installed.weights_digest.split(":")[-1]
    assert installed.weights_path("mlx") == own_home / "data" / "models" / "mlx" / hexdigest
    with Engine() as engine:
        assert not engine.prepare("smollm2:135m", LoadOptions(backend="mlx")).plan.mlx_convert


def test_a_cancelled_first_use_conversion_leaves_nothing(own_home: Path):
    pytest.importorskip("mlx_lm")
    import threading

    from localllm.api import GenerateRequest, Sampling
    from localllm.engine import Engine
    from localllm.errors import LocalLLMError
    from localllm.loader import LoadOptions

    cancel = threading.Event()
    stages: list[str] = []

    def on_convert(event) -> None:
        stages.append(event.stage)
        if event.stage == "progress":
            cancel.set()  # as Ctrl+C or a client going away does

    with Engine(on_convert=on_convert) as engine:
        req = GenerateRequest(prompt="Hi", sampling=Sampling(max_tokens=2))
        with pytest.raises(LocalLLMError, match="conversion of smollm2:135m to MLX was cancelled"):
            list(engine.generate("smollm2:135m", req, LoadOptions(backend="mlx"), cancel=cancel))
        assert engine.ps() == []
    assert stages[0] == "start" and stages[-1] == "failed"
    root = own_home / "data" / "models" / "mlx"
    assert not root.exists() or not any(root.iterdir())  # no half-written directory
    assert _installed().weights_path("mlx") is None


def test_mlx_weights_live_in_one_module_and_the_planner_reads_no_file():
    """The planner takes each weights format's answer (``localllm.formats.PlanWeights``, by format name: issue 45),
    not MLX's module, and imports nothing that owns files; the MLX weights module and the formats do not import the
    planner back, not even for a type (no import circle of any kind)."""
    import ast

    import localllm.formats
    import localllm.mlxmodels
    import localllm.planner

    def imported(module) -> set[str]:
        tree = ast.parse(Path(module.__file__).read_text())
        return {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}

    planner, weights = imported(localllm.planner), imported(localllm.mlxmodels)
    steps = set().union(*(imported(SimpleNamespace(__file__=str(f)))
                          for f in Path(localllm.planner.__file__).parent.glob("*.py")))
    assert "localllm.mlxmodels" not in steps and "localllm.formats" in steps
    assert "localllm.planner" not in weights and not any(m.startswith("localllm.planner")
                                                         for m in imported(localllm.formats))
    assert not planner & {"localllm.config", "localllm.store", "json", "hashlib", "pathlib"}
    src = Path(localllm.planner.__file__).read_text()
    assert "mlx-convertible" not in src and "mlx-convertible" in Path(localllm.mlxmodels.__file__).read_text()
