"""The web page (issue 49): bytes of a first load (gzip), and decode speed with the page streaming vs the same
request by ``curl``.

    LOCALLLM_HOME=~/.cache/localllm-tests/home python benchmarks/webui.py [--rounds 3] [--prompt TEXT]
        [--first-token] [--long 2000]

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
COUNT = "Write a long story about a lighthouse keeper."  # 590 tokens at temperature 0: no ignore_eos in the API
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]

# What the page's stream and its screen do, timed inside the page (an init script, so it is in place before the
# page's own code): every line of /api/chat as it reaches the page's reader (a pass-through stream between fetch and
# the page), the answer's text in the DOM at each change (a MutationObserver), and the main thread's long tasks.
# Text is compared by its letters and digits only (what Markdown rendering keeps), so a prompt whose answer has no
# code block or link is needed (counting).
PROBE = r"""(() => {
  const alnum = (s) => (s.match(/[A-Za-z0-9]/g) || []).length;
  const P = window.__probe = { request: null, lines: [], dom: [], longtasks: [] };
  const fetch0 = window.fetch;
  window.fetch = async (input, init) => {
    const url = typeof input === "string" ? input : input.url;
    if (!url.endsWith("/api/chat")) return fetch0(input, init);
    if (window.__numPredict && init && init.body) {  // the page has no num_predict field: set here
      const b = JSON.parse(init.body); b.options = { ...b.options, num_predict: window.__numPredict };
      init = { ...init, body: JSON.stringify(b) };
    }
    P.request = performance.now(); P.lines = []; P.dom = []; P.content = "";
    const r = await fetch0(input, init);
    if (!r.body) return r;
    const dec = new TextDecoder();
    let buf = "", text = 0;
    const tap = new TransformStream({ transform(chunk, ctl) {
      const t = performance.now();
      buf += dec.decode(chunk, { stream: true });
      let i;
      while ((i = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, i).trim(); buf = buf.slice(i + 1);
        if (!line) continue;
        const o = JSON.parse(line);
        P.content += (o.message && o.message.content) || "";
        text = alnum(P.content);
        P.lines.push({ t, text, done: !!o.done });
      }
      ctl.enqueue(chunk);
    } });
    return new Response(r.body.pipeThrough(tap), { status: r.status, statusText: r.statusText, headers: r.headers });
  };
  const watch = () => {
    const box = document.querySelector("#messages");
    if (!box) return setTimeout(watch, 10);
    new MutationObserver(() => {
      if (P.request === null) return;
      const all = box.querySelectorAll(".msg.assistant .content");
      const last = all[all.length - 1];
      const n = last ? alnum(last.textContent) : 0;
      const prev = P.dom.length ? P.dom[P.dom.length - 1].text : -1;
      if (n !== prev) P.dom.push({ t: performance.now(), text: n });
      if (last) P.shown = last.textContent;
    }).observe(box, { childList: true, subtree: true, characterData: true });
  };
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", watch); else watch();
  try {
    new PerformanceObserver((l) => {
      for (const e of l.getEntries()) P.longtasks.push({ t: e.startTime, ms: e.duration });
    }).observe({ type: "longtask", buffered: true });
  } catch { /* no longtask entries in this browser */ }
})();"""


def lags(probe: dict[str, Any]) -> dict[str, float]:
    """From ``window.__probe`` after an answer: ms from the request to the first text line (API) and to the first
    text in the DOM, the worst lag of the DOM behind the stream (each line's text: arrival -> first DOM state that
    holds it), the lag at the end (the whole answer on screen - the stream's last line), long tasks during it."""
    req, lines, dom = probe["request"], probe["lines"], probe["dom"]
    first_api = next(x["t"] for x in lines if x["text"] > 0)
    first_dom = next(x["t"] for x in dom if x["text"] > 0)
    # Markdown may drop a few letters or digits of the source (an ordered list's "1."): what the final DOM lacks of
    # the stream's text is allowed at every point (reported as ``dropped``)
    dropped = max(0, lines[-1]["text"] - dom[-1]["text"]) if dom else 0
    worst, j, shown_end = 0.0, 0, None
    for x in lines:
        if x["text"] == 0:
            continue
        while j < len(dom) and dom[j]["text"] < x["text"] - dropped:
            j += 1
        if j == len(dom):
            raise AssertionError(f"text of the stream never on screen: {x['text']} letters, "
                                 f"the DOM has {dom[-1]['text'] if dom else 0}: {probe['content']!r} "
                                 f"shown as {probe.get('shown')!r}")
        worst = max(worst, dom[j]["t"] - x["t"])  # >= 0: the DOM follows the stream
        shown_end = dom[j]["t"]
    end = lines[-1]["t"]
    tasks = [t for t in probe["longtasks"] if t["t"] >= req]
    return {"first_api_ms": first_api - req, "first_dom_ms": first_dom - req, "first_gap_ms": first_dom - first_api,
            "worst_lag_ms": worst, "end_lag_ms": max(0.0, (shown_end or end) - end), "stream_ms": end - req,
            "lines": len(lines), "dropped": dropped, "longtasks": len(tasks),
            "longtask_ms": sum(t["ms"] for t in tasks),
            "longest_task_ms": max((t["ms"] for t in tasks), default=0.0)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default="smollm2:135m")
    ap.add_argument("--prompt", default="Count from 1 to 200, one number per line.")
    ap.add_argument("--first-token", action="store_true", help="first answer text on screen vs the API's")
    ap.add_argument("--long", type=int, default=0, metavar="N", help="an N-token answer: the screen's lag")
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
            page.add_init_script(PROBE)
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
            page.on("request", lambda r: bodies.append(r.post_data or "") if r.url.endswith("/api/chat") else None)
            # warm: the model loaded, the prompt cached alike for both
            page.fill("#prompt", "Hi")
            page.press("#prompt", "Enter")
            page.wait_for_selector(".msg.assistant:not(.live)", timeout=120_000)
            if args.first_token or args.long:
                _fast(page, url, args)
                browser.close()
                return
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


def _answer(page: Any, prompt: str, num_predict: int) -> dict[str, Any]:
    """One answer in a new chat (temperature 0, seed 1, ``num_predict``): ``window.__probe`` once it is saved."""
    page.click("#new-chat")
    page.fill("#temperature", "0")
    page.fill("#seed", "1")
    page.evaluate(f"window.__numPredict = {num_predict}")
    page.fill("#prompt", prompt)
    page.press("#prompt", "Enter")
    page.wait_for_function("() => document.querySelectorAll('.msg.assistant:not(.live)').length >= 1",
                           timeout=600_000)
    return dict(page.evaluate("window.__probe"))


def _fast(page: Any, url: str, args: argparse.Namespace) -> None:
    if args.first_token:
        gaps = []
        for r in range(args.rounds):
            x = lags(_answer(page, args.prompt, 16))
            gaps.append(x["first_gap_ms"])
            print(f"round {r + 1}: first text line at the page {x['first_api_ms']:.1f} ms after the request, "
                  f"in the DOM {x['first_dom_ms']:.1f} ms: {x['first_gap_ms']:.1f} ms later")
        print(f"median: first token in the DOM {statistics.median(gaps):.1f} ms after the API's first line "
              f"(max {max(gaps):.1f})")
    if args.long:
        rows = []
        for r in range(args.rounds):
            x = lags(_answer(page, COUNT, args.long))
            stats = _last_stats(url)
            rows.append(x)
            print(f"round {r + 1}: {stats['eval_count']} tokens in {x['lines']} lines over "
                  f"{x['stream_ms'] / 1e3:.1f} s "
                  f"({stats['tokens_per_second']:.1f} tok/s): worst lag {x['worst_lag_ms']:.0f} ms, at the end "
                  f"{x['end_lag_ms']:.0f} ms; {x['longtasks']} long tasks, {x['longtask_ms']:.0f} ms in all, "
                  f"longest {x['longest_task_ms']:.0f} ms")
        med = {k: statistics.median(x[k] for x in rows) for k in ("worst_lag_ms", "end_lag_ms", "longtasks",
                                                                  "longtask_ms", "longest_task_ms")}
        print(f"median of {args.rounds}: worst lag {med['worst_lag_ms']:.0f} ms, at the end "
              f"{med['end_lag_ms']:.0f} ms, {med['longtasks']:.0f} long tasks ({med['longtask_ms']:.0f} ms, "
              f"longest {med['longest_task_ms']:.0f} ms)")


def _last_stats(url: str) -> dict[str, Any]:
    chats = httpx.get(url + "/api/chats").json()["chats"]
    conv = httpx.get(f"{url}/api/chats/{chats[0]['id']}").json()
    return [m for m in conv["messages"] if m["role"] == "assistant"][-1]["stats"]


if __name__ == "__main__":
    os.environ.setdefault("LOCALLLM_KEEP_ALIVE", "10m")
    main()
