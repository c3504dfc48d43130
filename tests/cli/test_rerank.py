"""``localllm rerank`` as a user runs it (real subprocesses, exit status and stderr): the made BERT reranker
(:mod:`tests.support_embed`) read in place from its file, documents as arguments or on stdin, and the same through a
server (``--host``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support_embed import EMBEDDER, RERANKER

Q = "what is the capital of france"
DOCS = ["paris is the capital of france", "the apple is red", "the cat sat on the mat"]


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "localllm", "rerank", *args], input=stdin,
                          stdin=None if stdin is not None else subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def scores(bert_reranker) -> list[float]:
    """The reranker's scores of DOCS, from the backend itself."""
    from backends.contract.specs import LoadSpec
    from backends.core.loop import LoadedModel
    from backends.llamacpp.source import LlamaCppSource

    with LoadedModel(LlamaCppSource, LoadSpec(str(bert_reranker), n_ctx=512)) as m:
        return m.rerank(Q, DOCS).scores


def test_rerank_documents_from_arguments_and_stdin(bert_reranker, scores):
    r = cli(str(bert_reranker), Q, *DOCS, "--json")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    got = json.loads(r.stdout)
    assert [x["index"] for x in got] == sorted(range(3), key=lambda i: -scores[i])
    assert [x["score"] for x in got] == pytest.approx(sorted(scores, reverse=True), abs=1e-5)
    assert all(x["document"] == DOCS[x["index"]] for x in got)
    piped = cli(str(bert_reranker), Q, "--top-n", "2", stdin="\n".join(DOCS) + "\n\n")
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr
    lines = piped.stdout.splitlines()
    best = max(range(3), key=lambda i: scores[i])
    assert len(lines) == 2 and lines[0].endswith(f"[{best}]  {DOCS[best]}")


def test_rerank_errors_are_one_sentence_and_exit_1(bert_embedder, bert_reranker):
    r = cli(str(bert_embedder), Q, "a", "b")
    assert r.returncode == 1 and r.stderr.strip().endswith("has no rank head, so it cannot rerank; use a reranking "
                                                          "model such as bge-reranker-v2-m3.")
    r = cli(str(bert_reranker), Q, stdin="\n  \n")
    assert r.returncode == 1 and r.stderr.strip() == "Error: No documents: stdin held no non-blank lines."
    r = cli(str(bert_reranker), Q, " ".join(["cat"] * 700), "--no-truncate")
    assert r.returncode == 1 and "Document 0 has 708 tokens but the model's context holds 512" in r.stderr
    assert "Traceback" not in r.stderr


def test_rerank_through_a_server(installed_default_model, bert_embedder, bert_reranker, tmp_path, scores):
    from tests.server.derived import serve
    from tests.support_embed import install_embed_models

    store = install_embed_models(tmp_path / "home", bert_embedder, bert_reranker)
    srv = serve(store)
    try:
        r = cli(RERANKER, Q, *DOCS, "--json", "--host", srv.url)
        assert r.returncode == 0 and r.stderr == "", r.stderr
        assert [x["score"] for x in json.loads(r.stdout)] == pytest.approx(sorted(scores, reverse=True), abs=1e-5)
        # `list` (in-process and through the server) and the model manager mark what each model is
        for args, env in ((["--host", srv.url], {}), ([], {"LOCALLLM_HOME": str(tmp_path / "home")})):
            out = subprocess.run([sys.executable, "-m", "localllm", "list", *args], capture_output=True, text=True,
                                 timeout=120, env={**os.environ, **env}, check=True).stdout.splitlines()
            assert "KIND" in out[0].split()
            kinds = {line.split()[0]: line.split()[-1] for line in out[1:]}
            assert kinds == {EMBEDDER: "embedding", RERANKER: "rerank", "smollm2:135m": "chat"}, out
        from localllm.local import LocalModels
        from localllm.session import Session
        from localllm.tui.models import model_rows

        class NoRunner:
            def ps(self) -> list:
                return []

        rows = {r.name: r.kind for r in model_rows(Session(LocalModels(store), NoRunner()))}  # type: ignore[arg-type]
        assert rows == {EMBEDDER: "embedding", RERANKER: "rerank", "smollm2:135m": ""}
    finally:
        srv.stop()
        srv.engine.close()


@pytest.mark.parametrize("name", ["bge-reranker-v2-m3", "embeddinggemma", "qwen3-embedding:0.6b"])
def test_pulling_a_catalog_embedding_or_rerank_model_fails_fast_without_the_hub(home, name):
    """The catalog's embedding and reranking entries without a PyPI mirror come from Hugging Face only: unreachable
    here, a pull says so in one sentence within seconds (a refused endpoint, as the build machines' DNS failure is)."""
    import time

    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", LOCALLLM_HF_TIMEOUT="0.5", LOCALLLM_HOME=str(home))
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "localllm", "pull", name], capture_output=True, text=True, timeout=120,
                       env=env, stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and time.monotonic() - t0 < 30
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: ") and "Hugging Face" in last and "Traceback" not in r.stderr, r.stderr


def test_run_on_an_embedding_model_prints_its_vector_and_a_reranker_points_to_rerank(bert_embedder, bert_reranker):
    """As Ollama's ``run`` does for an embedding model: the text's embedding as a JSON array (the backend's)."""
    from backends.contract.specs import LoadSpec
    from backends.core.loop import LoadedModel
    from backends.llamacpp.source import LlamaCppSource

    r = subprocess.run([sys.executable, "-m", "localllm", "run", str(bert_embedder), "hello world"],
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    with LoadedModel(LlamaCppSource, LoadSpec(str(bert_embedder), n_ctx=512)) as m:
        assert json.loads(r.stdout) == pytest.approx(m.embed(["hello world"])[0], abs=1e-6)
    r = subprocess.run([sys.executable, "-m", "localllm", "run", str(bert_reranker), "hello"],
                       capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and "is a reranking model: score documents with `localllm rerank" in r.stderr
    assert "Traceback" not in r.stderr
