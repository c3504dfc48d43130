"""The Hub path fetches a repo's vision projector beside the weights (a local stand-in for the Hub's API)."""

from __future__ import annotations

import hashlib
import json

import pytest

from localllm.store import Store
from tests.support import SMOL_SHA, Route


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _hub(server, repo: str, files: dict[str, bytes]) -> None:
    rev = "e" * 40
    info = {"id": repo, "sha": rev, "siblings": [{"rfilename": "README.md"}] + [
        {"rfilename": n, "size": len(d), "lfs": {"size": len(d), "sha256": _sha(d), "pointerSize": 134}}
        for n, d in files.items()]}
    json_type = {"Content-Type": "application/json"}
    server.routes[f"/api/models/{repo}"] = Route(json.dumps(info).encode(), headers=json_type)
    for n, d in files.items():
        server.routes[f"/{repo}/resolve/{rev}/{n}"] = Route(d)


@pytest.fixture
def hub(home, local_mirror, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", local_mirror.url)
    return local_mirror


def test_pull_from_the_hub_fetches_the_f16_projector_and_rm_frees_it(hub, default_model_path, test_projector):
    repo = "someone/Tiny-VL-GGUF"
    proj = test_projector.read_bytes()
    _hub(hub, repo, {"Tiny-Q4_1.gguf": default_model_path.read_bytes(), "mmproj-Tiny-f16.gguf": proj,
                     "mmproj-Tiny-f32.gguf": b"GGUF" + b"\0" * 60})
    m = Store().pull(f"hf.co/{repo}:Q4_1")
    assert m.weights_digest == f"sha256:{SMOL_SHA}"
    assert m.projector is not None and m.projector.digest == f"sha256:{_sha(proj)}"
    assert m.projector.source == f"hf:{repo}/mmproj-Tiny-f16.gguf"
    assert hub.sent(f"/{repo}/resolve/{'e' * 40}/mmproj-Tiny-f32.gguf") == 0
    blob = m.projector.path
    Store().remove(m.name)
    assert not blob.exists()


def test_a_hub_projector_for_another_model_is_not_installed(hub, default_model_path, tmp_path):
    from tests.support_vision import make_projector

    repo = "someone/Tiny-Wrong-GGUF"
    wide = make_projector(tmp_path / "wide.gguf", n_embd=640).read_bytes()
    _hub(hub, repo, {"Tiny-Q4_1.gguf": default_model_path.read_bytes(), "mmproj-Tiny-f16.gguf": wide})
    events = []
    m = Store().pull(f"hf.co/{repo}:Q4_1", progress=events.append)
    assert m.projector is None
    assert any("projector not installed" in e.status and "another model" in e.status for e in events)


def test_pull_mmproj_names_another_projector_file_of_the_repo(hub, default_model_path, test_projector, tmp_path):
    import subprocess
    import sys

    from tests.support_vision import make_projector

    repo = "someone/Tiny-Two-GGUF"
    f32 = make_projector(tmp_path / "other.gguf", seed=1).read_bytes()
    _hub(hub, repo, {"Tiny-Q4_1.gguf": default_model_path.read_bytes(),
                     "mmproj-Tiny-f16.gguf": test_projector.read_bytes(), "mmproj-Tiny-f32.gguf": f32})
    r = subprocess.run([sys.executable, "-m", "localllm", "pull", f"hf.co/{repo}:Q4_1", "--mmproj",
                        "mmproj-Tiny-f32.gguf"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    m = Store().get(f"hf.co/{repo}:Q4_1")
    assert m.projector is not None and m.projector.digest == f"sha256:{_sha(f32)}"
    _hub(hub, "someone/Tiny-Three-GGUF", {"Tiny-Q4_1.gguf": default_model_path.read_bytes()})
    r = subprocess.run([sys.executable, "-m", "localllm", "pull", "hf.co/someone/Tiny-Three-GGUF:Q4_1",
                        "--mmproj", "mmproj-nope.gguf"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "has no projector file mmproj-nope.gguf" in r.stderr
