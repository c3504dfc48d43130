"""A made Qwen3.5 with an MTP block (``tests/made_qwen35.py``), as the ``*-MTP-GGUF`` builds ship: llama.cpp reads
its ``nextn`` layer, our GGUF reader counts it, and loaded for plain decoding (MTP tensors skipped) it answers
exactly as the same trunk without the block — so the catalog's MTP build (qwen3.6:27b) decodes plainly as its
trunk does (``--draft none``). Drafting from the block: ``tests/backends/test_mtp_draft.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from localllm.ggufinfo import read_gguf
from tests.made_qwen35 import write_qwen35


@pytest.fixture(scope="module")
def made(default_model_path, tmp_path_factory) -> dict[int, Path]:
    d = tmp_path_factory.mktemp("qwen35")
    return {mtp: write_qwen35(Path(default_model_path), d / f"q35-mtp{mtp}.gguf", mtp=mtp) for mtp in (0, 1)}


def test_llama_cpp_and_our_reader_see_the_mtp_block(made):
    import llama_cpp

    llama_cpp.llama_backend_init()
    for mtp, path in made.items():
        info = read_gguf(path)
        assert (info.architecture, info.mtp_layers, info.n_layers, info.is_hybrid) == ("qwen35", mtp, 4 + mtp, True)
        for load_mtp in (False, True):  # the binding's load_mtp: both load; the MTP block is skipped without it
            params = llama_cpp.llama_model_default_params()
            params.load_mtp = load_mtp
            model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
            assert model, (mtp, load_mtp)
            try:
                assert llama_cpp.llama_model_n_layer_nextn(model) == mtp
                assert llama_cpp.llama_model_n_layer(model) == 4
            finally:
                llama_cpp.llama_model_free(model)


def test_the_mtp_build_decodes_like_the_plain_one(made, backend_factory):
    from backends.contract.events import TextChunk
    from backends.contract.specs import GenerateRequest, Sampling

    def greedy(path: Path) -> str:
        b = backend_factory("llamacpp", model_path=str(path))
        req = GenerateRequest(prompt="The capital of France is", sampling=Sampling(temperature=0.0, max_tokens=12))
        return "".join(e.text for e in b.generate(req) if isinstance(e, TextChunk))

    plain, with_mtp = greedy(made[0]), greedy(made[1])
    assert plain and with_mtp == plain  # the same trunk weights (same seed), the MTP block not used
