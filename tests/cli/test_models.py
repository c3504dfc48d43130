"""The model commands as a user runs them: ``localllm pull/list/show/rm/cp`` in real subprocesses,
against the real default model (the session's test home) or an isolated home."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SMOL_SHA = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "localllm", *args], capture_output=True, text=True, timeout=120)
    if check:
        assert r.returncode == 0, r.stderr
    return r


@pytest.fixture
def own_home(home, default_model_path):
    """An isolated home holding smollm2:135m (and only it), so rm/cp cannot disturb the shared test home."""
    from tests.support import install_copy

    shared = default_model_path.parents[1]  # <test home>/data/models/blobs/<file> -> <test home>/data/models
    install_copy(home / "data" / "models", shared)
    assert [line.split()[0] for line in run("list").stdout.splitlines()[1:]] == ["smollm2:135m"]
    return home


def test_list_shows_name_id_size_modified(default_model):
    r = run("list")
    header, *rows = r.stdout.splitlines()
    # KIND follows when the shared test home also holds an embedding model (the real-model tier pulls one)
    assert header.split() in (["NAME", "ID", "SIZE", "FORMATS", "MODIFIED"],
                              ["NAME", "ID", "SIZE", "FORMATS", "MODIFIED", "KIND"])
    row = next(line for line in rows if line.startswith("smollm2:135m "))
    assert row.split()[1:3] == [SMOL_SHA[:12], "98"] and " MB " in row
    assert row.removesuffix("chat").rstrip().endswith("ago")
    data = json.loads(run("list", "--json").stdout)
    smol = next(d for d in data if d["name"] == "smollm2:135m")
    assert smol["digest"] == f"sha256:{SMOL_SHA}" and smol["size"] == 98362432


def test_list_in_an_empty_home(home):
    assert run("list").stdout.split() == ["NAME", "ID", "SIZE", "FORMATS", "MODIFIED"]


def test_show_prints_the_model_facts(default_model):
    out = run("show", "smollm2:135m").stdout
    for needle in ("architecture        llama", "parameters          134.5M", "context length      8192",
                   "quantization        Q4_1", "apache-2.0", f"sha256:{SMOL_SHA}"):
        assert needle in out, needle
    path = next(w for w in out.split() if w.endswith(f"blobs/sha256-{SMOL_SHA}"))  # this home's models dir
    assert os.path.samefile(path, default_model.path)
    assert "<|im_start|>" in out  # the template's first lines
    full = run("show", "smollm2:135m", "--template").stdout
    assert default_model.info["chat_template"].splitlines()[-1] in full
    d = json.loads(run("show", "smollm2", "--json").stdout)
    assert d["architecture"] == "llama" and d["layers"] == 30 and d["context_length"] == 8192
    assert d["quantization"] == "Q4_1" and d["license"] == "apache-2.0"
    assert os.path.samefile(d["path"], default_model.path)
    assert d["chat_template"] == default_model.info["chat_template"]


def test_long_templates_are_truncated_unless_asked(default_model):
    from localllm.cli.show import TEMPLATE_LINES, details, render
    from localllm.local import installed

    d = details(installed(default_model))
    d["chat_template"] = "\n".join(f"line {i}" for i in range(40))
    short, full = render(d, full_template=False), render(d, full_template=True)
    assert f"line {TEMPLATE_LINES - 1}" in short and f"line {TEMPLATE_LINES}\n" not in short
    assert f"… {40 - TEMPLATE_LINES} more lines (--template shows all)" in short
    assert "line 39" in full and "more lines" not in full
    d["chat_template"] = None
    assert "(none: a base model" in render(d, full_template=False)


def test_show_reads_a_local_gguf_in_place(home, default_model_path):
    d = json.loads(run("show", str(default_model_path), "--json").stdout)
    assert d["local"] and d["path"] == str(default_model_path) and d["architecture"] == "llama"
    assert not (home / "data").exists()  # nothing installed or copied


def test_show_unknown_and_missing(home):
    r = run("show", "smollm2:135m", check=False)
    assert r.returncode == 1 and "not installed; run `localllm pull smollm2:135m`" in r.stderr
    r = run("show", "smolm2:135m", check=False)
    assert r.returncode == 1 and "Did you mean: smollm2:135m" in r.stderr
    assert len(r.stderr.splitlines()) == 1


def test_pull_unknown_alias_suggests(home):
    r = run("pull", "llama3:8b", check=False)
    assert r.returncode == 1 and "Did you mean: llama3.1:8b" in r.stderr and "Traceback" not in r.stderr
    assert not any(p.is_file() for p in home.rglob("*"))


def test_cp_then_rm_via_cli(own_home):
    assert run("cp", "smollm2:135m", "my-assistant").stdout.strip() == "copied 'smollm2:135m' to 'my-assistant'"
    names = [line.split()[0] for line in run("list").stdout.splitlines()[1:]]
    assert sorted(names) == ["my-assistant", "smollm2:135m"]
    r = run("rm", "smollm2:135m", "nosuch:1b", check=False)
    assert r.returncode == 1 and "deleted 'smollm2:135m'" in r.stdout and "nosuch:1b" in r.stderr
    blob = own_home / "data" / "models" / "blobs" / f"sha256-{SMOL_SHA}"
    assert blob.is_file()  # my-assistant still uses it
    assert "llama" in run("show", "my-assistant").stdout
    run("rm", "my-assistant")
    assert not blob.exists()
    assert run("list").stdout.split() == ["NAME", "ID", "SIZE", "FORMATS", "MODIFIED"]


def test_cp_onto_an_installed_name_is_refused_unless_forced(own_home):
    run("cp", "smollm2:135m", "mine")
    r = run("cp", "smollm2:135m", "mine", check=False)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        "Error: mine exists already; remove it first, or copy with --force to replace it."]
    r = run("cp", "smollm2:135m", "smollm2:135m", check=False)  # onto itself: the same answer, nothing changed
    assert r.returncode == 1 and "exists already" in r.stderr
    assert run("cp", "--force", "smollm2:135m", "mine").stdout.strip() == "copied 'smollm2:135m' to 'mine'"
    assert sorted(line.split()[0] for line in run("list").stdout.splitlines()[1:]) == ["mine", "smollm2:135m"]


def test_rm_never_deletes_a_local_file(home, default_model_path):
    r = run("rm", str(default_model_path), check=False)
    assert r.returncode == 1 and "file path" in r.stderr and default_model_path.is_file()


def test_list_and_commands_import_nothing_heavy(default_model):
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from localllm.cli import cli\n"
        "r = CliRunner().invoke(cli, ['list'])\n"
        "assert r.exit_code == 0, r.output\n"
        "heavy = [m for m in ('rich', 'httpx', 'gguf', 'numpy', 'huggingface_hub', 'filelock', 'llama_cpp',"
        " 'textual', 'fastapi') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
