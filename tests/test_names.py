"""Model names: the accepted forms, and hostile names refused with one sentence before any I/O."""

from __future__ import annotations

import subprocess
import sys

import pytest

from localllm.errors import InvalidModelFileError, InvalidNameError
from localllm.names import parse_name


@pytest.mark.parametrize(
    ("text", "kind", "name", "quant"),
    [
        ("smollm2:135m", "alias", "smollm2:135m", None),
        ("SmolLM2:135M", "alias", "smollm2:135m", None),
        ("  smollm2  ", "alias", "smollm2", None),
        ("qwen2.5-coder:7b-q8_0", "alias", "qwen2.5-coder:7b-q8_0", "Q8_0"),
        ("llama3.1:8b-iq4_xs", "alias", "llama3.1:8b-iq4_xs", "IQ4_XS"),
        ("gemma3:4b-f16", "alias", "gemma3:4b-f16", "F16"),
        ("mymodel", "alias", "mymodel", None),
        ("hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF", "hf", "hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF", None),
        ("hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:q4_k_m", "hf",
         "hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M", "Q4_K_M"),
        ("huggingface.co/Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q8_0", "hf", "hf.co/Qwen/Qwen2.5-0.5B-Instruct-GGUF:Q8_0",
         "Q8_0"),
    ],
)
def test_accepted_names(text, kind, name, quant):
    ref = parse_name(text, allow_path=False)
    assert (ref.kind, ref.name, ref.quant) == (kind, name, quant)
    # every accepted name maps to safe relative path parts under the store
    for part in ref.storage_parts():
        assert part and part not in (".", "..") and "/" not in part and "\\" not in part


def test_alias_base_strips_the_quant():
    assert parse_name("qwen2.5:7b-q8_0", allow_path=False).base == "qwen2.5:7b"
    assert parse_name("smollm2:135m", allow_path=False).base == "smollm2:135m"


HOSTILE = [
    "../../etc/passwd",
    "/etc/passwd",
    "..",
    "./x",
    "~/.ssh/id_rsa",
    "C:\\Windows\\system32",
    "hf.co/../x",
    "hf.co/../../etc:Q4",
    "hf.co/user/../../x",
    "hf.co/user",
    "hf.co/.hidden/repo",
    "hf.co/user/repo:Q4/../x",
    "smollm2:..",
    "smol..lm",
    "a:b:c",
    "name with space",
    "tab\tname",
    "new\nline",
    "nul\x00byte",
    "esc\x1b[31mred",
    "del\x7f",
    "c1\x85ctl",
    "",
    "   ",
    "x" * 201,
    "smollm2:" + "1" * 100,
    "-leading-dash",
    ":tag",
    "über",
]


@pytest.mark.parametrize("text", HOSTILE)
def test_hostile_names_are_refused_in_one_sentence(text):
    with pytest.raises(InvalidNameError) as e:
        parse_name(text, allow_path=False)
    msg = str(e.value)
    assert msg.endswith(".") and "\n" not in msg and len(msg) < 240
    assert not any(ord(c) < 32 for c in msg)  # control characters are shown escaped


def test_path_only_where_read_in_place(default_model_path, tmp_path):
    with pytest.raises(InvalidNameError, match="file path, not a model name"):
        parse_name(str(default_model_path), allow_path=False)
    ref = parse_name(str(default_model_path), allow_path=True)
    assert ref.kind == "path" and ref.path == default_model_path.resolve()
    with pytest.raises(InvalidNameError, match="no such file"):
        parse_name(str(tmp_path / "missing.gguf"), allow_path=True)
    with pytest.raises(InvalidNameError, match="no such file"):
        parse_name("../../etc/passwd-does-not-exist", allow_path=True)


def test_a_path_to_something_not_gguf_is_refused_by_get(home, tmp_path):
    from localllm.store import Store

    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    for bad in ("/etc/passwd", str(not_gguf)):
        with pytest.raises(InvalidModelFileError) as e:
            Store().get(bad)
        assert "\n" not in str(e.value)


def _files_under(root):
    return sorted(p for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("text", ["../../etc/passwd", "/etc/passwd", "hf.co/../x", "bad\x01name", "", "y" * 300])
def test_cli_pull_refuses_and_writes_nothing(home, text):
    r = subprocess.run([sys.executable, "-m", "localllm", "pull", text], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0
    err = r.stderr.strip()
    assert err.startswith("Error: ") and len(err.splitlines()) == 1, err
    assert "Traceback" not in r.stderr
    assert _files_under(home) == []  # nothing written: no manifest, no download, no lock


def test_cli_show_refuses_a_non_gguf_path(home):
    r = subprocess.run([sys.executable, "-m", "localllm", "show", "/etc/passwd"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.startswith("Error: ") and "not a GGUF" in r.stderr and len(r.stderr.splitlines()) == 1
