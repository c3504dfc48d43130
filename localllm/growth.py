"""A prompt that outgrows the loaded context: a request that leaves the context to the planner keeps every turn
(:func:`growable`), and when its prompt does not fit the model is loaded again with a larger context
(:func:`grown`), where the trained context and the planner's memory estimate allow; else old turns are dropped
as usual. The engine retries with what these return.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from backends.contract.errors import ContextOverflowError
from backends.contract.specs import GenerateRequest
from localllm.loader import LoadOptions

if TYPE_CHECKING:
    from localllm.residency import Resident

log = logging.getLogger("localllm.engine")


def growable(request: GenerateRequest, options: LoadOptions) -> tuple[GenerateRequest, LoadOptions]:
    """A request that leaves the context to the planner keeps every turn: the context grows instead."""
    if options.num_ctx is None and request.messages is not None and not request.keep_turns:
        return replace(request, keep_turns=True), options
    return request, options


def grown(running: Resident, request: GenerateRequest, options: LoadOptions, e: ContextOverflowError,
          fits: Callable[[int], bool]) -> tuple[GenerateRequest, LoadOptions] | None:
    """What to retry a request with whose prompt did not fit ``running``'s context: a larger context, the
    smallest power-of-two multiple of the loaded one that holds the prompt and the answer's reserve, where the
    trained context holds that and ``fits(n_ctx)`` (the planner: memory holds it, with no layer leaving the GPU)
    says yes; else the same context with old turns dropped as usual (which raises the overflow with its numbers
    at once when even that does not fit: a prompt that can never fit reloads nothing); None: nothing more to try.
    The grown load remembers the context it grew from (``grown_from``), so that the engine goes back to it when
    the long prompts stop (:attr:`~localllm.residency.Resident.shrinks`)."""
    from backends.core.stream import answer_reserve

    if options.num_ctx is not None and not request.keep_turns:
        return None  # the context was asked for
    have = running.info.n_ctx
    trained = running.info.n_ctx_train or have
    fallback = (replace(request, keep_turns=False), options) if request.keep_turns else None
    derived = running.installed.derived if running.installed is not None else None
    if derived is not None and derived.parameters.get("num_ctx"):
        return fallback  # a created model's PARAMETER num_ctx is a setting: honoured, as a request's is

    def holds(n_ctx: int) -> bool:
        return e.prompt_tokens <= n_ctx - answer_reserve(request.sampling.max_tokens, n_ctx)

    want = have
    while want < trained and not holds(want):
        want *= 2
    want = min(want, trained)
    if want <= have or not holds(want):
        if not holds(trained):  # the model's maximum, not the loaded context, is what the prompt is too long for
            e.n_ctx = max(e.n_ctx, trained)
        log.info("%s: the prompt needs %d tokens, more than a %d-token context holds (trained for %d): not grown",
                 running.name, e.prompt_tokens, want, trained)
        return fallback
    if not fits(want):
        log.info("%s: the prompt needs %d tokens; a %d-token context does not fit this machine as loaded (memory, "
                 "or layers would leave the GPU): not grown", running.name, e.prompt_tokens, want)
        return fallback
    log.info("%s: the prompt needs %d tokens; reloading with a %d-token context (was %d)",
             running.name, e.prompt_tokens, want, have)
    return request, replace(options, num_ctx=want, grown_from=running.options.grown_from or have)
