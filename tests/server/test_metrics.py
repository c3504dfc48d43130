"""``GET /metrics`` over real HTTP: Prometheus text that ``prometheus_client``'s own parser reads, counters
that move as requests are served, a disconnect whose slot and cells are free again within a step, and the
same Host check and bearer token as the API."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import FAST, MODEL, start


def scrape(url: str, **kw) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value}, read with prometheus_client's parser."""
    r = httpx.get(url + "/metrics", timeout=10, **kw)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def value(samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_parse_and_move_as_requests_are_served(url):
    httpx.post(url + "/api/generate", json={"model": MODEL, "prompt": "Hi", "stream": False, "options": FAST},
               timeout=120).raise_for_status()  # the model is loaded before the first scrape
    before = scrape(url)
    r = httpx.post(url + "/api/generate", json={"model": MODEL, "prompt": "Name a colour.", "stream": False,
                                                "options": FAST}, timeout=120)
    assert r.status_code == 200
    done = r.json()
    after = scrape(url)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("localllm_requests_total", route="/api/generate", method="POST", status="200") == 1
    assert moved("localllm_generated_tokens_total", model=MODEL) == done["eval_count"]
    cached = moved("localllm_prompt_tokens_cached_total", model=MODEL)
    assert moved("localllm_prompt_tokens_total", model=MODEL) + cached == done["prompt_eval_count"]
    assert moved("localllm_time_to_first_token_seconds_count", model=MODEL) == 1
    assert moved("localllm_time_per_output_token_seconds_count", model=MODEL) == 1
    assert moved("localllm_decode_steps_total", model=MODEL) >= done["eval_count"] - 1
    # a lone stream's steps never wait for its consumer (only two or more, where llama.cpp takes every core)
    assert ("localllm_consumer_wait_seconds_total", (("model", MODEL),)) in after
    assert moved("localllm_consumer_wait_seconds_total", model=MODEL) == 0
    assert value(after, "localllm_models_loaded") >= 1 and value(after, "localllm_slots", model=MODEL) >= 1
    assert value(after, "localllm_kv_cells", model=MODEL) > 0
    assert value(after, "localllm_model_memory_bytes", model=MODEL) > 0
    assert value(after, "localllm_slots_busy", model=MODEL) == 0 and value(after, "localllm_queue_depth") == 0


def test_a_disconnect_frees_its_slot_and_cells_in_metrics(url):
    body = {"model": MODEL, "prompt": "Write a long story about a lighthouse.", "options": {"num_predict": 2000}}
    with httpx.stream("POST", url + "/api/generate", json=body, timeout=120) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n == 5:
                busy = scrape(url)
                assert value(busy, "localllm_slots_busy", model=MODEL) == 1
                assert value(busy, "localllm_kv_cells_used", model=MODEL) > 0
                break
    deadline = time.monotonic() + 5
    while True:  # the loop sees the cancel at its next step
        now = scrape(url)
        if not value(now, "localllm_slots_busy", model=MODEL) and not value(now, "localllm_kv_cells_used", model=MODEL):
            break
        assert time.monotonic() < deadline, "the disconnected request still holds its slot"
        time.sleep(0.05)
    assert value(now, "localllm_requests_total", route="/api/generate", method="POST", status="200") >= 1


def test_metrics_need_the_token_and_a_local_host(server):
    srv = start(server.engine, api_key="s3cret")
    try:
        assert httpx.get(srv.url + "/metrics", timeout=10).status_code == 401
        assert scrape(srv.url, headers={"Authorization": "Bearer s3cret"})
        r = httpx.get(srv.url + "/metrics", headers={"Host": "evil.example", "Authorization": "Bearer s3cret"},
                      timeout=10)
        assert r.status_code == 403
    finally:
        srv.stop()
