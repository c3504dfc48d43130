"""Where one stream's decode rate goes (issue 11): the same request through the official openai client,
through a bare httpx SSE reader, and straight into the engine (no HTTP), against ``llama-bench`` tg128.

    python benchmarks/single_stream.py                 # 4 rounds, 256 tokens after a 32-token prompt
    python benchmarks/single_stream.py --rounds 6 --tokens 128

One ``localllm serve`` for the two HTTP clients, the engine in its own process (``_common.Side``), and
``llama-bench`` run in each round, all called in turn. Decode rate = (tokens − 1) / (last token − first
token), temperature 0.8, end-of-generation tokens banned so every stream runs its tokens. The differences
are the openai SDK's cost per chunk, then the server's (HTTP, SSE frames), then the loop's. The server
loads the model with ``--threads`` (default: physical cores) like the other sides, and the CPU time per
token of the server's event loop thread and of the client (this process) is printed beside the rates:
on a machine whose cores all decode, that CPU is taken from the decode (``psutil``; the event loop is the
server's main thread, whose thread id is the process id on Linux).

    python benchmarks/single_stream.py --threads 1    # leave the client and the event loop a core
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import _serve
import httpx
import llama_tools
from _common import Side, default_threads, engine_and_model, load_average
from _serve import Localllm, Tokens, med, model_path, story_prompt, stream


class Engine:
    """The engine in this process: the decode loop's own rate for one stream."""

    def __init__(self, model: str, threads: int):
        from localllm.loader import LoadOptions

        self.engine, self.name, _ = engine_and_model(model)
        self.options = LoadOptions(num_ctx=2048, num_thread=threads)
        self.engine.load(self.name, self.options)

    def run(self, prompt: str, tokens: int, seed: int, bias: dict[int, float]) -> float:
        from localllm.api import GenerateRequest, Sampling, TextChunk

        req = GenerateRequest(prompt=prompt, sampling=Sampling(max_tokens=tokens, temperature=0.8, seed=seed,
                                                               logit_bias=bias))
        ts = [time.perf_counter() for ev in self.engine.generate(self.name, req, self.options)
              if isinstance(ev, TextChunk) and ev.text]
        return (len(ts) - 1) / (ts[-1] - ts[0])


def bare(url: str, model: str, prompt: str, tokens: int, seed: int, bias: dict[str, float]) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.8, "seed": seed,
            "stream": True, "logit_bias": bias}
    times = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text":""' not in line:
                times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0])


def thread_cpu(pid: int, tid: int) -> float:
    """CPU seconds (user + system) that thread ``tid`` of process ``pid`` has used."""
    import psutil

    return next(t.user_time + t.system_time for t in psutil.Process(pid).threads() if t.id == tid)


def measured(cpu: dict[str, list[float]], name: str, pid: int, tokens: int, fn: Any, *args: Any) -> float:
    """``fn(*args)``'s decode rate; appends the CPU per token of the server's event loop and of this client."""
    loop0, me0 = thread_cpu(pid, pid), time.process_time()
    rate = fn(*args)
    cpu[f"{name}: server event loop"].append((thread_cpu(pid, pid) - loop0) / tokens * 1e3)
    cpu[f"{name}: client"].append((time.process_time() - me0) / tokens * 1e3)
    return float(rate)


async def sdk(url: str, model: str, prompt: str, tokens: int, seed: int, bias: dict[str, float]) -> float:
    client = _serve.async_client(url)
    try:
        r = await stream(client, model, prompt=prompt, max_tokens=tokens, temperature=0.8, seed=seed,
                         extra_body={"logit_bias": bias})
    finally:
        await client.close()
    return r.decode_rate


def sdk_run(*args: Any) -> float:
    return asyncio.run(sdk(*args))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    threads = args.threads or default_threads()
    path = model_path(args.model)
    tok = Tokens(path)
    bias = {t: -100.0 for t in tok.eog()}
    sbias = {str(t): b for t, b in bias.items()}
    res: dict[str, list[float]] = {"openai client": [], "bare httpx": [], "engine in-process": [], "tg128": []}
    cpu: dict[str, list[float]] = {f"{n}: {w}": [] for n in ("openai client", "bare httpx")
                                   for w in ("server event loop", "client")}
    print(f"model {args.model}, {threads} threads, {args.tokens} tokens; load average {load_average()}", flush=True)
    engine = Side("engine", Engine, model=args.model, threads=threads)
    try:
        with Localllm({"LOCALLLM_PROMPT_CACHE_SIZE": "0"}) as srv:
            # load with the threads of the other sides (the OpenAI API has no option for it); kept loaded
            httpx.post(srv.url + "/api/generate", timeout=600, json={
                "model": args.model, "prompt": "Hello", "stream": False, "keep_alive": -1,
                "options": {"num_thread": threads, "num_ctx": 2048, "num_predict": 1}}).raise_for_status()
            asyncio.run(sdk(srv.url, args.model, "Hello", 8, 0, sbias))  # the SDK's first call pays its set-up
            pid = srv.proc.pid
            for k in range(args.rounds):
                p = [tok.exact(story_prompt(100 + 3 * k + j), 32) for j in range(3)]
                res["openai client"].append(measured(cpu, "openai client", pid, args.tokens, sdk_run, srv.url,
                                                     args.model, p[0], args.tokens, k, sbias))
                res["bare httpx"].append(measured(cpu, "bare httpx", pid, args.tokens, bare, srv.url, args.model,
                                                  p[1], args.tokens, k, sbias))
                res["engine in-process"].append(engine.call("run", prompt=p[2], tokens=args.tokens, seed=k,
                                                            bias=bias))
                recs: list[dict[str, Any]] = llama_tools.llama_bench(path, threads=threads, flash_attn="auto",
                                                                     n_prompt=0, n_gen=128, reps=1)
                res["tg128"].append(float(recs[0]["avg_ts"]))
                print(f"round {k + 1}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in res.items())
                      + f" tok/s   (load {load_average()})", flush=True)
    finally:
        engine.close()
    tg = med(res["tg128"])
    # the machine's speed drifts between rounds: each side is also read against the tg128 of its own round
    ratios = {n: [a / b for a, b in zip(v, res["tg128"], strict=True)] for n, v in res.items() if n != "tg128"}
    print("\n" + "\n".join(f"{n:>18}: {med(v):6.1f} tok/s = {med(v) / tg:.3f} of tg128" for n, v in res.items()))
    print("\nper round, against that round's tg128 (median [range]):\n" + "\n".join(
        f"{n:>18}: {med(r):.3f} [{min(r):.3f}-{max(r):.3f}]" for n, r in ratios.items()))
    print("\nCPU per token (ms), beside the decode's:\n"
          + "\n".join(f"{n:>34}: {med(v):.3f}" for n, v in cpu.items()))


if __name__ == "__main__":
    main()
