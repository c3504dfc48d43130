"""A default (``auto``) MTP draft that cannot start decodes plainly and says why; ``--draft mtp`` asked for is
refused in one sentence with nothing left loaded (issue 36, ``backends.core.drafting.open_with_draft``).

The made Qwen3.5 hybrid with an MTP block drafts for real on this llama.cpp, so the failure is injected where a
build or a machine would show it: the staging API missing (``backends.llamacpp.mtp.nextn_api``), llama.cpp refusing the
MTP context (``llama_init_from_model`` returning NULL), the MTP context failing in its first evaluation. Through the
engine (``ps``'s drafting), ``run --verbose`` (in-process, so the injection holds) and the loaded model."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from backends.contract.errors import UnsupportedError
from backends.contract.events import Done, TextChunk
from backends.contract.specs import DraftSpec, GenerateRequest, LoadSpec, Sampling
from backends.core.loop import LoadedModel
from backends.llamacpp.source import LlamaCppSource
from tests.backends.test_mtp_draft import made_mtp

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def mtp_path(default_model_path, test_cache) -> Path:
    return made_mtp(Path(default_model_path), test_cache, "echo")


def _no_staging_api():
    raise UnsupportedError("This build of llama.cpp cannot draft from MTP layers (it lacks set_embeddings_nextn); "
                           "use --draft none or another llama-cpp-python.")


def inject(monkeypatch, how: str) -> None:
    """Make the MTP drafter fail to start, as ``how`` says."""
    import llama_cpp

    import backends.llamacpp.mtp as mtp

    if how == "no staging api":
        monkeypatch.setattr(mtp, "nextn_api", _no_staging_api)
    elif how == "no mtp context":
        real = llama_cpp.llama_init_from_model

        def init(model, params):  # NULL for the MTP context only, as llama.cpp returns on failure
            return None if params.ctx_type == llama_cpp.LLAMA_CONTEXT_TYPE_MTP else real(model, params)

        monkeypatch.setattr(llama_cpp, "llama_init_from_model", init)
    else:  # the MTP context made, its first evaluation failing (a backend error that is not UnsupportedError)
        def process(self, entries, outputs):
            raise RuntimeError("llama_process failed: -1")

        monkeypatch.setattr(mtp.MtpDrafter, "_process", process)


def greedy(m: LoadedModel) -> str:
    text = []
    for ev in m.generate(GenerateRequest(prompt=PROMPT, sampling=Sampling(temperature=0.0, max_tokens=12))):
        if isinstance(ev, TextChunk):
            text.append(ev.text)
        elif isinstance(ev, Done):
            break
    return "".join(text)


@pytest.fixture(scope="module")
def plain(mtp_path) -> str:
    with LoadedModel(LlamaCppSource, LoadSpec(str(mtp_path), n_ctx=512, n_threads=1), name="plain") as m:
        return greedy(m)


@pytest.mark.parametrize("how", ["no staging api", "no mtp context", "first evaluation fails"])
def test_a_default_mtp_draft_that_cannot_start_decodes_plainly_and_says_why(monkeypatch, mtp_path, plain, how):
    inject(monkeypatch, how)
    spec = LoadSpec(str(mtp_path), n_ctx=512, n_threads=1, draft=DraftSpec("mtp", auto=True))
    with LoadedModel(LlamaCppSource, spec, name="auto") as m:
        assert greedy(m) == plain
        assert m.info.draft is None and m.info.draft_off, m.info
        assert not m.metrics().drafting
        assert m.spec.draft is None  # what is loaded: no draft
    assert {"no staging api": "cannot draft from MTP layers", "no mtp context": "could not create the MTP context",
            "first evaluation fails": "the MTP drafter could not start: llama_process failed"}[how] in m.info.draft_off


@pytest.mark.parametrize("how", ["no staging api", "no mtp context", "first evaluation fails"])
def test_an_mtp_draft_asked_for_that_cannot_start_is_refused_in_one_sentence(monkeypatch, mtp_path, how):
    inject(monkeypatch, how)
    closed: list[object] = []
    real_close = LlamaCppSource.close

    def close(self):
        closed.append(self)
        real_close(self)

    monkeypatch.setattr(LlamaCppSource, "close", close)
    spec = LoadSpec(str(mtp_path), n_ctx=512, n_threads=1, draft=DraftSpec("mtp"))
    with pytest.raises(UnsupportedError) as e:
        LoadedModel(LlamaCppSource, spec, name="asked")
    msg = str(e.value)
    assert msg.endswith(("use --draft none.", "use --draft none or another llama-cpp-python.")), msg
    assert "\n" not in msg and msg.count(". ") == 0, msg
    assert len(closed) == 1  # the target loaded, then closed: nothing left loaded


def _cli(*args: str):
    from localllm.cli import cli

    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_run_verbose_and_ps_say_drafting_is_off_and_why(home, monkeypatch, mtp_path, plain):
    from localllm.engine import Engine
    from localllm.local import running

    inject(monkeypatch, "no mtp context")
    args = [str(mtp_path), PROMPT, "--temperature", "0", "--num-predict", "12", "--verbose"]
    r = _cli("run", *args)
    assert r.exit_code == 0, r.output
    off = "off (llama.cpp could not create the MTP context for this model; use --draft none.)"
    assert f"drafting:             {off}" in r.stderr, r.stderr
    none = _cli("run", *args, "--draft", "none")
    assert r.stdout == none.stdout and "drafting:" not in none.stderr  # the answer is plain decoding's
    with Engine(keep_alive=60) as engine:
        list(engine.generate(str(mtp_path), GenerateRequest(prompt=PROMPT, sampling=Sampling(temperature=0.0,
                                                                                              max_tokens=2))))
        [m] = engine.ps()
        assert running(m).drafting == off


def test_run_draft_mtp_that_cannot_start_is_one_sentence_and_loads_nothing(home, monkeypatch, mtp_path):
    from localllm.engine import Engine
    from localllm.loader import LoadOptions

    inject(monkeypatch, "no mtp context")
    r = _cli("run", str(mtp_path), PROMPT, "--num-predict", "2", "--draft", "mtp")
    assert r.exit_code == 1
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    assert lines == ["Error: llama.cpp could not create the MTP context for this model; use --draft none."], r.stderr
    with Engine(keep_alive=60) as engine:
        with pytest.raises(UnsupportedError):
            list(engine.generate(str(mtp_path), GenerateRequest(prompt=PROMPT, sampling=Sampling(max_tokens=2)),
                                 LoadOptions(draft="mtp")))
        assert engine.ps() == []
