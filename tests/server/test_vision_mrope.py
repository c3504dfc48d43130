"""An M-RoPE vision model (Qwen2-VL style: the made ``qwen2vl`` copy of the default model and its random
``qwen2vl_merger`` projector) served over HTTP, through the official ``ollama`` client: the greedy answer about a
picture is llama.cpp's own (``mtmd_helper_eval_chunks`` on a fresh context), twice, the second from the reused
prefix (no encode)."""

from __future__ import annotations

import httpx
import ollama
import pytest

from tests.support_vision import MROPE_IMAGE, MROPE_IMAGE_TOKENS, png

QVL = "qwen2vl-test:latest"
ASK = "Describe the picture."


@pytest.fixture(scope="module")
def qsrv(mrope_model, tmp_path_factory):
    from tests.server.derived import install_derived, serve

    model, proj = mrope_model
    store = install_derived(model, QVL, tmp_path_factory.mktemp("qvl-home"), wheel_name=f"{model.stem}.whl",
                            member="qwen2vl_test/model.gguf")
    store.set_projector(QVL, proj)
    srv = serve(store)
    yield srv
    srv.stop()
    srv.engine.close()


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(f"localllm_{name}{{") and f'model="{QVL}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_an_m_rope_model_answers_an_image_question_as_llama_cpp_does(qsrv, mrope_model):
    from backends.contract.media import IMAGE_MARKER
    from backends.contract.specs import LoadSpec
    from backends.registry import load
    from tests.support_vision import reference_in_subprocess

    c = ollama.Client(host=qsrv.url)
    assert "vision" in (c.show(QVL).capabilities or [])
    pic = png(*MROPE_IMAGE, seed=12)
    opts = {"temperature": 0, "seed": 1, "num_predict": 8}
    msgs = [{"role": "user", "content": ASK, "images": [pic]}]
    first = c.chat(model=QVL, messages=msgs, options=opts, logprobs=True, top_logprobs=5)
    encoded = metric(qsrv.url, "images_encoded_total")
    assert encoded >= 1
    second = c.chat(model=QVL, messages=msgs, options=opts)
    assert first.message.content and second.message.content == first.message.content
    assert first.prompt_eval_count >= MROPE_IMAGE_TOKENS
    assert metric(qsrv.url, "images_encoded_total") == encoded  # the second answer reused the picture
    gen = c.generate(model=QVL, prompt=ASK, images=[pic], options=opts)
    assert gen.response == first.message.content  # /api/generate renders the same chat turn
    model, proj = mrope_model
    fa = next(r.plan.flash_attn for r in qsrv.engine.ps() if r.name == QVL)  # the helper sums as the server does
    with load("llamacpp", LoadSpec(str(model), n_ctx=1024, n_threads=1)) as m:
        prompt = m.call(lambda s: s.render([{"role": "user", "content": IMAGE_MARKER + "\n" + ASK}]))
        ref_top, toks = reference_in_subprocess(str(model), str(proj), prompt, [pic], n_gen=8, flash_attn=fa)
        want = m.detokenize(toks)
    assert want.startswith(first.message.content), (first.message.content, want)
    top = [t.logprob for t in first.logprobs[0].top_logprobs]  # numbers, not only text: a random model's words
    assert max(abs(a - b) for a, b in zip(top, ref_top, strict=True)) < 1e-4, (top, ref_top)  # flip rarely
