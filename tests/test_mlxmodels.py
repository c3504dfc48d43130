"""The MLX model service: where MLX builds of installed models live, and converting one offline."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from localllm.mlxmodels import ConversionError, convert_installed, convertible, mlx_dir_for, mlx_root


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


def test_an_unconverted_or_digestless_model_has_no_mlx_dir(home: Path):
    assert mlx_dir_for(SimpleNamespace(name="x", digest="sha256:" + "ab" * 32, path="x.gguf")) is None
    assert mlx_dir_for(SimpleNamespace(name="x", digest=None, path="x.gguf")) is None
    assert mlx_root() == home / "data" / "models" / "mlx"


def test_other_architectures_are_refused_with_a_reason(home: Path, tmp_path: Path):
    model = SimpleNamespace(name="gem", digest="sha256:" + "cd" * 32, path=_tiny_gguf(tmp_path / "g.gguf", "gemma3"))
    ok, why = convertible(model)
    assert not ok and "llama architecture only" in why and "gemma3" in why
    pytest.importorskip("mlx.core")
    with pytest.raises(ConversionError, match="gemma3"):
        convert_installed(model)
    assert mlx_dir_for(model) is None and not any(mlx_root().glob("*"))  # nothing half-written is left


def test_convert_installed_builds_once_under_the_digest(home: Path, default_model):
    pytest.importorskip("mlx.core")
    model = SimpleNamespace(name=default_model.name, digest=default_model.digest, path=default_model.path)
    assert convertible(model) == (True, "")
    out = convert_installed(model)
    assert out == mlx_root() / default_model.digest.split(":")[-1]
    assert mlx_dir_for(model) == out
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert convert_installed(model) == out and (out / "model.safetensors").stat().st_mtime_ns == stamp  # cached
    assert convert_installed(model, force=True) == out
    assert (out / "model.safetensors").stat().st_mtime_ns != stamp
    assert [p.name for p in mlx_root().iterdir()] == [out.name]  # no temp dirs left behind


def test_convert_command_records_the_mlx_dir_in_the_store(default_model):
    pytest.importorskip("mlx.core")
    from click.testing import CliRunner

    from localllm.cli import cli
    from localllm.store import Store

    result = CliRunner().invoke(cli, ["convert", default_model.name], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    path = Path(result.output.strip().splitlines()[-1])
    assert mlx_dir_for(default_model) == path
    assert Store().get(default_model.name).mlx_path == path


def test_engine_runs_the_converted_model_on_mlx(default_model):
    """End to end: store → planner (--backend mlx) → MLX backend on the converted directory."""
    pytest.importorskip("mlx.core")
    from localllm.engine import Engine, GenerateRequest, LoadOptions, Sampling
    from localllm.store import Store

    store = Store()
    store.set_mlx_path(default_model.name, convert_installed(default_model))
    engine = Engine(store=store)
    try:
        for draft in ("none", "ngram"):
            options = LoadOptions(num_ctx=1024, backend="mlx", draft=draft)
            _, plan = engine.plan_for(default_model.name, options)
            assert plan.backend == "mlx"
            req = GenerateRequest(messages=[{"role": "user", "content": "What is the capital of France?"}],
                                  sampling=Sampling(temperature=0.0, max_tokens=12))
            events = list(engine.generate(default_model.name, req, options))
            text = "".join(getattr(e, "text", "") for e in events)
            assert "Paris" in text and events[-1].finish_reason in ("stop", "length")
            assert engine.ps()[0].backend.name == "mlx"
    finally:
        engine.close()
