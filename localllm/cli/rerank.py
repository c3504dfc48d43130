"""``localllm rerank MODEL QUERY [DOCUMENT...]``: score documents for a query with a reranking model, best first.

    $ localllm rerank bge-reranker-v2-m3 "capital of France?" "Paris is in France." "Bananas are yellow."
    $ grep -h . notes/*.txt | localllm rerank bge-reranker-v2-m3 "what did we decide?" --top-n 3
    $ localllm rerank bge-reranker-v2-m3 "query" a b c --json

Without documents on the command line they are read from stdin, one per line (blank lines skipped). The scores are
the model's raw relevance scores (higher is more relevant), as llama-server's ``/rerank`` gives them. A document
longer than the model's context is cut (marked ``cut``); ``--no-truncate`` makes that an error instead.
"""

from __future__ import annotations

import json
import sys

import click


@click.command("rerank")
@click.argument("model")
@click.argument("query")
@click.argument("documents", nargs=-1)
@click.option("--top-n", type=click.IntRange(min=1), default=None, help="Show only the N most relevant documents.")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON (index, score, document).")
@click.option("--no-truncate", is_flag=True, help="Fail on a document longer than the context instead of cutting it.")
@click.option("--host", default=None, metavar="URL", help="Use a server (default: in-process, or LOCALLLM_HOST).")
def command(model: str, query: str, documents: tuple[str, ...], top_n: int | None, as_json: bool,
            no_truncate: bool, host: str | None) -> None:
    """Score documents for QUERY with a reranking MODEL (documents from stdin when none are given)."""
    from localllm.cli.answer import ensure_model
    from localllm.cli.display import isatty
    from localllm.errors import LocalLLMError
    from localllm.session import open_session

    docs = list(documents)
    if not docs:
        if isatty(sys.stdin):
            raise LocalLLMError("No documents: give them after the query, or one per line on stdin.")
        docs = [line.rstrip("\n") for line in sys.stdin if line.strip()]
        if not docs:
            raise LocalLLMError("No documents: stdin held no non-blank lines.")
    session = open_session(host)
    try:
        if not session.remote:
            m = ensure_model(session.models, model)
            if "rerank" not in m.capabilities:
                raise LocalLLMError(f"{model} has no rank head, so it cannot rerank; use a reranking model "
                                    "such as bge-reranker-v2-m3.")
        ranked = session.runner.rerank(model, query, docs, truncate=not no_truncate)
    finally:
        session.close()
    ranked = ranked[:top_n] if top_n else ranked
    if as_json:
        click.echo(json.dumps([{"index": r.index, "score": r.score, "document": r.document,
                                **({"truncated": True} if r.truncated else {})} for r in ranked], ensure_ascii=False))
        return
    width = max(len(str(len(docs) - 1)), 1)
    for r in ranked:
        doc = " ".join(r.document.split())
        doc = doc if len(doc) <= 100 else doc[:99] + "…"
        click.echo(f"{r.score:10.4f}  [{r.index:>{width}}]  {doc}{'  (cut)' if r.truncated else ''}")
