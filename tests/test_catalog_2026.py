"""The catalog of 2026 (issue 36): Qwen3.5/3.6, Gemma 4, Granite 4, LFM2, Ministral 3, gpt-oss 120B. Their facts are
typed (architecture, capabilities, think levels, MoE, MTP, split files), `pull` of each fails fast without the Hub
in the usual sentence, gpt-oss 120B's split files are refused before any network, and `list --catalog` shows
family, size, capabilities and the fit verdict."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from localllm.catalog import CAPABILITIES, CATALOG_FILE, MTP, Catalog, MoE
from localllm.errors import PullError

NEW = {  # alias -> (architecture, default file): each confirmed from a public source (cited in models.toml)
    "qwen3.5:2b": ("qwen35", "Qwen3.5-2B-Q4_K_M.gguf"),
    "qwen3.5:4b": ("qwen35", "Qwen3.5-4B-Q4_K_M.gguf"),
    "qwen3.5:9b": ("qwen35", "Qwen3.5-9B-Q4_K_M.gguf"),
    "qwen3.5:27b": ("qwen35", "Qwen3.5-27B-Q4_K_M.gguf"),
    "qwen3.5:35b-a3b": ("qwen35moe", "Qwen3.5-35B-A3B-Q4_K_M.gguf"),
    "qwen3.6:35b-a3b": ("qwen35moe", "Qwen3.6-35B-A3B-Q4_K_M.gguf"),
    "qwen3.6:27b": ("qwen35", "Qwen3.6-27B-Q4_K_M.gguf"),
    "gemma4:e2b": ("gemma4", "gemma-4-E2B-it-Q4_K_M.gguf"),
    "gemma4:e4b": ("gemma4", "gemma-4-E4B-it-Q4_K_M.gguf"),
    "gemma4:26b-a4b": ("gemma4", "gemma-4-26B-A4B-it-Q4_K_M.gguf"),
    "gemma4:31b": ("gemma4", "gemma-4-31B-it-Q4_K_M.gguf"),
    "granite4:350m-h": ("granitehybrid", "granite-4.0-h-350m-Q8_0.gguf"),
    "granite4:micro": ("granite", "granite-4.0-micro-Q4_K_M.gguf"),
    "granite4:tiny-h": ("granitehybrid", "granite-4.0-h-tiny-Q4_K_M.gguf"),
    "granite4:small-h": ("granitehybrid", "granite-4.0-h-small-Q4_K_M.gguf"),
    "lfm2:350m": ("lfm2", "LFM2-350M-Q4_K_M.gguf"),
    "lfm2:700m": ("lfm2", "LFM2-700M-Q4_K_M.gguf"),
    "lfm2:1.2b": ("lfm2", "LFM2-1.2B-Q4_K_M.gguf"),
    "lfm2:8b-a1b": ("lfm2moe", "LFM2-8B-A1B-Q4_K_M.gguf"),
    "ministral3:3b": ("mistral3", "Ministral-3-3B-Instruct-2512-Q4_K_M.gguf"),
    "ministral3:8b": ("mistral3", "Ministral-3-8B-Instruct-2512-Q4_K_M.gguf"),
    "ministral3:14b": ("mistral3", "Ministral-3-14B-Instruct-2512-Q4_K_M.gguf"),
    "gpt-oss:120b": ("gpt-oss", "gpt-oss-120b-mxfp4-00001-of-00003.gguf"),
}


@pytest.fixture(scope="module")
def cat() -> Catalog:
    return Catalog.load(CATALOG_FILE)


def test_the_families_of_2026_and_their_facts(cat):
    for name, (arch, file) in NEW.items():
        e = cat.get(name)
        assert (e.architecture, e.gguf_files[e.default_quant]) == (arch, file), name
        assert e.capabilities and set(e.capabilities) <= set(CAPABILITIES), name
        assert e.context_length >= 32768 and e.approx_size, name
        assert (e.moe is not None) == ("moe" in arch or "-a" in e.size or name in {"gpt-oss:120b", "granite4:tiny-h",
                                                                                 "granite4:small-h"}), name
        if "vision" in e.capabilities:  # a vision claim comes with a projector to pull
            assert e.mmproj, name
        if e.think_levels:
            assert "thinking" in e.capabilities, name
    # the family aliases point at a mid size of each
    assert {f: cat.get(f).name for f in ("qwen3.5", "qwen3.6", "gemma4", "granite4", "lfm2", "ministral3")} == {
        "qwen3.5": "qwen3.5:9b", "qwen3.6": "qwen3.6:35b-a3b", "gemma4": "gemma4:e4b", "granite4": "granite4:micro",
        "lfm2": "lfm2:1.2b", "ministral3": "ministral3:8b"}
    # MoE facts the planner uses before a pull
    assert cat.get("gpt-oss:120b").moe == MoE(total="117b", active="5.1b", experts=128, experts_used=4)
    assert cat.get("gpt-oss:20b").moe == MoE(total="21b", active="3.6b", experts=32, experts_used=4)
    assert cat.get("qwen3.6:35b-a3b").moe.label() == "35b-a3b"
    # reasoning levels where the template takes them; on/off elsewhere
    assert cat.get("gpt-oss:120b").think_levels == ("low", "medium", "high") == cat.get("gpt-oss:20b").think_levels
    assert cat.get("qwen3.5:9b").think_levels == () and "thinking" in cat.get("qwen3.5:9b").capabilities
    assert "thinking" not in cat.get("granite4:micro").capabilities
    assert "audio" in cat.get("gemma4:e2b").capabilities and "audio" not in cat.get("gemma4:31b").capabilities
    # MTP: Qwen3.6 27B's MTP build carries the layers; Gemma 4 ships drafter heads as separate files
    assert cat.get("qwen3.6:27b").mtp == MTP(kind="layers")
    assert cat.get("qwen3.6:27b").gguf_repo == "unsloth/Qwen3.6-27B-MTP-GGUF"
    assert cat.get("gemma4:e4b").mtp == MTP(kind="head", file="mtp-gemma-4-E4B-it-Q8_0.gguf")
    assert cat.get("qwen3.5:9b").mtp is None  # the plain unsloth files have no MTP layers
    # pinned hashes from the public sources
    assert cat.get("qwen3.6:35b-a3b").gguf_sha256["Q4_K_M"].startswith("671e47e0")
    assert cat.get("ministral3:14b").mmproj == "Ministral-3-14B-Instruct-2512-BF16-mmproj.gguf"
    assert cat.get("gpt-oss:120b").split_parts == 3 and cat.get("gpt-oss:20b").split_parts == 1


def test_as_dict_carries_the_new_facts(cat):
    d = cat.get("gpt-oss:120b").as_dict()
    assert d["capabilities"] == ["thinking", "tools"] and d["think_levels"] == ["low", "medium", "high"]
    assert d["moe"] == {"total": "117b", "active": "5.1b", "experts": 128, "experts_used": 4}
    assert d["split_parts"] == 3 and d["architecture"] == "gpt-oss" and d["mtp"] is None
    assert cat.get("gemma4:e2b").as_dict()["mtp"] == {"kind": "head", "file": "mtp-gemma-4-E2B-it.gguf"}


@pytest.mark.parametrize("bad", [
    'capabilities = ["telepathy"]', 'mtp = { kind = "head" }', 'mtp = { kind = "wings" }'])
def test_bad_facts_are_refused_when_read(bad):
    text = f'[models."x:1b"]\ngguf_repo = "a/b"\ngguf_pattern = "x-{{quant}}.gguf"\nquants = ["Q4_K_M"]\n{bad}\n'
    with pytest.raises(ValueError, match="x:1b"):
        Catalog.from_toml(text)


def test_pull_of_each_new_alias_fails_fast_without_the_hub(home, monkeypatch):
    """No Hub (a refused port, as this machine's DNS failure): every new alias fails in the usual one sentence,
    quickly, and installs nothing; the split gpt-oss 120B is refused before any network."""
    from localllm.store import Store

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("LOCALLLM_HF_TIMEOUT", "0.5")
    store = Store()
    for name in NEW:
        t0 = time.monotonic()
        with pytest.raises(PullError) as e:
            store.pull(name, mlx=False)
        msg = str(e.value)
        assert time.monotonic() - t0 < 5, name
        assert "\n" not in msg, name
        if name == "gpt-oss:120b":
            assert msg.startswith("gpt-oss:120b is split into 3 files on Hugging Face (ggml-org/gpt-oss-120b-GGUF)")
            assert "hf download ggml-org/gpt-oss-120b-GGUF" in msg
        else:
            assert msg == f"Could not pull {name}: Hugging Face is unreachable (ConnectError).", msg
    assert store.list() == []


def test_pull_split_model_via_cli_exits_non_zero(home):
    r = subprocess.run([sys.executable, "-m", "localllm", "pull", "gpt-oss:120b"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "split into 3 files" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_list_catalog_shows_family_size_capabilities_and_fit(home):
    r = subprocess.run([sys.executable, "-m", "localllm", "list", "--catalog"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["NAME", "FAMILY", "SIZE", "CAPABILITIES", "MOE", "FIT", "INSTALLED"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(NEW) <= set(rows) and "smollm2:135m" in rows
    oss = rows["gpt-oss:120b"].split()
    assert oss[1:5] == ["gpt-oss", "63", "GB", "thinking(low/medium/high),tools"] and "117b-a5.1b" in oss
    assert "thinking,tools,vision,audio" in rows["gemma4:e2b"]
    # the fit verdict is this machine's (a 63 GB model does not fit the build machines; the default model does)
    verdicts = json.loads(subprocess.run(
        [sys.executable, "-m", "localllm", "list", "--catalog", "--json"], capture_output=True, text=True,
        timeout=60).stdout)
    by_name = {v["name"]: v for v in verdicts}
    assert by_name["smollm2:135m"]["fit"]["verdict"] in ("cpu", "gpu") and by_name["smollm2:135m"]["fit"]["estimated"]
    assert by_name["gpt-oss:120b"]["fit"]["verdict"] == "too_big"  # 63 GB: more than these machines have
    assert by_name["qwen3.6:27b"]["mtp"] == "layers" and by_name["gpt-oss:120b"]["split_parts"] == 3
    assert by_name["gemma4:e2b"]["capabilities"] == ["thinking", "tools", "vision", "audio"]
    assert by_name["gpt-oss:120b"]["fit"]["text"] in rows["gpt-oss:120b"]


def test_capability_facts_agree_across_the_whole_catalog(cat):
    """Every entry: a vision claim has a projector to pull and a projector means vision; reasoning levels mean
    thinking; an "-aNb" size is a mixture of experts whose label is that size; the reasoning families think."""
    for e in cat.entries():
        assert ("vision" in e.capabilities) == bool(e.mmproj), e.name
        assert not e.think_levels or "thinking" in e.capabilities, e.name
        if "-a" in e.size:
            assert e.moe is not None and e.moe.label() == e.size, e.name
        if e.moe is not None and e.moe.experts is not None:
            assert e.moe.experts_used and e.moe.experts_used < e.moe.experts, e.name
        if e.family in ("qwen3", "deepseek-r1", "qwen3.5", "qwen3.6", "gemma4", "gpt-oss"):
            assert "thinking" in e.capabilities, e.name
