"""``localllm launch AGENT``: a coding agent on a local model, as ``ollama launch`` does.

    $ localllm launch claude                      # Claude Code on the best installed model with tools
    $ localllm launch codex --model qwen3:8b      # Codex CLI
    $ localllm launch opencode --model qwen3:8b -- run "fix the tests"   # arguments after -- go to the agent
    $ localllm launch codex --config              # print the configuration instead (to set it up by hand)

It checks the agent is installed (one sentence with the install command if not), finds the server
(``LOCALLLM_HOST``) or starts ``localllm serve`` in the background, pulls the model if it is missing, and runs
the agent with its configuration passed for this run only: environment variables (Claude Code), ``-c`` options
(Codex), ``OPENCODE_CONFIG_CONTENT`` (OpenCode), so the user's own configuration files are never written.
The context the model needs is the server's business: a prompt that does not fit reloads the model with a
larger one (up to its trained context and what memory holds).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import click

from localllm.errors import LocalLLMError


@dataclass(frozen=True)
class Agent:
    name: str  # as typed after `launch`
    label: str
    exe: str
    install: str  # the command that installs it


AGENTS = {
    "claude": Agent("claude", "Claude Code", "claude", "npm install -g @anthropic-ai/claude-code"),
    "codex": Agent("codex", "Codex CLI", "codex", "npm install -g @openai/codex"),
    "opencode": Agent("opencode", "OpenCode", "opencode", "npm install -g opencode-ai"),
}
# Claude Code with no traffic but the model's: no telemetry, error reports or update checks
CLAUDE_QUIET = {"DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
NO_KEY = "localllm"  # what the agents send as a key when the server needs none (they all want one)


@dataclass
class Setup:
    """How to run an agent against ``url`` with ``model``: its environment and arguments."""

    env: dict[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)


def setup(agent: str, url: str, model: str, api_key: str | None = None) -> Setup:
    """The agent's configuration for this run (pure).

    >>> setup("codex", "http://127.0.0.1:11434", "qwen3:8b").args[:2]
    ['-c', 'model_provider="localllm"']
    >>> setup("claude", "http://127.0.0.1:11434", "qwen3:8b").env["ANTHROPIC_BASE_URL"]
    'http://127.0.0.1:11434'
    """
    key = api_key or NO_KEY
    if agent == "claude":
        env = {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_AUTH_TOKEN": key, "ANTHROPIC_MODEL": model,
               "ANTHROPIC_DEFAULT_OPUS_MODEL": model, "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
               "ANTHROPIC_DEFAULT_HAIKU_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model,
               "CLAUDE_CODE_SUBAGENT_MODEL": model, **CLAUDE_QUIET}
        return Setup(env, ["--model", model])
    if agent == "codex":
        provider = (f'{{name="localllm",base_url="{url}/v1",wire_api="responses",env_key="LOCALLLM_API_KEY"}}'
                    if api_key else f'{{name="localllm",base_url="{url}/v1",wire_api="responses"}}')
        return Setup({"LOCALLLM_API_KEY": api_key} if api_key else {},
                     ["-c", 'model_provider="localllm"', "-c", f"model_providers.localllm={provider}", "-m", model])
    if agent == "opencode":
        config = {"$schema": "https://opencode.ai/config.json", "model": f"localllm/{model}",
                  "small_model": f"localllm/{model}",
                  "provider": {"localllm": {"npm": "@ai-sdk/openai-compatible", "name": "localllm",
                                            "options": {"baseURL": f"{url}/v1", "apiKey": key},
                                            "models": {model: {"name": model}}}}}
        return Setup({"OPENCODE_CONFIG_CONTENT": json.dumps(config)}, [])
    raise LocalLLMError(f"Unknown agent {agent!r}; launch one of {', '.join(AGENTS)}.")


def _ensure_server(host: str | None) -> tuple[str, str]:
    """(the server's URL, what was done): the one answering at ``--host`` / ``LOCALLLM_HOST``, else, on this
    machine, a ``localllm serve`` started in the background (its log in localllm's cache directory)."""
    from urllib.parse import urlsplit

    from localllm import config
    from localllm.client import Client

    client = Client(host)
    try:
        if client.is_running(timeout=1.0):
            return client.url, "found"
        where = urlsplit(client.url)
        if where.hostname not in ("127.0.0.1", "localhost", "::1"):
            raise LocalLLMError(f"No server is answering at {client.url}; start one there with `localllm serve`.")
        log = config.paths().cache / "serve.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "LOCALLLM_HOST": where.netloc}
        with open(log, "ab") as out:
            subprocess.Popen([sys.executable, "-m", "localllm", "serve"], stdout=out, stderr=out,
                             stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if client.is_running(timeout=1.0):
                return client.url, f"started (log: {log})"
            time.sleep(0.3)
        raise LocalLLMError(f"`localllm serve` did not answer at {client.url} within a minute; see {log}.")
    finally:
        client.close()


# on a CPU (or a GPU that takes only part of it) the model suggested is the one nearest this size: big enough to call
# tools sensibly, small enough to answer an agent's long prompts in reasonable time
CPU_TARGET = 5 * 10**9


def tool_models(models: Any) -> list[tuple[str, int]]:
    """(name, size) of each installed model (a :class:`~localllm.api.Models`: the server's or the local store) whose
    chat template takes tools (the server refuses tools to the others)."""
    out = []
    for m in models.list():
        try:
            caps = models.show(m.name).capabilities
        except LocalLLMError:
            continue
        if "tools" in caps:
            out.append((m.name, int(m.size or 0)))
    return out


def _rank(item: Any) -> tuple[int, float]:
    on_gpu = item.fit.verdict == "gpu"
    return (0 if on_gpu else 1, -item.size if on_gpu else abs(item.size - CPU_TARGET))


def choose_model(installed: list[tuple[str, int]], catalog: list[Any], agent: str) -> str:
    """The model ``launch`` runs when none is named: the largest installed model that can use tools and that the
    catalog does not judge too big for this machine; else one sentence (a :class:`LocalLLMError`) naming the two
    catalog models with tools that fit best (on a GPU: the largest; else those nearest 5 GB) and the commands to
    get one. ``catalog`` holds :class:`~localllm.api.CatalogItem` with this machine's verdicts.

    >>> from localllm.api import CatalogItem, Fit
    >>> cat = [CatalogItem("qwen3:8b", 5_000_000_000, capabilities=["tools"], fit=Fit(verdict="cpu")),
    ...        CatalogItem("big:70b", 40_000_000_000, capabilities=["tools"], fit=Fit(verdict="too_big")),
    ...        CatalogItem("llama3.2:3b", 2_000_000_000, capabilities=["tools"], fit=Fit(verdict="cpu"))]
    >>> choose_model([("qwen2.5-coder:0.5b", 491400064), ("big:70b", 4 * 10**10)], cat, "codex")
    'qwen2.5-coder:0.5b'
    >>> choose_model([], cat, "codex")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    localllm.errors.LocalLLMError: No installed model can use tools, which Codex CLI needs; two that fit this ...
    """
    from localllm.download import fmt_bytes

    too_big = {c.name for c in catalog if c.fit.verdict == "too_big"}
    fits = [(size, name) for name, size in installed if name not in too_big]
    if fits:
        return max(fits)[1]
    label = AGENTS[agent].label if agent in AGENTS else agent
    options = sorted((c for c in catalog if "tools" in c.capabilities and c.split_parts == 1
                      and c.fit.verdict in ("gpu", "partial", "cpu")), key=_rank)[:2]
    if not options:
        raise LocalLLMError(f"No installed model can use tools, which {label} needs, and no model of the catalog "
                            "with tools fits this machine; name one with --model.")
    named = " and ".join(f"{c.name} ({fmt_bytes(c.size)})" for c in options)
    first = options[0].name
    some = "two that fit" if len(options) > 1 else "one that fits"
    raise LocalLLMError(f"No installed model can use tools, which {label} needs; {some} this machine: {named}. "
                        f"Get one with `localllm pull {first}`, then run `localllm launch {agent} --model {first}`.")


def _pick(models: Any, agent: str) -> str:
    """The model for ``agent`` on the installed ``models`` (the catalog's verdicts are this machine's)."""
    from localllm.engine import Engine
    from localllm.local import LocalAdvisor

    return choose_model(tool_models(models), LocalAdvisor(Engine()).catalog(), agent)


def _check_tools(models: Any, name: str, agent: str) -> None:
    """A named model that is installed but cannot use tools: one sentence now, not a refusal inside the agent."""
    from localllm.errors import ModelNotFoundError

    try:
        caps = models.show(name).capabilities
    except ModelNotFoundError:
        return  # pulled next; the catalog knows its capabilities only roughly
    if "tools" not in caps:
        raise LocalLLMError(f"{name} cannot use tools (its chat template has none), which {AGENTS[agent].label} "
                            f"needs; run `localllm launch {agent}` without --model to pick one that can.")


def _ensure_model(url: str, model: str) -> str:
    """The model installed on the server (pulled if missing): '' or what was done."""
    from localllm.client import Client
    from localllm.errors import ModelNotFoundError

    with Client(url) as client:
        try:
            client.show(model)
            return ""
        except ModelNotFoundError:
            client.pull(model)
            return f"pulled {model}"


@click.command("launch", context_settings={"ignore_unknown_options": True})
@click.argument("agent", type=click.Choice(list(AGENTS)))
@click.argument("agent_args", nargs=-1, type=click.UNPROCESSED)
@click.option("--model", "-m", default=None, metavar="MODEL",
              help="Model the agent uses (default: the largest installed model that can use tools and fits).")
@click.option("--host", default=None, metavar="URL",
              help="Server (default: LOCALLLM_HOST or 127.0.0.1:11434; started there if none answers).")
@click.option("--config", "show_config", is_flag=True,
              help="Print the agent's configuration (environment and arguments) instead of running it.")
def command(agent: str, agent_args: tuple[str, ...], model: str | None, host: str | None, show_config: bool) -> None:
    """Run a coding agent (claude, codex, opencode) on a local model.

    \b
    Examples:
      localllm launch claude
      localllm launch codex --model qwen3:8b
      localllm launch opencode --config
    """
    from localllm.client import base_url
    from localllm.names import parse_name

    a = AGENTS[agent]
    api_key = os.environ.get("LOCALLLM_API_KEY") or None
    name = parse_name(model, allow_path=False).name if model else None
    if show_config:
        if name is None:  # the local store's choice (the server may not run yet)
            from localllm.engine import Engine
            from localllm.local import LocalModels

            name = _pick(LocalModels(Engine().store), agent)
        s = setup(agent, base_url(host), name, api_key)
        for k, v in s.env.items():
            click.echo(f"export {k}={shlex.quote(v)}")
        click.echo(shlex.join([a.exe, *s.args, *agent_args]))
        return
    exe = shutil.which(a.exe)
    if exe is None:
        raise LocalLLMError(f"{a.label} is not installed (no `{a.exe}` on PATH); install it with: {a.install}")
    url, server = _ensure_server(host)
    from localllm.client import Client

    with Client(url, api_key=api_key) as client:
        if name is None:
            name = _pick(client, agent)
        else:
            _check_tools(client, name, agent)
    pulled = _ensure_model(url, name)
    s = setup(agent, url, name, api_key)
    click.echo(f"localllm: server {url} {server}{f', {pulled}' if pulled else ''}; {a.label} on {name} "
               f"(configuration for this run only: `localllm launch {agent} --config` shows it).", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    # PWD as well: OpenCode takes its working directory from it, and a parent that is not a shell leaves it stale
    os.execvpe(exe, [exe, *s.args, *agent_args], {**os.environ, "PWD": os.getcwd(), **s.env})
