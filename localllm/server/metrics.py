"""``GET /metrics``: Prometheus text format, behind the same Host check and bearer token as the API.

What a monitoring stack reads (all names start with ``localllm_``; per model where a model is involved):

* requests by route and status (``requests_total``), requests waiting for a slot or a load
  (``queue_depth``);
* slots busy / total, KV cells used by running requests, kept by idle prefixes, and in the pool
  (``slots_busy``, ``slots``, ``kv_cells_used``, ``kv_cells_cached``, ``kv_cells``); idle prefixes parked
  in host memory while others decode (``kv_tokens_parked``, ``kv_parked_bytes``);
* prompt tokens evaluated, reused from the pool, copied between sequences, restored from disk; tokens
  generated (``*_tokens_total``); draft tokens proposed and accepted;
* time to first token and time per output token (histograms, seconds);
* images encoded by a vision projector, their tokens and the encode time (``images_encoded_total``,
  ``image_tokens_total``, ``image_encode_seconds_total``); audio chunks encoded by an audio projector, their
  tokens and the encode time (``audio_chunks_encoded_total``, ``audio_tokens_total``, ``audio_encode_seconds_total``);
* embedding inputs and rerank documents evaluated, and their tokens (``pooled_inputs_total``,
  ``pooled_tokens_total``);
* loaded models and their memory (``models_loaded``, ``model_memory_bytes``); per llama.cpp device (GPUs, RPC
  workers) what was allocated and the planner's estimate (``device_memory_bytes``,
  ``device_memory_estimate_bytes``, labels model and device); the prompt cache on disk (entries, bytes, hits,
  misses).

Counters of a model count from its load; they restart when it is loaded again (Prometheus' ``rate``
handles the reset).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from localllm.local import device_use

if TYPE_CHECKING:
    from localllm.api import Stats
    from localllm.engine import Engine

disable_created_metrics()  # no *_created series: they double the output and no dashboard reads them
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class _EngineCollector(Collector):
    """Gauges and counters read from the engine's loaded models at scrape time."""

    def __init__(self, engine: Engine):
        self.engine = engine

    def describe(self) -> list[Any]:
        return []  # names are known only at scrape time; nothing to check at registration

    def collect(self) -> Iterator[Any]:
        e = self.engine
        q = GaugeMetricFamily("localllm_queue_depth", "Requests waiting for a slot or a model load.")
        q.add_metric([], e.pending)
        yield q
        loaded = GaugeMetricFamily("localllm_models_loaded", "Models loaded now.")
        models = e.ps()
        loaded.add_metric([], len(models))
        yield loaded
        gauges = {
            "slots": "Parallel slots of the model (sequences that decode together).",
            "slots_busy": "Slots decoding a request now.",
            "kv_cells": "Cells in the model's KV pool (tokens, all sequences together).",
            "kv_cells_used": "KV cells held by running requests.",
            "kv_cells_cached": "KV cells kept by idle sequences for prefix reuse.",
            "kv_tokens_parked": "Tokens of idle sequences parked in host memory while others decode.",
            "kv_parked_bytes": "Host memory holding parked idle sequences' KV state.",
            "model_memory_bytes": "Memory the loaded model holds (weights and KV cache), best estimate.",
            "prompt_cache_entries": "Saved prompt prefixes on disk for the model.",
            "prompt_cache_bytes": "Bytes of saved prompt prefixes on disk for the model.",
        }
        counters = {
            "prompt_tokens": "Prompt tokens evaluated.",
            "prompt_tokens_cached": "Prompt tokens reused from the KV pool instead of evaluated.",
            "prompt_tokens_copied": "Of those, copied from another sequence's cells (a shared prefix).",
            "prompt_tokens_restored": "Prompt tokens restored from the prompt cache on disk.",
            "generated_tokens": "Tokens generated.",
            "draft_tokens_proposed": "Tokens proposed by the draft (speculative decoding).",
            "draft_tokens_accepted": "Draft tokens accepted by the model.",
            "decode_steps": "Batched evaluations run by the model's decode loop.",
            "consumer_wait_seconds": "Time decode steps waited for their streams' consumers to finish with the "
                                     "previous step's tokens (where llama.cpp's threads take every core).",
            "kv_evictions": "Idle sequences dropped from the KV pool to make room.",
            "prompt_cache_hits": "Requests that restored a prefix from disk.",
            "prompt_cache_misses": "Requests that found no prefix on disk.",
            "images_encoded": "Images encoded by the vision projector (one reused by content hash: not again).",
            "image_tokens": "Image tokens those images became.",
            "image_encode_seconds": "Time the vision projector spent encoding images.",
            "audio_chunks_encoded": "Audio chunks (30 s each, as mtmd cuts a clip) encoded by the audio projector.",
            "audio_tokens": "Audio tokens those chunks became.",
            "audio_encode_seconds": "Time the audio projector spent encoding audio.",
            "pooled_inputs": "Embedding inputs and rerank documents evaluated (in batches between decode steps).",
            "pooled_tokens": "Tokens of those inputs.",
            "prompt_tokens_flash": "Prompt tokens evaluated in the flash-attention prefill context (llama.cpp on the "
                                   "CPU, where decoding runs without it).",
            "prefill_move_seconds": "Time spent moving those tokens' KV cells into the slots' streams.",
        }
        g = {k: GaugeMetricFamily(f"localllm_{k}", h, labels=["model"]) for k, h in gauges.items()}
        c = {k: CounterMetricFamily(f"localllm_{k}", h, labels=["model"]) for k, h in counters.items()}
        for m in models:
            try:
                lm = m.metrics
            except Exception:  # noqa: BLE001 - unloading right now
                continue
            name = [m.name]
            for k, v in (("slots", lm.slots), ("slots_busy", lm.slots_busy), ("kv_cells", lm.kv_cells),
                         ("kv_cells_used", lm.kv_tokens_active), ("kv_cells_cached", lm.kv_tokens_idle),
                         ("kv_tokens_parked", lm.kv_tokens_parked), ("kv_parked_bytes", lm.kv_parked_bytes),
                         ("model_memory_bytes", m.size), ("prompt_cache_entries", lm.prompt_cache_entries),
                         ("prompt_cache_bytes", lm.prompt_cache_bytes)):
                g[k].add_metric(name, v)
            counts: tuple[tuple[str, float], ...] = (("prompt_tokens", lm.prompt_tokens_evaluated),
                         ("prompt_tokens_cached", lm.prompt_tokens_cached),
                         ("prompt_tokens_copied", lm.prompt_tokens_copied),
                         ("prompt_tokens_restored", lm.prompt_tokens_restored),
                         ("generated_tokens", lm.generated_tokens), ("draft_tokens_proposed", lm.draft_proposed),
                         ("draft_tokens_accepted", lm.draft_accepted), ("decode_steps", lm.steps),
                         ("consumer_wait_seconds", lm.consumer_wait_ns / 1e9),
                         ("kv_evictions", lm.evictions), ("prompt_cache_hits", lm.prompt_cache_hits),
                         ("prompt_cache_misses", lm.prompt_cache_misses), ("images_encoded", lm.images_encoded),
                         ("image_tokens", lm.image_tokens_encoded), ("image_encode_seconds", lm.image_encode_ns / 1e9),
                         ("audio_chunks_encoded", lm.audio_chunks_encoded), ("audio_tokens", lm.audio_tokens_encoded),
                         ("audio_encode_seconds", lm.audio_encode_ns / 1e9),
                         ("pooled_inputs", lm.pooled_inputs), ("pooled_tokens", lm.pooled_tokens),
                         ("prompt_tokens_flash", lm.prompt_tokens_flash),
                         ("prefill_move_seconds", lm.prefill_move_ns / 1e9))
            for k, x in counts:
                c[k].add_metric(name, x)
        yield from g.values()
        yield from c.values()
        dev = GaugeMetricFamily("localllm_device_memory_bytes", "What llama.cpp allocated for the model on each "
                                "device other than the CPU (weights, KV cache, compute buffers).",
                                labels=["model", "device"])
        est = GaugeMetricFamily("localllm_device_memory_estimate_bytes", "The planner's estimate of the same.",
                                labels=["model", "device"])
        for m in models:
            for d in device_use(m):
                dev.add_metric([m.name, d.name], d.size)
                est.add_metric([m.name, d.name], d.estimate)
        yield dev
        yield est


class Metrics:
    """The registry of one app: request counters (middleware), latency histograms (observed as each
    generation ends) and the engine's gauges (read at scrape time)."""

    def __init__(self, engine: Engine):
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("localllm_requests", "HTTP requests answered, by route and status.",
                                ["route", "method", "status"], registry=self.registry)
        self.ttft = Histogram("localllm_time_to_first_token_seconds",
                              "From the request's arrival to its first token (load and queue included).",
                              ["model"], buckets=TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("localllm_time_per_output_token_seconds", "Time per generated token after the first.",
                              ["model"], buckets=TPOT_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(engine))
        engine.observers.append(self.observe)

    def observe(self, model: str, stats: Stats) -> None:
        """A generation ended: record its latencies."""
        if stats.eval_count or stats.prompt_eval_duration:
            first = stats.load_duration + stats.queue_duration + stats.prompt_eval_duration
            self.ttft.labels(model).observe(first / 1e9)
        if stats.eval_count > 1 and stats.eval_duration > 0:
            self.tpot.labels(model).observe(stats.eval_duration / (stats.eval_count - 1) / 1e9)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestCounter:
    """ASGI middleware counting answered requests by route template (``/v1/models/{model}``, not the raw
    path, so labels stay few). It sits inside the security middleware: a request refused by the Host
    check, the token or the body limit is not counted. A client gone before the answer counts as 499."""

    def __init__(self, app: Any, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [0]

        async def send_status(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")  # set by the router on this same scope
            path = str(getattr(route, "path", "") or "(unmatched)")
            self.metrics.requests.labels(path, scope.get("method", ""), str(status[0] or 499)).inc()
