"""A fake backend with the real contract, for tests of the layers above that a real model cannot show:
a crash in the middle of a stream, an out-of-memory at load, a slow stream to cancel.

Knobs arrive in ``LoadSpec.extra`` (the model file is not read; ``model_path`` is only echoed):

* ``reply``: the text every generation streams (default: echoes the last user message / prompt);
* ``chunk``: characters per TextChunk (default 4); ``delay``: seconds between chunks (default 0);
* ``crash_after``: raise ``RuntimeError("fake backend crashed")`` after this many chunks;
* ``fail_load``: ``"oom"`` → :class:`ModelLoadError` saying memory ran out; any other string → that message;
* ``tool_calls``: a list of ``{"name", "arguments"}`` emitted as one :class:`ToolCalls` event when tools are given.

>>> from backends.base import LoadSpec, GenerateRequest
>>> b = FakeBackend(LoadSpec("fake.gguf", extra={"reply": "hi there"}))
>>> [type(e).__name__ for e in b.generate(GenerateRequest(prompt="x"))]
['TextChunk', 'TextChunk', 'Done']
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from backends._stops import StopMatcher
from backends.base import (
    Backend,
    ContextOverflowError,
    Done,
    Event,
    GenerateRequest,
    LoadSpec,
    ModelInfo,
    ModelLoadError,
    Stats,
    TextChunk,
    ToolCalls,
)


class FakeBackend(Backend):
    """Deterministic, instant, no weights. One character = one token."""

    name = "fake"
    max_parallel = 1

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return True, ""

    def __init__(self, spec: LoadSpec):
        super().__init__(spec)
        fail = spec.extra.get("fail_load")
        if fail == "oom":
            raise ModelLoadError(f"Not enough memory to load {spec.model_path} with a {spec.n_ctx}-token context.")
        if fail:
            raise ModelLoadError(str(fail))
        self.closed = False
        self.generations = 0
        self._lock = threading.Lock()
        self._info = ModelInfo(architecture="fake", n_ctx=spec.n_ctx, n_ctx_train=spec.n_ctx, n_layers=1,
                               n_vocab=256, chat_template=None, size_bytes=1 << 20,
                               kv_cache_type=spec.kv_cache_type,
                               draft=(spec.draft.kind if spec.draft else None))

    @property
    def info(self) -> ModelInfo:
        return self._info

    def _reply(self, request: GenerateRequest) -> str:
        if "reply" in self.spec.extra:
            return str(self.spec.extra["reply"])
        if request.prompt is not None:
            return request.prompt
        users = [m for m in request.messages or [] if m.get("role") == "user"]
        return str(users[-1].get("content", "")) if users else ""

    def generate(self, request: GenerateRequest, cancel: threading.Event | None = None) -> Iterator[Event]:
        if self.closed:
            raise ModelLoadError("This model has been unloaded.")
        with self._lock:
            self.generations += 1
            t0 = time.perf_counter_ns()
            prompt = request.prompt if request.prompt is not None else "".join(
                str(m.get("content", "")) for m in request.messages or [])
            if len(prompt) >= self.spec.n_ctx:
                raise ContextOverflowError(
                    f"The prompt needs {len(prompt)} tokens but the context holds {self.spec.n_ctx}.",
                    prompt_tokens=len(prompt), n_ctx=self.spec.n_ctx)
            stats = Stats(prompt_eval_count=len(prompt), n_ctx=self.spec.n_ctx)
            if request.tools and self.spec.extra.get("tool_calls"):
                yield ToolCalls(list(self.spec.extra["tool_calls"]))
                stats.total_duration = time.perf_counter_ns() - t0
                yield Done(stats=stats, finish_reason="stop")
                return
            text = self._reply(request)
            s = request.sampling
            if s.max_tokens and s.max_tokens > 0:
                finish = "length" if len(text) > s.max_tokens else "stop"
                text = text[: s.max_tokens]
            else:
                finish = "stop"
            size = int(self.spec.extra.get("chunk", 4))
            delay = float(self.spec.extra.get("delay", 0))
            crash_after = self.spec.extra.get("crash_after")
            stops = StopMatcher(s.stop)
            for n, i in enumerate(range(0, len(text), size)):
                if cancel is not None and cancel.is_set():
                    finish = "cancelled"
                    break
                if crash_after is not None and n >= int(crash_after):
                    raise RuntimeError("fake backend crashed")
                if delay:
                    time.sleep(delay)
                piece = text[i : i + size]
                stats.eval_count += len(piece)
                emit, hit = stops.push(piece)
                if emit:
                    yield TextChunk(emit, tokens=len(piece))
                if hit:
                    finish = "stop"
                    break
            else:
                rest = stops.flush()
                if rest:
                    yield TextChunk(rest, tokens=0)
            stats.context_used = stats.prompt_eval_count + stats.eval_count
            stats.total_duration = stats.eval_duration = time.perf_counter_ns() - t0
            yield Done(stats=stats, finish_reason=finish)  # type: ignore[arg-type]

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, tokens: list[int]) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")

    def embed(self, texts: list[str]) -> list[list[float]]:
        out = []
        for t in texts:
            v = [0.0] * 8
            for i, b in enumerate(t.encode("utf-8")):
                v[i % 8] += b
            n = sum(x * x for x in v) ** 0.5 or 1.0
            out.append([x / n for x in v])
        return out

    def close(self) -> None:
        self.closed = True
