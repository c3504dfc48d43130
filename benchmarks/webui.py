"""The web page (issue 49): bytes of a first load (gzip), and decode speed with the page streaming vs the same
request by ``curl``.

    LOCALLLM_HOME=~/.cache/localllm-tests/home python benchmarks/webui.py [--rounds 3] [--prompt TEXT]

Starts ``localllm serve`` on a free port (the home's default model), opens ``/ui/`` in Debian's Chromium through
Playwright, and:

* first load: the page's own files as the browser received them (``transferSize`` of the navigation and each
  resource: gzip bodies plus headers) and the gzip bodies alone;
* tokens/s: the page sends the prompt (temperature 0, seed 1); the exact body it sent to ``/api/chat`` is then sent
  by ``curl -N`` (streaming, output to /dev/null but read). Rounds alternate page / curl; the figure is the
  server's own ``eval_count / eval_duration`` of each answer (same tokens: temperature 0), and the wall time from
  the request to the last line, as each client saw it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--prompt", default="Count from 1 to 200, one number per line.")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    import tempfile

    from localllm.config import paths

    # the models of LOCALLLM_HOME, the chats in a scratch home
    env = {**os.environ, "LOCALLLM_MODELS": str(paths().models), "LOCALLLM_HOME": tempfile.mkdtemp()}
    proc = subprocess.Popen([sys.executable, "-m", "localllm", "serve", "--host", f"127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        for _ in range(300):
            try:
                httpx.get(url + "/", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page()
            page.goto(url + "/ui/")
            page.wait_for_selector("body[data-ready]")
            sizes = page.evaluate("""() => [...performance.getEntriesByType('navigation'),
                ...performance.getEntriesByType('resource')].filter(e => e.name.includes('/ui/'))
                .map(e => ({name: e.name.split('/').pop() || 'index.html', transfer: e.transferSize,
                            body: e.encodedBodySize, decoded: e.decodedBodySize}))""")
            print("first load of the page's files:")
            for s in sizes:
                print(f"  {s['name']:<12} {s['body']:>7,} B gzip ({s['decoded']:>7,} B)  "
                      f"{s['transfer']:>7,} B transferred")
            gz, raw, sent = (sum(s[k] for s in sizes) for k in ("body", "decoded", "transfer"))
            print(f"  total        {gz:>7,} B gzip ({raw:>7,} B)  {sent:>7,} B transferred")

            page.select_option("#model", args.model)
            page.click("#settings summary")
            page.fill("#temperature", "0")
            page.fill("#seed", "1")
            bodies: list[str] = []
            page.on("request", lambda r: r.url.endswith("/api/chat") and bodies.append(r.post_data or ""))
            # warm: the model loaded, the prompt cached alike for both
            page.fill("#prompt", "Hi")
            page.press("#prompt", "Enter")
            page.wait_for_selector(".msg.assistant:not(.live)", timeout=120_000)
            results: dict[str, list[tuple[float, float, int]]] = {"page": [], "curl": []}
            for r in range(args.rounds):
                page.click("#new-chat")  # a new chat starts with empty settings
                page.fill("#temperature", "0")
                page.fill("#seed", "1")
                n = len(bodies)
                page.fill("#prompt", args.prompt)
                t0 = time.perf_counter()
                page.press("#prompt", "Enter")
                page.wait_for_function("() => document.querySelectorAll('.msg.assistant:not(.live)').length >= 1",
                                       timeout=300_000)
                wall = time.perf_counter() - t0
                stats = _last_stats(url)
                results["page"].append((stats["tokens_per_second"], wall, stats["eval_count"]))
                body = bodies[n]
                t0 = time.perf_counter()
                out = subprocess.run(["curl", "-sN", url + "/api/chat", "-d", body], capture_output=True, check=True)
                wall = time.perf_counter() - t0
                done = json.loads(out.stdout.decode().strip().splitlines()[-1])
                results["curl"].append((done["eval_count"] / done["eval_duration"] * 1e9, wall, done["eval_count"]))
                print(f"round {r + 1}: page {results['page'][-1][0]:.1f} tok/s ({results['page'][-1][2]} tokens, "
                      f"{results['page'][-1][1]:.2f} s), curl {results['curl'][-1][0]:.1f} tok/s "
                      f"({results['curl'][-1][2]} tokens, {results['curl'][-1][1]:.2f} s)")
            browser.close()
        p_tps = statistics.median(x[0] for x in results["page"])
        c_tps = statistics.median(x[0] for x in results["curl"])
        print(f"median decode: page {p_tps:.1f} tok/s, curl {c_tps:.1f} tok/s, page/curl {p_tps / c_tps:.3f}")
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def _last_stats(url: str) -> dict[str, Any]:
    chats = httpx.get(url + "/api/chats").json()["chats"]
    conv = httpx.get(f"{url}/api/chats/{chats[0]['id']}").json()
    return [m for m in conv["messages"] if m["role"] == "assistant"][-1]["stats"]


if __name__ == "__main__":
    os.environ.setdefault("LOCALLLM_KEEP_ALIVE", "10m")
    main()
