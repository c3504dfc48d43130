"""Reranking (``POST /v1/rerank``, ``/v1/reranking``, ``/rerank``, ``/reranking``, ``/api/rerank``): the Jina /
Cohere shape llama-server accepts, for a model whose GGUF has a rank head.

Request: ``model``, ``query``, ``documents`` (strings or ``{"text": ...}`` objects), ``top_n`` (default: all),
``return_documents`` (default false), and beyond those ``truncate`` (default true: a document over the model's
context is cut and its result says ``"truncated": true``; false makes it a 400), ``options`` and ``keep_alive``::

    curl http://127.0.0.1:11434/v1/rerank -d '{"model": "bge-reranker-v2-m3", "query": "capital of France?",
      "documents": ["Paris is the capital of France.", "Bananas are yellow."], "top_n": 1}'
    {"model": "bge-reranker-v2-m3", "object": "list", "usage": {"prompt_tokens": 31, "total_tokens": 31},
     "results": [{"index": 0, "relevance_score": 7.61}]}

Results are sorted by ``relevance_score`` (the rank head's raw output, as llama-server gives it), best first,
each with the ``index`` of its document. Errors leave in OpenAI's shape under ``/v1`` and at llama-server's own
paths (``/rerank``, ``/reranking``), in Ollama's under ``/api``. The documents are scored in batches on the
model's decode loop (:mod:`backends.core.pooling`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from localllm.api import Pooled
from localllm.server import generation as g
from localllm.server import ollama_routes, openai_routes
from localllm.server.errors import bad_request
from localllm.server.modelinfo import capabilities
from localllm.server.options import keep_alive_of, options_of
from localllm.server.protocol import engine_of, run_cancellable
from localllm.server.schemas import Bool, KeepAlive, _Body
from localllm.server.translator import Translator


class RerankDocument(_Body):
    text: str


class RerankBody(_Body):
    model: str
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = None
    return_documents: Bool = False
    truncate: Bool = True
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive = None
    rank_fields: list[str] | None = Field(default=None, description="Cohere's; documents are plain text here")


def texts_of(body: RerankBody) -> list[str]:
    """The documents' texts; an empty list or ``top_n`` below 1 is a 400 (checked before any model loads)."""
    if not body.documents:
        raise bad_request("documents must be a non-empty list of strings or {\"text\": ...} objects",
                          param="documents")
    if body.top_n is not None and body.top_n < 1:
        raise bad_request(f"top_n must be at least 1, not {body.top_n}", param="top_n")
    return [d if isinstance(d, str) else d.text for d in body.documents]


def results_of(body: RerankBody, texts: list[str], pooled: Pooled) -> dict[str, Any]:
    """The answer: results sorted by score (best first, ties in document order), cut to ``top_n``."""
    order = sorted(range(len(texts)), key=lambda i: -pooled.scores[i])
    cut = set(pooled.truncated)
    results = []
    for i in order[:body.top_n or len(order)]:
        r: dict[str, Any] = {"index": i, "relevance_score": pooled.scores[i]}
        if body.return_documents:
            r["document"] = {"text": texts[i]}
        if i in cut:
            r["truncated"] = True
        results.append(r)
    return {"model": body.model, "object": "list", "results": results,
            "usage": {"prompt_tokens": pooled.tokens, "total_tokens": pooled.tokens}}


async def rerank(body: RerankBody, request: Request) -> Response:
    texts = texts_of(body)
    name, found = await g.installed(request, body.model)
    if "rerank" not in capabilities(found):
        raise bad_request(f'"{body.model}" has no rank head, so it cannot rerank; use a reranking model such as '
                          "bge-reranker-v2-m3", param="model")
    _, options = options_of(body.options)
    options = g.cap_ctx(options, found)
    pooled = await run_cancellable(request, engine_of(request).rerank, name, body.query, texts, options,
                                   keep_alive=keep_alive_of(body.keep_alive), truncate=body.truncate, pool="work")
    return JSONResponse(results_of(body, texts, pooled))


async def rerank_ollama(body: RerankBody, request: Request) -> Response:
    """The same under ``/api``: its own endpoint, so that its errors leave in Ollama's shape."""
    return await rerank(body, request)


v1_router = APIRouter()
for _path in ("/v1/rerank", "/v1/reranking", "/rerank", "/reranking"):
    v1_router.add_api_route(_path, rerank, methods=["POST"], name=f"rerank{_path.replace('/', '_')}")
ollama_router = APIRouter()
ollama_router.add_api_route("/api/rerank", rerank_ollama, methods=["POST"], name="rerank_api")

# two translators: one handler under OpenAI's error shape (llama-server's paths too) and under Ollama's
API = Translator("rerank", v1_router, openai_routes.error_body, prefix="/v1/rerank")
OLLAMA_API = Translator("rerank-ollama", ollama_router, ollama_routes.error_body, prefix="/api/rerank")
