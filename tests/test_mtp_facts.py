"""MTP facts read from a GGUF (issue 36): ``{arch}.nextn_predict_layers`` (or blocks that carry ``nextn`` tensors)
are read into GGUFInfo.mtp_layers and shown by ``show`` and ``probe`` (drafted from by default on llama.cpp);
``--draft mtp`` on a GGUF that llama.cpp runs no MTP layers of is refused in one sentence (the drafting itself:
``tests/backends/test_mtp_draft.py``). The made model is the default GGUF (a llama) with the MTP key added and no
MTP tensors: the facts are read, llama.cpp runs none."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from localllm.ggufinfo import read_gguf
from localllm.loader import mtp_refusal


def with_metadata(src: Path, dst: Path, extra: dict[str, int]) -> Path:
    """A copy of ``src`` with UINT32 keys ``extra`` added (every other key and tensor unchanged)."""
    import gguf

    reader = gguf.GGUFReader(src, "r")
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    writer = gguf.GGUFWriter(tmp, arch=arch, endianess=reader.endianess)
    alignment = reader.get_field(gguf.Keys.General.ALIGNMENT)
    if alignment is not None:
        writer.data_alignment = alignment.contents()
    for f in reader.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        vtype = f.types[0]
        writer.add_key_value(f.name, f.contents(), vtype,
                             sub_type=f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    for k, v in extra.items():
        writer.add_uint32(k.format(arch=arch), v)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    os.replace(tmp, dst)
    return dst


@pytest.fixture(scope="module")
def mtp_model(default_model_path, tmp_path_factory) -> Path:
    return with_metadata(Path(default_model_path), tmp_path_factory.mktemp("mtp") / "smol-mtp.gguf",
                         {"{arch}.nextn_predict_layers": 1})


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localllm", *args], capture_output=True, text=True, timeout=120)


def test_gguf_info_reads_the_mtp_layers(mtp_model, default_model_path):
    assert read_gguf(mtp_model).mtp_layers == 1
    assert read_gguf(default_model_path).mtp_layers == 0
    info = read_gguf(mtp_model)
    assert not info.is_mtp_head and info.n_layers == read_gguf(default_model_path).n_layers


def test_show_and_probe_say_so(home, mtp_model):
    r = cli("show", str(mtp_model), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["mtp_layers"] == 1
    r = cli("show", str(mtp_model))
    assert r.returncode == 0 and "MTP layers          1 (self-speculation: drafted from by default on llama.cpp" \
        in r.stdout
    r = cli("probe", "-m", str(mtp_model))
    assert r.returncode == 0, r.stderr
    assert "the GGUF has 1 multi-token-prediction (MTP) layer: it drafts from them" in r.stdout
    assert json.loads(cli("probe", "-m", str(mtp_model), "--json").stdout)["mtp_layers"] == 1


def test_draft_mtp_is_recognised_and_explained(home, mtp_model, default_model_path):
    r = cli("run", str(mtp_model), "--draft", "mtp", "Hi")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "could not be loaded with its MTP layers" in r.stderr  # the key without the tensors: llama.cpp refuses it
    r = cli("run", str(default_model_path), "--draft", "mtp", "Hi")
    assert r.returncode == 1 and "has no multi-token-prediction (MTP) layers (no llama.nextn_predict_layers" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert "mtp" in cli("run", "--help").stdout


def test_the_refusal_sentences():
    assert mtp_refusal("m", {"mtp_layers": 2, "architecture": "qwen35"}, "llamacpp") is None  # it drafts from them
    assert mtp_refusal("m", {"mtp_layers": 2, "architecture": "qwen35"}, "auto") is None  # auto picks llama.cpp
    assert mtp_refusal("m", {"mtp_layers": 2, "architecture": "qwen35"}, "mlx") == (
        "m has multi-token-prediction (MTP) layers, but only the llama.cpp backend drafts from them; "
        "use --backend llamacpp or --draft none.")
    assert "no qwen35.nextn_predict_layers" in (mtp_refusal("m", {"architecture": "qwen35"}, "llamacpp") or "")


def test_drafting_travels_in_api_ps():
    from localllm.api import drafting_text
    from localllm.client import running_from_ps

    assert drafting_text("mtp", "paused (not paying)") == "MTP layers: paused (not paying)"
    assert drafting_text("/models/draft.gguf", "on") == "draft model draft.gguf: on"
    assert drafting_text(None, None) == ""
    assert running_from_ps({"name": "m", "drafting": "MTP layers: on"}).drafting == "MTP layers: on"
