"""``localllm run MODEL [PROMPT...]``: like ``ollama run``.

One-shot when a prompt is given or stdin is piped (stdin first, then the prompt words, joined by a
space, as Ollama does); otherwise the interactive ``>>>`` prompt (:mod:`localllm.cli.interactive`).
A missing model is pulled first, with the same progress display as ``localllm pull``.

    $ localllm run smollm2:135m "Why is the sky blue?"
    $ echo "Some text" | localllm run smollm2:135m "Summarise:" --verbose
    $ localllm run ./model.gguf --draft ngram --kv-cache q8_0
    $ localllm run qwen3:0.6b --think=low "How many r in strawberry?"
    $ localllm run gemma3:4b "What is in ./photo.jpg?"     # a vision model: the file is attached
    $ localllm run ./llava.gguf --image a.png --image b.png "Compare them."
    $ localllm run qwen2.5:0.5b --mcp time "What time is it in Tokyo?"

Output: the answer streams to stdout as it arrives; when stdout is not a terminal it is just the
text. A thinking model's reasoning comes first, between ``Thinking...`` and ``...done thinking.``
(grey on a terminal; ``--hidethinking`` leaves it out, ``--think=false`` asks the model not to think).
``--verbose`` prints Ollama's stats block to stderr, plus the thinking, prompt-cache, draft and image lines.

Images (a model with a vision projector): an existing image file named in the prompt (``./photo.jpg``,
``~/a.png``; .png .jpg .jpeg .webp .gif .bmp) is attached and taken out of the text, as ``ollama run`` does
("Added image '...'" on stderr); ``--image PATH`` attaches one explicitly (repeatable). In the REPL, a path in
the message or ``/image PATH`` (attached to the next message).

Audio (a model with an audio projector: Ultravox, Qwen2-Audio, Voxtral, Gemma 3n/4, ...): a WAV, MP3 or FLAC file
named in the prompt (``"Transcribe ./memo.wav"``) is attached the same way ("Added audio '...' (1.5 s)"), or with
``--audio PATH`` (repeatable); ``localllm transcribe MODEL FILE`` prints a transcript.
What the REPL and ``bench`` share with this command lives in :mod:`localllm.cli.answer`.

``--mcp NAME`` (repeatable) gives the model the tools of that server of ``mcp.json`` (in the config dir; without
``--mcp`` the interactive prompt uses the servers marked ``"default": true``, ``--mcp none`` none); each tool's
first call asks on the terminal. ``--tool-choice required`` makes the first answer of each turn a tool call (a
grammar, as ``tool_choice`` does on the server).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from typing import IO, TYPE_CHECKING

import click

from localllm.api import Runner
from localllm.cli.answer import (
    RunSettings,
    build_settings,
    drafting_line,
    ensure_model,
    loaded_plan,
    overflow_note,
    placement_lines,
    print_stats,
    stream_answer,
    user_message,
)
from localllm.cli.display import isatty
from localllm.errors import LocalLLMError

if TYPE_CHECKING:
    from localllm.mcp.loop import ToolChat
    from localllm.session import Session


class RunCommand(click.Command):
    """``--think`` alone means ``--think=true`` and takes no value from the next word (as Ollama's flag), so
    ``localllm run MODEL --think "Why?"`` keeps ``Why?`` as the prompt."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        end = args.index("--") if "--" in args else len(args)
        args = ["--think=true" if i < end and a == "--think" else a for i, a in enumerate(args)]
        return super().parse_args(ctx, args)


# ------------------------------------------------------------------------------------------ command


@click.command("run", cls=RunCommand, context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model")
@click.argument("prompt", nargs=-1)
@click.option("--temperature", type=float, default=None, help="Sampling temperature (0 = greedy).")
@click.option("--seed", type=int, default=None, help="Random seed: the same seed gives the same answer.")
@click.option("--num-predict", type=int, default=None, help="Most tokens to generate (-1 = no limit).")
@click.option("--num-ctx", type=int, default=None, help="Context size in tokens (default: the planner's).")
@click.option("--system", default=None, help="System prompt.")
@click.option("--format", "fmt", default=None, metavar="json", help="Response format: json.")
@click.option("--draft", default=None, metavar="NAME|PATH|ngram|mtp|none",
              help="Speculative decoding: a draft model, prompt-lookup (ngram), the GGUF's own multi-token-"
                   "prediction layers (mtp: the default where it has them, llama.cpp), or none.")
@click.option("--num-draft", type=int, default=None, help="Most tokens the draft proposes per step (default 4).")
@click.option("--kv-cache", default=None, metavar="f16|q8_0|q4_0",
              help="KV cache type (default: LOCALLLM_KV_CACHE_TYPE).")
@click.option("--backend", default="auto", metavar="auto|llamacpp|mlx", help="Inference backend.")
@click.option("--think", default=None, metavar="[=LEVEL]",
              help="Thinking models: --think (on), --think=false (off), --think=low|medium|high (the level).")
@click.option("--hidethinking", is_flag=True, help="Do not print a thinking model's reasoning.")
@click.option("--image", "images", multiple=True, metavar="PATH",
              help="Attach an image file to the prompt (repeatable; a vision model). A path in the prompt works too.")
@click.option("--audio", "audio", multiple=True, metavar="PATH",
              help="Attach a WAV, MP3 or FLAC file (repeatable; a model with an audio projector). A path in the "
                   "prompt works too.")
@click.option("--gpu-layers", type=int, default=None, metavar="N",
              help="Layers to offload to the GPU/devices (0 = CPU only, -1 = the planner's choice).")
@click.option("--device", "devices", multiple=True, metavar="NAME",
              help="Offload only to this llama.cpp device (repeatable; names as `localllm probe` lists them).")
@click.option("--tensor-split", default=None, metavar="A,B,...",
              help="Shares of the layers per device, in `localllm probe`'s order (default: by free memory).")
@click.option("--rpc", default=None, metavar="HOST:PORT,...",
              help="Add llama.cpp RPC workers (`localllm worker`) as devices (default: LOCALLLM_RPC).")
@click.option("--cpu-moe", is_flag=True, default=False,
              help="A mixture of experts: keep every expert tensor in RAM (default: as few as the device needs).")
@click.option("--num-cpu-moe", type=click.IntRange(min=0), default=None, metavar="N",
              help="A mixture of experts: keep the experts of the first N layers in RAM (llama.cpp's --n-cpu-moe).")
@click.option("--verbose", is_flag=True, help="Print timings and token counts after each answer.")
@click.option("--host", default=None, metavar="URL",
              help="Talk to a localllm or Ollama server there instead of in-process.")
@click.option("--keepalive", default=None, metavar="DURATION",
              help="How long the model stays loaded after an answer (e.g. 5m).")
@click.option("--mcp", "mcp_servers", multiple=True, metavar="NAME",
              help="Give the model the tools of this MCP server of mcp.json (repeatable; 'none': no server; "
                   "default at the >>> prompt: the servers marked \"default\": true).")
@click.option("--tool-choice", type=click.Choice(["auto", "required"]), default="auto",
              help="required: the first answer of each turn must call a tool (needs --mcp).")
def command(model: str, prompt: tuple[str, ...], temperature: float | None, seed: int | None,
            num_predict: int | None, num_ctx: int | None, system: str | None, fmt: str | None,
            draft: str | None, num_draft: int | None, kv_cache: str | None, backend: str, think: str | None,
            hidethinking: bool, images: tuple[str, ...], audio: tuple[str, ...], gpu_layers: int | None,
            devices: tuple[str, ...],
            tensor_split: str | None, rpc: str | None, cpu_moe: bool, num_cpu_moe: int | None, verbose: bool,
            host: str | None,
            keepalive: str | None, mcp_servers: tuple[str, ...], tool_choice: str) -> None:
    """Run MODEL: answer PROMPT (or piped stdin) once, else chat interactively.

    \b
    Examples:
      localllm run smollm2:135m "Why is the sky blue?"
      cat notes.txt | localllm run smollm2:135m "Summarise this:"
      localllm run ./model.gguf --draft ngram --verbose
      localllm run ./llava.gguf "What is in ./photo.jpg?"
      localllm run ./llava.gguf --image photo.png "Describe it."
      localllm run ./ultravox.gguf "Transcribe ./memo.wav"
      localllm run ./ultravox.gguf --audio memo.mp3 "Summarise it."
      localllm run qwen2.5:0.5b --mcp time --mcp files
      localllm run smollm2:135m --rpc 127.0.0.1:50052,127.0.0.1:50053 "Hi"
    """
    settings = build_settings(
        temperature=temperature, seed=seed, num_predict=num_predict, num_ctx=num_ctx, system=system,
        fmt=fmt, draft=draft, num_draft=num_draft, kv_cache=kv_cache, backend=backend, verbose=verbose,
        keepalive=keepalive, think=think, hide_thinking=hidethinking, gpu_layers=gpu_layers, devices=devices,
        tensor_split=tensor_split, cpu_moe=cpu_moe, num_cpu_moe=num_cpu_moe,
    )
    prompts = list(prompt)
    piped = not isatty(sys.stdin)
    if piped:
        data = sys.stdin.read()
        if data:
            prompts.insert(0, data)
    # Ollama: interactive only with nothing to answer and a terminal on both ends
    interactive = not prompts and not piped and isatty(sys.stdout) and not images and not audio
    from localllm.audio import read_audio
    from localllm.images import read_image

    attached = [read_image(p) for p in images]  # a file that cannot be read: one sentence before any load
    attached += [read_audio(p) for p in audio]  # clips ride with the images, as in Ollama's API

    from localllm.cli.display import ConversionDisplay
    from localllm.session import open_session

    tools = open_tools(mcp_servers, defaults=interactive)
    if tool_choice == "required" and (tools is None or not tools.servers):
        raise click.UsageError("--tool-choice required needs an MCP server (--mcp NAME).")
    session = open_session(host, keep_alive=settings.keep_alive, on_convert=ConversionDisplay())
    if session.remote and (rpc or devices or gpu_layers is not None or tensor_split or cpu_moe
                           or num_cpu_moe is not None):
        sys.stderr.write("Note: --rpc, --device and --gpu-layers apply where the model loads: the server this "
                         "attaches to (start it with `localllm serve --rpc ...`).\n")
    if session.remote and draft not in (None, "auto"):
        sys.stderr.write("Note: --draft is not sent to the server this attaches to: it drafts as it loaded the model "
                         "(the catalog's pairing, or a DRAFT line of a model made with `localllm create`).\n")
    elif rpc is not None or os.environ.get("LOCALLLM_RPC"):
        from localllm.devices import use_workers

        use_workers(rpc, say=lambda line: print(line, file=sys.stderr))
    if not interactive and not session.remote and settings.load.num_parallel is None \
            and not os.environ.get("LOCALLLM_NUM_PARALLEL"):
        # one answer in this process, then exit: one slot, not the server's 4 (a quarter of the KV cache to
        # allocate and clear: smollm2:135m loads in ~0.13 s instead of ~0.25 s, with 270 MiB less)
        settings.load = replace(settings.load, num_parallel=1)
    try:
        found = ensure_model(session.models, model)
        name = found.name
        if found.kind:  # an embedding or reranking model: no chat
            embed_answer(session, found.kind, name, " ".join(prompts), settings, interactive)
            return
        if interactive or (tools is not None and " ".join(prompts).strip()):
            from localllm.cli.interactive import Repl

            repl = Repl(session, name, settings, tools=tools, tool_choice=tool_choice)
            if interactive:
                repl.run()
            else:  # one answer through the tool loop (confirmations read from stdin when it is a terminal)
                session.runner.load(name, settings.load, keep_alive=settings.keep_alive)
                repl.start_tools()
                repl.pending_images = attached
                repl.ask(" ".join(prompts))
            return
        text = " ".join(prompts)
        if not text.strip() and not attached:  # nothing to answer (empty stdin, stdout redirected): load, as Ollama
            session.runner.load(name, settings.load, keep_alive=settings.keep_alive)
            return
        code = one_shot(session.runner, name, text, settings, images=attached)
        if code:
            sys.exit(code)
    finally:
        try:
            session.close()
        finally:
            if tools is not None:
                tools.host.close()


def embed_answer(session: Session, kind: str, name: str, text: str, settings: RunSettings, interactive: bool) -> None:
    """``run`` on an embedding model prints the text's embedding as a JSON array, as Ollama does (nothing to embed:
    it loads); a reranking model is pointed to ``localllm rerank``."""
    if kind == "rerank":
        raise LocalLLMError(f"{name} is a reranking model: score documents with `localllm rerank {name} QUERY "
                            "DOCUMENT...`.")
    if interactive:
        raise LocalLLMError(f"{name} is an embedding model, it does not chat: give the text to embed "
                            f"(`localllm run {name} TEXT`, or on stdin).")
    if not text.strip():
        session.runner.load(name, settings.load, keep_alive=settings.keep_alive)
        return
    vector = session.runner.embed(name, [text], settings.load, keep_alive=settings.keep_alive)[0]
    click.echo(json.dumps(vector))


def open_tools(names: tuple[str, ...], *, defaults: bool = True) -> ToolChat | None:
    """The MCP servers ``--mcp`` names (checked against ``mcp.json``: an unknown name is one sentence), else (with
    ``defaults``: the interactive prompt; a one-shot answer uses only what ``--mcp`` names, so a script's output
    does not change with the config) the config's default ones; None when there are none. Nothing starts yet."""
    from localllm.mcp.config import load_config
    from localllm.mcp.host import McpHost
    from localllm.mcp.loop import ToolChat

    if "none" in names or (not names and not defaults):
        return None
    try:
        config = load_config()
    except LocalLLMError as e:
        if names:
            raise
        sys.stderr.write(f"Note: {e} (no MCP tools in this session)\n")  # a plain `run` still works
        return None
    if not names and not config.defaults():
        return None
    host = McpHost(config)
    for n in names:
        host.status(n)  # raises the sentence for a name that is not in mcp.json
    return ToolChat(host, list(names) or config.defaults())


def one_shot(runner: Runner, name: str, text: str, settings: RunSettings,
             out: IO[str] | None = None, err: IO[str] | None = None, *, images: list[bytes] | None = None) -> int:
    """Answer ``text`` once (image files it names attached, after ``images``); returns the exit status (0, or 130
    after Ctrl+C)."""
    out = out or sys.stdout
    err = err or sys.stderr
    message = user_message(text, images or [], err)
    request = settings.request([message])
    answer = stream_answer(runner, name, request, settings.load, out=out, show_thinking=not settings.hide_thinking,
                           keep_alive=settings.keep_alive)
    if answer.text and not answer.text.endswith("\n"):
        out.write("\n")
    out.flush()
    done = answer.done
    if done is not None:
        note = overflow_note(done.stats)
        if note:
            err.write(note + "\n")
        if settings.verbose:
            print_stats(done.stats, err, loaded_plan(runner, name))
            err.writelines(line + "\n" for line in placement_lines(runner, name))
            line = drafting_line(runner, name)
            if line:
                err.write(line + "\n")
    return 130 if answer.cancelled else 0

