"""A llama.cpp built with ggml's AMX kernels (pip's native build on a CPU that lists AMX) dies with SIGILL at the
first matrix product in this version (ggml-org/llama.cpp#26954; seen on this project's VMs: the README's first
command crashed there). localllm loads such a build's models without llama.cpp's extra buffer types, and the probe
says why. The suite's own build has no AMX kernels (``.ci/run`` builds without them), so the build's answer is
stood in for here; the real crash and its fix were checked by hand on an AMX build (issue note, stop 54)."""

from __future__ import annotations

import llama_cpp
import pytest

from backends import descriptor
from backends.contract.specs import GenerateRequest, LoadSpec, Sampling
from backends.llamacpp import checks
from backends.llamacpp.source import LlamaCppSource
from backends.registry import load
from tests.backends.conftest import collect

AMX_INFO = b"CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "


@pytest.fixture
def amx_build(monkeypatch):
    """The installed llama.cpp answers as a native build on an AMX CPU does."""
    monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda: AMX_INFO)
    monkeypatch.setattr(checks, "_amx", None)


def test_a_build_with_amx_kernels_loads_without_extra_buffer_types_and_answers(amx_build, default_model_path,
                                                                                monkeypatch, caplog):
    used = []
    real = llama_cpp.llama_model_load_from_file

    def spy(path, params):
        used.append(bool(params.use_extra_bufts))
        return real(path, params)

    monkeypatch.setattr(llama_cpp, "llama_model_load_from_file", spy)
    with caplog.at_level("WARNING", logger="backends.llamacpp"):
        model = load("llamacpp", LoadSpec(str(default_model_path), n_ctx=512, slots=1))
    try:
        text, _, _ = collect(model.generate(GenerateRequest(prompt="The capital of France is",
                                                            sampling=Sampling(max_tokens=4, temperature=0.0))))
    finally:
        model.close()
    assert used == [False]
    assert text.strip()
    assert [r.getMessage() for r in caplog.records if "AMX" in r.getMessage()] == [
        f"llama-cpp-python: {descriptor.AMX_NOTE}"]


def test_a_build_without_them_keeps_them(default_model_path, monkeypatch):
    monkeypatch.setattr(checks, "_amx", None)
    used = []
    real = llama_cpp.llama_model_load_from_file
    monkeypatch.setattr(llama_cpp, "llama_model_load_from_file",
                        lambda path, params: used.append(bool(params.use_extra_bufts)) or real(path, params))
    LlamaCppSource(LoadSpec(str(default_model_path), n_ctx=256, slots=1)).close()
    assert used == [True]


def test_the_probe_says_why_and_how_to_rebuild(amx_build):
    status = descriptor.get("llamacpp").status()
    assert status.available and status.reason.endswith(descriptor.AMX_NOTE)
    assert "ggml-org/llama.cpp#26954" in status.reason and "-mno-amx-tile" in status.reason
