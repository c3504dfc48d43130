"""What ``localllm run``, its ``>>>`` prompt (:mod:`localllm.cli.interactive`) and ``localllm bench`` share:
the run settings (flags → engine options, checked in one sentence each), streaming one answer to the
terminal (reasoning shown as Ollama shows it), Ollama's ``--verbose`` stats block, and getting a model
that is not installed yet.

    >>> from localllm.api import Stats
    >>> settings = build_settings(temperature=0, think="high")
    >>> settings.sampling.temperature, settings.think
    (0, 'high')
    >>> print("\\n".join(stats_lines(Stats(eval_count=12, thinking_tokens=5, eval_duration=10**8))))
    eval count:           12 token(s)
    thinking tokens:      5 token(s)
    eval duration:        100ms
    eval rate:            120.00 tokens/s
    prompt cache:         0 token(s) reused
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from types import FrameType
from typing import IO, TYPE_CHECKING, Any

import click

from localllm.cli.display import go_duration, isatty, pull_with_progress
from localllm.errors import LocalLLMError
from localllm.hardware import BACKEND_CHOICES as BACKENDS  # "auto" and every registered backend, read live

if TYPE_CHECKING:
    from localllm.api import Done, GenerateRequest, Installed, Models, Runner, Sampling, Stats, ThinkValue
    from localllm.loader import LoadOptions



class BackendChoice(click.Choice):
    """``--backend``: ``auto`` or a registered backend's name, the registry read when the option is parsed (a
    backend registered after the command was built is a choice too)."""

    def __init__(self) -> None:
        super().__init__(list(BACKENDS))

    @property  # type: ignore[override]
    def choices(self) -> tuple[str, ...]:
        return tuple(BACKENDS)

    @choices.setter
    def choices(self, value: Any) -> None:
        pass  # click.Choice.__init__ sets it: the registry is the choices


# Ollama's colours for reasoning on a terminal (readline.ColorGrey / ColorBold / ColorDefault)
GREY, BOLD, RESET = "\x1b[38;5;245m", "\x1b[1m", "\x1b[0m"
THINKING_OPEN, THINKING_CLOSE = "Thinking...\n", "...done thinking.\n\n"


# ------------------------------------------------------------------------------------------ stats


def stats_lines(stats: Stats) -> list[str]:
    """Ollama's ``--verbose`` block (``api.Metrics.Summary``) plus our thinking, prompt-cache and draft lines.

    Ollama prints a line only when its value is non-zero; so do we. The prompt eval rate counts the
    tokens actually evaluated (cached ones excluded), which is what the duration measured; ``thinking
    tokens`` are the part of ``eval count`` that was reasoning.
    """
    lines: list[str] = []
    if stats.total_duration > 0:
        lines.append(f"total duration:       {go_duration(stats.total_duration)}")
    if stats.load_duration > 0:
        lines.append(f"load duration:        {go_duration(stats.load_duration)}")
    if stats.prompt_eval_count > 0:
        lines.append(f"prompt eval count:    {stats.prompt_eval_count} token(s)")
    if stats.prompt_eval_duration > 0:
        lines.append(f"prompt eval duration: {go_duration(stats.prompt_eval_duration)}")
        lines.append(f"prompt eval rate:     {stats.prompt_eval_rate:.2f} tokens/s")
    if stats.eval_count > 0:
        lines.append(f"eval count:           {stats.eval_count} token(s)")
    if stats.thinking_tokens > 0:
        lines.append(f"thinking tokens:      {stats.thinking_tokens} token(s)")
    if stats.eval_duration > 0:
        lines.append(f"eval duration:        {go_duration(stats.eval_duration)}")
        lines.append(f"eval rate:            {stats.eval_rate:.2f} tokens/s")
    if stats.image_tokens > 0:
        lines.append(f"image tokens:         {stats.image_tokens} token(s) of {stats.images} image(s)")
        lines.append(f"image encode:         {stats.images_encoded} encoded in "
                     f"{go_duration(stats.image_encode_duration)}"
                     + ("" if stats.images_encoded else " (reused)"))
    if stats.audio_tokens > 0:
        lines.append(f"audio tokens:         {stats.audio_tokens} token(s) of {stats.audio_clips} clip(s)")
        lines.append(f"audio encode:         {stats.audio_chunks_encoded} chunk(s) encoded in "
                     f"{go_duration(stats.audio_encode_duration)}"
                     + ("" if stats.audio_chunks_encoded else " (reused)"))
    restored = f" ({stats.prompt_restored_tokens} restored from disk)" if stats.prompt_restored_tokens else ""
    lines.append(f"prompt cache:         {stats.prompt_cached_tokens} token(s) reused{restored}")
    if stats.draft_proposed:
        lines.append(
            f"draft acceptance:     {stats.draft_accepted / stats.draft_proposed:.2%} "
            f"({stats.draft_accepted}/{stats.draft_proposed} token(s))"
        )
    return lines


def drafting_line(runner: Runner, name: str) -> str | None:
    """The ``--verbose`` line on speculative decoding for the model ``name`` runs on (None without a draft)."""
    try:
        loaded = runner.ps()
    except Exception:  # noqa: BLE001 - a stats line is not worth failing the answer for
        return None
    m = next((r for r in loaded if r.name == name), loaded[0] if len(loaded) == 1 else None)
    if m is None or not m.drafting:
        return None
    return f"drafting:             {m.drafting}"


def print_stats(stats: Stats, err: IO[str] | None = None, plan: str = "") -> None:
    """The ``--verbose`` block on ``err``; ``plan``: the loaded model's plan line (:func:`loaded_plan`), last."""
    err = err or sys.stderr
    err.write("\n".join(stats_lines(stats) + ([f"plan:                 {plan}"] if plan else [])) + "\n")
    err.flush()


def loaded_plan(runner: Runner, name: str) -> str:
    """The plan ``name`` loaded with, in the line ``localllm probe`` prints for it (in-process; "" from a server,
    which does not say)."""
    return next((m.plan for m in runner.ps() if m.name == name), "")


def placement_lines(runner: Runner, name: str) -> list[str]:
    """``--verbose``: where a mixture of experts was placed (its experts partly in RAM), else nothing."""
    try:
        models = runner.ps()
    except Exception:  # a server that cannot say: the stats stand alone
        return []
    return [f"experts in RAM:       {m.experts_placement}"
            for m in models if m.n_cpu_moe and (m.name == name or len(models) == 1)]


def overflow_note(stats: Stats) -> str | None:
    """The stderr line for turns dropped to fit the context, or None."""
    n = stats.dropped_messages
    if not n:
        return None
    return (f"Note: the conversation no longer fits the {stats.n_ctx}-token context; "
            f"the {n} oldest message(s) were left out of this answer.")


# ------------------------------------------------------------------------------------------ streaming


@dataclass
class Answer:
    """What one generation produced."""

    text: str = ""
    thinking: str = ""  # the reasoning, apart from the answer
    done: Done | None = None
    cancelled: bool = False
    first_token_s: float | None = None  # seconds from the call to the first text (reasoning included)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class _Display:
    """Writes an answer as it streams: reasoning between Ollama's ``Thinking...`` / ``...done thinking.``
    lines (grey on a terminal) unless hidden, then the answer."""

    def __init__(self, out: IO[str] | None, show_thinking: bool):
        self.out = out
        self.show_thinking = show_thinking and out is not None
        self.color = out is not None and isatty(out)
        self.open = False  # inside the reasoning block
        self.last = ""

    def _write(self, text: str) -> None:
        assert self.out is not None
        self.out.write(text)
        self.out.flush()
        if text:
            self.last = text

    def thinking(self, text: str) -> None:
        if not self.show_thinking:
            return
        if not self.open:
            self.open = True
            self._write(f"{GREY}{BOLD}{THINKING_OPEN}{RESET}{GREY}" if self.color else THINKING_OPEN)
        self._write(text)

    def close_thinking(self) -> None:
        if not self.open:
            return
        self.open = False
        end = "" if self.last.endswith("\n") else "\n"
        self._write(f"{end}{GREY}{BOLD}{THINKING_CLOSE}{RESET}" if self.color else end + THINKING_CLOSE)

    def answer(self, text: str) -> None:
        if self.out is None:
            return
        self.close_thinking()
        self._write(text)


def stream_answer(
    runner: Runner,
    name: str,
    request: GenerateRequest,
    options: LoadOptions | None = None,
    *,
    out: IO[str] | None = None,
    show_thinking: bool = True,
    cancel: threading.Event | None = None,
    keep_alive: float | None = None,
) -> Answer:
    """Run one generation in this thread, writing it to ``out`` as it arrives (flushed per piece).

    Ctrl+C stops it: while the answer streams, SIGINT sets ``cancel`` instead of raising (in the main
    thread), so the generation stops at its next step wherever it is (loading, evaluating the prompt,
    decoding; a server sees the connection drop) and the partial answer comes back with ``cancelled=True``.
    Errors raised by the runner are re-raised here.

    >>> # answer = stream_answer(session.runner, "smollm2:135m", GenerateRequest(prompt="Hi"), out=sys.stdout)
    """
    from localllm.api import Done, TextChunk, ToolCalls

    cancel = cancel or threading.Event()
    answer = Answer()
    display = _Display(out, show_thinking)
    parts: list[str] = []
    thoughts: list[str] = []
    t0 = time.perf_counter()
    with ctrl_c_sets(cancel):
        events = runner.generate(name, request, options, cancel=cancel, keep_alive=keep_alive)
        try:
            for event in events:
                if isinstance(event, TextChunk):
                    if answer.first_token_s is None:
                        answer.first_token_s = time.perf_counter() - t0
                    if event.thinking:
                        thoughts.append(event.text)
                        display.thinking(event.text)
                    else:
                        parts.append(event.text)
                        display.answer(event.text)
                elif isinstance(event, ToolCalls):
                    answer.tool_calls.extend(event.calls)
                elif isinstance(event, Done):
                    answer.done = event
        except KeyboardInterrupt:  # not the main thread's handler: leaving the stream cancels it
            cancel.set()
        finally:
            events.close()
            display.close_thinking()  # ended (or stopped) while reasoning: close the block, reset the colour
    answer.text = "".join(parts)
    answer.thinking = "".join(thoughts)
    answer.cancelled = cancel.is_set() or (answer.done is not None and answer.done.finish_reason == "cancelled")
    return answer


@contextmanager
def ctrl_c_sets(cancel: threading.Event) -> Iterator[None]:
    """SIGINT sets ``cancel`` (instead of raising KeyboardInterrupt) inside the block, in the main thread: a
    generation or a tool call stops on Ctrl+C whatever handler the process had before."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        cancel.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# ------------------------------------------------------------------------------------------ models


def ensure_model(models: Models, name: str) -> Installed:
    """The installed model for ``name``; a missing catalog/Hub model is pulled first (with the pull
    command's progress display). A local path is never pulled: it is read in place or refused, and
    an unknown alias fails in pull with its suggestions."""
    from localllm.errors import ModelNotFoundError

    try:
        return models.show(name)
    except ModelNotFoundError:
        from localllm.names import parse_name

        if parse_name(name, allow_path=True).kind == "path":
            raise
    pull_with_progress(models, name)
    return models.show(name)


# ------------------------------------------------------------------------------------------ settings


@dataclass
class RunSettings:
    """Everything ``run`` and the REPL need beyond the model name."""

    sampling: Sampling
    load: LoadOptions
    system: str | None = None
    format: str | None = None
    verbose: bool = False
    keep_alive: float | None = None
    think: ThinkValue = None  # None: the model's default (a thinking model thinks)
    hide_thinking: bool = False  # think, but do not print the reasoning

    def copy(self) -> RunSettings:
        """A copy whose sampling options can change without touching this one."""
        return replace(self, sampling=replace(self.sampling))

    def request(self, messages: list[dict[str, Any]]) -> GenerateRequest:
        """A chat request for ``messages`` with these settings (system prompt first, when set)."""
        from localllm.api import GenerateRequest

        head = [{"role": "system", "content": self.system}] if self.system else []
        return GenerateRequest(messages=head + messages, sampling=replace(self.sampling), format=self.format,
                               think=self.think)


def parse_think_flag(value: str | None) -> ThinkValue:
    """``--think[=true|false|low|medium|high|max]`` → the request's ``think`` (``max`` is the highest level).

    >>> parse_think_flag(None), parse_think_flag("true"), parse_think_flag("false"), parse_think_flag("max")
    (None, True, False, 'high')
    """
    if value is None:
        return None
    from localllm.thinking import parse_think

    word = value.strip().lower()
    try:
        return parse_think({"true": True, "false": False}.get(word, word))
    except ValueError as e:
        raise LocalLLMError(f"{str(e)[0].upper()}{str(e)[1:]}.") from None


def build_settings(
    *,
    temperature: float | None = None,
    seed: int | None = None,
    num_predict: int | None = None,
    num_ctx: int | None = None,
    system: str | None = None,
    fmt: str | None = None,
    draft: str | None = None,
    num_draft: int | None = None,
    kv_cache: str | None = None,
    backend: str = "auto",
    gpu_layers: int | None = None,
    devices: tuple[str, ...] = (),
    tensor_split: str | None = None,
    cpu_moe: bool = False,
    num_cpu_moe: int | None = None,
    verbose: bool = False,
    keepalive: str | None = None,
    think: str | None = None,
    hide_thinking: bool = False,
) -> RunSettings:
    """Validate the flags (one sentence per mistake) and turn them into engine options.

    >>> s = build_settings(temperature=0, seed=1, kv_cache="q8_0")
    >>> s.sampling.temperature, s.sampling.seed, s.load.kv_cache_type
    (0, 1, 'q8_0')
    """
    from localllm.api import KV_CACHE_TYPES, Sampling
    from localllm.loader import LoadOptions
    from localllm.residency import parse_keep_alive

    if kv_cache is not None and kv_cache.lower() not in KV_CACHE_TYPES:
        raise LocalLLMError(f"Unknown KV cache type {kv_cache!r}: choose one of {', '.join(KV_CACHE_TYPES)}.")
    if backend not in BACKENDS:
        raise LocalLLMError(f"Unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}.")
    if fmt is not None and fmt != "json":
        raise LocalLLMError(f"Unknown format {fmt!r}: only 'json' is supported.")
    if num_ctx is not None and num_ctx < 1:
        raise LocalLLMError(f"--num-ctx must be a positive number of tokens, got {num_ctx}.")
    if num_draft is not None and num_draft < 1:
        raise LocalLLMError(f"--num-draft must be at least 1, got {num_draft}.")
    if temperature is not None and temperature < 0:
        raise LocalLLMError(f"--temperature must be 0 or more, got {temperature}.")
    sampling = Sampling(given=frozenset())  # a flag given is the user's choice, over a created model's PARAMETER
    if temperature is not None:
        sampling.choose(temperature=temperature)
    if seed is not None:
        sampling.choose(seed=seed)
    if num_predict is not None:
        sampling.choose(max_tokens=num_predict)
    load = LoadOptions(
        num_ctx=num_ctx,
        kv_cache_type=kv_cache.lower() if kv_cache else None,
        backend=backend,
        draft=(draft or "auto").strip() or "auto",
        num_draft=num_draft or 4,
        num_gpu=gpu_layers if gpu_layers is not None and gpu_layers >= 0 else None,
        devices=tuple(d for part in devices for d in part.split(",") if d.strip()) or None,
        tensor_split=parse_split(tensor_split),
        cpu_moe=cpu_moe,
        num_cpu_moe=num_cpu_moe,
    )
    ka = parse_keep_alive(keepalive) if keepalive not in (None, "") else None
    return RunSettings(sampling=sampling, load=load, system=system, format=fmt, verbose=verbose, keep_alive=ka,
                       think=parse_think_flag(think), hide_thinking=hide_thinking)


def parse_split(text: str | None) -> tuple[float, ...] | None:
    """``--tensor-split 3,1`` → (3.0, 1.0); one sentence for anything else."""
    if not text:
        return None
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise LocalLLMError(f"--tensor-split takes numbers separated by commas (e.g. 3,1), got {text!r}.") from None


def user_message(text: str, images: list[bytes], err: IO[str]) -> dict[str, object]:
    """A user turn: ``text`` with the image and audio files it names taken out and attached (after ``images``,
    which may hold audio clips too: they ride together, as in Ollama's API)."""
    from localllm.audio import duration_label, read_audio
    from localllm.audio import extract_paths as audio_paths
    from localllm.images import extract_paths, read_image

    text, paths = extract_paths(text)
    text, clips = audio_paths(text)
    pics = list(images)
    for p in paths:
        pics.append(read_image(p))
        err.write(f"Added image '{p}'\n")
    for p in clips:
        pics.append(read_audio(p))
        err.write(f"Added audio '{p}' ({duration_label(pics[-1])})\n")
    msg: dict[str, object] = {"role": "user", "content": text}
    if pics:
        msg["images"] = pics
    return msg
