"""Shared pieces of the server benchmarks (``batching.py``, ``ttft_under_load.py``, ``shared_prefix.py``,
``soak.py``, ``prompt_cache.py``): a ``localllm serve`` process on a free loopback port in an isolated home,
``llama_cpp.server`` beside it, ``/metrics`` parsed, prompts of an exact token length, official openai
client streams.

The isolated home: ``LOCALLLM_HOME`` is a fresh temporary directory (so the prompt cache, chats and config
start empty and nothing is written into the home the tests share) while ``LOCALLLM_MODELS`` points at the
installed models of the caller's home (``$LOCALLLM_HOME``, else the test home
``~/.cache/localllm-tests/home``), so nothing is pulled again.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LOG = Path(tempfile.gettempdir()) / "localllm-bench-servers.log"  # servers' stderr (an unread pipe would block)
TEST_HOME = Path("~/.cache/localllm-tests/home").expanduser()


def models_dir() -> Path:
    """The installed models the benchmarks read: ``$LOCALLLM_MODELS``, else ``$LOCALLLM_HOME``'s, else the
    test home's."""
    if os.environ.get("LOCALLLM_MODELS"):
        return Path(os.environ["LOCALLLM_MODELS"]).expanduser()
    home = Path(os.environ.get("LOCALLLM_HOME") or TEST_HOME).expanduser()
    return home / "data" / "models"


def model_path(model: str) -> Path:
    """The GGUF file of an installed model (or a path given as is)."""
    p = Path(model).expanduser()
    if p.suffix == ".gguf" and p.exists():
        return p
    from localllm.config import Paths
    from localllm.store import Store

    d = models_dir()
    store = Store(Paths(data=d.parent, cache=d.parent / "cache", config=d.parent / "config", models=d))
    path = store.get(model).path
    if path is None:
        raise SystemExit(f"{model} has no GGUF file installed under {d}")
    return Path(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rpc_workers(n: int) -> tuple[list[subprocess.Popen[bytes]], str]:
    """``n`` ``localllm worker`` processes (one thread each) on free loopback ports, each answering before this
    returns (or after 30 s): (the processes, their ``--rpc`` list). Kill them when done."""
    from backends.llamacpp.devices import hello

    ports = [free_port() for _ in range(n)]
    procs = [subprocess.Popen([sys.executable, "-m", "localllm", "worker", "--port", str(p), "--threads", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT) for p in ports]
    for p in ports:
        for _ in range(300):
            try:
                hello(f"127.0.0.1:{p}", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
    return procs, ",".join(f"127.0.0.1:{p}" for p in ports)


def _wait_ready(url: str, proc: subprocess.Popen[bytes], probe: str, timeout: float = 180) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}): {LOG.read_text(errors='replace')[-1200:]}")
        try:
            if httpx.get(url + probe, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not start within {timeout:.0f} s")


class Server:
    """A server process on a free loopback port; ``close()`` (or ``with``) stops it."""

    proc: subprocess.Popen[bytes]
    url: str
    home: Path | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def rss_mb(self) -> float:
        """Resident memory of the server process (MB, 10^6 bytes)."""
        import psutil

        return float(psutil.Process(self.proc.pid).memory_info().rss) / 1e6

    def anon_mb(self) -> float:
        """Of the resident memory, the part not backed by files (RSS − shared: heap, KV pool, buffers; the
        memory-mapped weights are file-backed)."""
        import psutil

        m = psutil.Process(self.proc.pid).memory_info()
        return float(m.rss - getattr(m, "shared", 0)) / 1e6

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Localllm(Server):
    """``python -m localllm serve`` with ``env`` on top of an isolated home (``home`` reuses one: a restart
    that must find the prompt cache of the previous process); ``root``: another checkout's code (a before/after
    comparison in one run)."""

    def __init__(self, env: dict[str, str] | None = None, home: Path | None = None, root: Path | None = None):
        self.own_home = home is None
        self.home = Path(tempfile.mkdtemp(prefix="localllm-bench-home-")) if home is None else home
        port = free_port()
        full = {**os.environ, "LOCALLLM_HOME": str(self.home), "LOCALLLM_MODELS": str(models_dir()),
                "LOCALLLM_HOST": f"127.0.0.1:{port}", "LOCALLLM_KEEP_ALIVE": "-1",
                "PYTHONPATH": str(root or ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
        with open(LOG, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "localllm", "serve"], env=full, cwd=root or ROOT,
                                         stdout=subprocess.DEVNULL, stderr=log)
        self.url = f"http://127.0.0.1:{port}"
        _wait_ready(self.url, self.proc, "/")

    def metrics(self) -> dict[str, float]:
        """``/metrics`` summed over labels: {sample name: value} (``localllm_prompt_tokens_total``...)."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(httpx.get(self.url + "/metrics", timeout=10).text):
            for s in fam.samples:
                out[s.name] = out.get(s.name, 0.0) + float(s.value)
        return out

    def remove_home(self) -> None:
        if self.home is not None:
            shutil.rmtree(self.home, ignore_errors=True)


class LlamaCppServer(Server):
    """``python -m llama_cpp.server`` on the same file; ``interrupt=False`` so that it queues requests like
    we do (its default lets a new request cut the running stream)."""

    def __init__(self, path: Path, threads: int, n_ctx: int, interrupt: bool = False):
        port = free_port()
        with open(LOG, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llama_cpp.server", "--model", str(path), "--n_threads", str(threads),
                 "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx), "--host", "127.0.0.1", "--port",
                 str(port), "--model_alias", "bench", "--interrupt_requests", str(interrupt)],
                env=dict(os.environ),
                stdout=subprocess.DEVNULL, stderr=log)
        self.url = f"http://127.0.0.1:{port}"
        _wait_ready(self.url, self.proc, "/v1/models")


class LlamaServer(Server):
    """llama.cpp's own ``llama-server`` (C++), ``slots`` slots of ``n_ctx`` tokens each (``--jinja``, no web UI)."""

    def __init__(self, binary: Path, path: Path, threads: int, n_ctx: int, slots: int, extra: tuple[str, ...] = ()):
        port = free_port()
        with open(LOG, "ab") as log:
            self.proc = subprocess.Popen(
                [str(binary), "-m", str(path), "-c", str(n_ctx * slots), "-np", str(slots), "-t", str(threads),
                 "-tb", str(threads), "--host", "127.0.0.1", "--port", str(port), "--jinja", "--no-webui", *extra],
                stdout=subprocess.DEVNULL, stderr=log)
        self.url = f"http://127.0.0.1:{port}"
        _wait_ready(self.url, self.proc, "/v1/models")


# ------------------------------------------------------------------------------------------ prompts


class Tokens:
    """The model's own tokenizer (llama.cpp, vocabulary only) for prompts of an exact token length."""

    def __init__(self, path: Path):
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)

    def eog(self) -> list[int]:
        """The end-of-generation tokens (EOS, end of turn...): what ``logit_bias`` -100 keeps out for streams
        that must run their full length, as llama.cpp's tools do."""
        import llama_cpp

        vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        return [t for t in range(self.llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)]

    def count(self, text: str, bos: bool = True) -> int:
        return len(self.llm.tokenize(text.encode(), add_bos=bos, special=False))

    def exact(self, text: str, n: int, bos: bool = True) -> str:
        """A prefix of ``text`` (repeated as needed) that tokenizes to exactly ``n`` tokens (BOS included when
        the model adds one); whole words, then cut token by token."""
        while self.count(text, bos) < n + 8:
            text = text + " " + text
        toks = self.llm.tokenize(text.encode(), add_bos=bos, special=False)
        for cut in range(n, n + 8):  # detokenizing a cut can merge into fewer/more tokens: find one that holds
            start = 1 if bos and toks and toks[0] == self.llm.token_bos() else 0
            s = self.llm.detokenize(toks[start:cut]).decode(errors="ignore")
            if self.count(s, bos) == n:
                return s
        raise SystemExit(f"could not cut a prompt of exactly {n} tokens")


STORY_OPENINGS = ["dragon", "lighthouse keeper", "robot", "sailor", "baker", "cartographer", "violinist",
                  "gardener", "astronaut", "blacksmith", "detective", "beekeeper", "clockmaker", "diver",
                  "painter", "shepherd"]


def story_prompt(i: int) -> str:
    """A raw story opening that differs from its first words on (so no two share a cached prefix)."""
    who = STORY_OPENINGS[i % len(STORY_OPENINGS)]
    return (f"Story {i}. Once upon a time, a {who} who lived at the edge of a vast northern forest set out "
            f"on a long journey across the mountains, and on the way met many strange travellers, each with "
            f"a tale to tell. This is the whole story, told slowly and in great detail:")


def system_prompt(n_tokens: int, tok: Tokens, nonce: str = "") -> str:
    """A long, varied system prompt (rules and reference text) of about ``n_tokens`` tokens."""
    parts = [f"You are a careful assistant for the Northwind project {nonce}. Follow every rule below."]
    topics = ["billing", "shipping", "returns", "warranty", "accounts", "privacy", "inventory", "support",
              "security", "pricing", "discounts", "loyalty", "gift cards", "repairs", "exports", "taxes"]
    i = 0
    while tok.count("\n".join(parts)) < n_tokens:
        t = topics[i % len(topics)]
        parts.append(f"Rule {i + 1} ({t}): when a customer asks about {t}, first check the order number, then "
                     f"quote section {i % 7 + 1}.{i % 5 + 2} of the {t} policy, never promise a date you cannot "
                     f"verify, and end with one short sentence that names the next step for case {1000 + 37 * i}.")
        i += 1
    return "\n".join(parts)


# ------------------------------------------------------------------------------------------ clients


@dataclass
class StreamResult:
    ttft: float = float("nan")  # s from the call to the first content chunk
    total: float = float("nan")  # s from the call to the end of the stream
    first: float = float("nan")  # perf_counter of the first / last content chunk
    last: float = float("nan")
    chunks: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish: str | None = None
    error: str | None = None
    times: list[float] = field(default_factory=list)  # perf_counter of every content chunk (keep_times)

    def gaps(self, start: float = float("-inf"), end: float = float("inf")) -> list[float]:
        """Seconds between consecutive chunks whose later one arrived within [start, end]."""
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False) if start <= b <= end]

    @property
    def decode_rate(self) -> float:
        n = self.completion_tokens or self.chunks
        return (n - 1) / (self.last - self.first) if n > 1 and self.last > self.first else float("nan")


def async_client(url: str, max_retries: int = 0) -> Any:
    import httpx
    import openai

    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=max_retries,
                              http_client=httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_connections=64)))


async def stream(client: Any, model: str, *, prompt: str | None = None, messages: list[dict[str, Any]] | None = None,
                 max_tokens: int = 128, temperature: float = 0.8, seed: int = 1,
                 extra_body: dict[str, Any] | None = None, keep_times: bool = False,
                 stop_after: int | None = None, on_first: Any = None, stop: asyncio.Event | None = None
                 ) -> StreamResult:
    """One streamed completion (``prompt``: ``/v1/completions``; ``messages``: ``/v1/chat/completions``) with
    the official openai client; usage from ``stream_options.include_usage``. ``stop_after`` closes the stream
    after that many chunks (a client that leaves mid-answer), and so does ``stop`` once set; ``on_first()`` is
    called at the first chunk."""
    r = StreamResult()
    kw: dict[str, Any] = dict(model=model, max_tokens=max_tokens, temperature=temperature, seed=seed, stream=True,
                              stream_options={"include_usage": True}, extra_body=extra_body or {})
    t0 = time.perf_counter()
    try:
        if messages is not None:
            s = await client.chat.completions.create(messages=messages, **kw)
        else:
            s = await client.completions.create(prompt=prompt, **kw)
        async for ch in s:
            if ch.usage is not None:
                r.prompt_tokens, r.completion_tokens = ch.usage.prompt_tokens, ch.usage.completion_tokens
            if not ch.choices:
                continue
            c = ch.choices[0]
            text = c.delta.content if messages is not None else c.text  # type: ignore[union-attr]
            if c.finish_reason:
                r.finish = c.finish_reason
            if text:
                now = time.perf_counter()
                if r.chunks == 0:
                    r.first, r.ttft = now, now - t0
                    if on_first is not None:
                        on_first()
                if keep_times:
                    r.times.append(now)
                r.last = now
                r.chunks += 1
                if (stop_after is not None and r.chunks >= stop_after) or (stop is not None and stop.is_set()):
                    await s.close()
                    r.finish = "left"
                    break
    except Exception as e:  # noqa: BLE001 - counted by the caller
        r.error = f"{type(e).__name__}: {e}"[:300]
    r.total = time.perf_counter() - t0
    return r


def run_async(coro: Any) -> Any:
    return asyncio.run(coro)


# ------------------------------------------------------------------------------------------ figures


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; nan for no values."""
    v = sorted(x for x in values if x == x)
    if not v:
        return float("nan")
    return v[min(len(v) - 1, max(0, int(round(q * len(v) + 0.5)) - 1))]


def med(values: list[float]) -> float:
    v = [x for x in values if x == x]
    return statistics.median(v) if v else float("nan")


def load_avg() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} / {five:.2f} / {fifteen:.2f}"
