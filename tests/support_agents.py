"""What the coding-agent tests need: a made model whose context fits an agent's prompt, a token source that says
what a test scripts on the real llama.cpp backend, and the agents themselves (npm packages in the test cache).

* :func:`long_context_model`: a random-weight ``llama`` GGUF (2 layers, 64 wide, ~7 MB) with the default model's
  tokenizer, Qwen2.5's tool-rendering chat template and a 32,768-token trained context, made with the ``gguf``
  package (``../shared/reference/models-2026.md``). Its answers are noise: tests script them.
* :func:`scripted_backend`: llama.cpp for real (template, tokenizer, prompt evaluation, KV reuse) with the
  sampler replaced by a script: ``decide(rendered prompt) -> text`` is played back token by token, then the end
  of turn. A ``<tool_call>{...}</tool_call>`` reply is a tool call the agent runs.
* :func:`agent_bin`: ``codex`` / ``claude`` / ``opencode`` installed once from npm into the test cache (a
  skip where ``node`` is missing, a failure under strict mode: node is software, ``.ci/run`` installs it);
  :data:`CLAUDE_QUIET` and :func:`agent_env`: the environment that keeps them quiet and their downloads cached.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support import QWEN25_TEMPLATE, TEST_CACHE, file_key

LONG_CTX = 32768
AGENTS = {"codex": ("@openai/codex@0.171.0", "codex"), "claude": ("@anthropic-ai/claude-code@2.1.332", "claude"),
          "opencode": ("opencode-ai@1.18.33", "opencode")}
# Claude Code without telemetry, error reports, update checks or any other traffic but the model's
CLAUDE_QUIET = {"DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_NON_ESSENTIAL_MODEL_CALLS": "1"}


def long_context_model(default_model_path: Path, n_ctx_train: int = LONG_CTX) -> Path:
    """The made model (cached in the test cache by the default model's identity and ``n_ctx_train``)."""
    import gguf
    import numpy as np

    dst = TEST_CACHE / "derived" / f"agent-llama-{file_key(default_model_path)}-{n_ctx_train}.gguf"
    if dst.is_file():
        return dst
    reader = gguf.GGUFReader(default_model_path, "r")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(tmp, arch="llama")
    d, ff, heads, layers = 64, 128, 4, 2
    w.add_name("agent-llama")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(d)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(d // heads)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    n_vocab = 0
    for f in reader.fields.values():  # the default model's tokenizer, exact types; our chat template
        if not f.name.startswith("tokenizer.") or f.name.startswith(gguf.Keys.Tokenizer.CHAT_TEMPLATE):
            continue
        val_type = f.types[0]
        sub_type = f.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), val_type, sub_type=sub_type)
        if f.name == gguf.Keys.Tokenizer.LIST:
            n_vocab = len(f.contents())
    w.add_chat_template(QWEN25_TEMPLATE)
    rng = np.random.default_rng(35)

    def mat(rows: int, cols: int) -> Any:  # numpy (rows, cols) = ggml {cols, rows}
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float16)

    w.add_tensor("token_embd.weight", mat(n_vocab, d))
    w.add_tensor("output_norm.weight", np.ones(d, dtype=np.float32))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(d, dtype=np.float32))
        for t in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.{i}.{t}.weight", mat(d, d))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(d, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", mat(ff, d))
        w.add_tensor(f"blk.{i}.ffn_up.weight", mat(ff, d))
        w.add_tensor(f"blk.{i}.ffn_down.weight", mat(d, ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, dst)
    return dst


def tool_call(name: str, arguments: dict[str, Any]) -> str:
    """A reply that is one tool call, as Qwen2.5's template has the model write it."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


class Script:
    """What the scripted model says: ``decide(prompt)`` per request, and every prompt it was asked (rendered)."""

    def __init__(self, decide: Callable[[str], str]):
        self.decide = decide
        self.prompts: list[str] = []


def scripted_backend(script: Script) -> Callable[[str], Any]:
    """An :class:`~localllm.engine.Engine` ``backend_class``: llama.cpp with the answers ``script`` decides."""
    from backends.llamacpp.source import LlamaCppSource

    class Scripted(LlamaCppSource):
        def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                   add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> str:
            text = super().render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                  template_kwargs=template_kwargs)
            if add_generation_prompt:  # not a system prompt's own render (where a cached prefix ends)
                script.prompts.append(text)
            return text

        def sampler(self, sampling: Any, fmt: Any) -> Any:
            return _Playback(self, self.tokenize(script.decide(script.prompts[-1])))

    return lambda name: Scripted


class _Playback:
    """A sampler that plays tokens back, then the end of the turn."""

    def __init__(self, src: Any, tokens: list[int]):
        import llama_cpp

        self.tokens = list(tokens) + [llama_cpp.llama_vocab_eot(src._vocab)]
        if self.tokens[-1] < 0:
            self.tokens[-1] = llama_cpp.llama_vocab_eos(src._vocab)

    def sample(self, row: int) -> int:
        return self.tokens.pop(0) if len(self.tokens) > 1 else self.tokens[0]

    def sample_logits(self, logits: Any) -> int:
        return self.sample(0)

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------------ the agents


def agent_env(agent: str) -> dict[str, str]:
    """What an agent needs in its environment for a test beyond its configuration: OpenCode installs npm packages
    (its plugins, the AI SDK provider) at run time; their npm cache stays in the test cache, so only the first
    run downloads them."""
    return {"npm_config_cache": str(TEST_CACHE / "npm" / "cache")} if agent == "opencode" else {}


def agent_bin(agent: str) -> Path:
    """The agent's executable, installed from npm into the test cache once (skips without node and npm: software,
    not hardware, so strict mode fails the skip; ``.ci/run`` installs them)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip(f"node and npm not found (Debian: apt-get install nodejs npm); the {agent} agent test needs them")
    package, exe = AGENTS[agent]
    prefix = TEST_CACHE / "npm" / package.rsplit("@", 1)[0].replace("/", "+") / package.rsplit("@", 1)[1]
    binary = prefix / "node_modules" / ".bin" / exe
    if not binary.exists():
        prefix.mkdir(parents=True, exist_ok=True)
        subprocess.run(["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--loglevel=error",
                        package], check=True, capture_output=True, timeout=600)
    return binary
