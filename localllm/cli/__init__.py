"""The ``localllm`` command, all of it in this package. Each subcommand is a module here (``pull.py``,
``run.py``, ...) exposing a click object named ``command``, imported only when used, so ``localllm --help``
and ``localllm list`` start fast. No command imports another: what several share is ``answer.py`` (run
settings, streaming an answer, the stats block, pulling a missing model), ``interactive.py`` (the ``>>>``
prompt) and ``display.py`` (tty checks, sizes, durations, tables, progress bars).

A face: it parses and prints; work goes through the engine and the services.
"""

from __future__ import annotations

import importlib
import sys

import click

# name -> (module, one-line help). The help is here so `--help` needs no imports.
COMMANDS: dict[str, tuple[str, str]] = {
    "pull": ("localllm.cli.pull", "Download a model (resumable, sha256-verified)."),
    "run": ("localllm.cli.run", "Run a model: one-shot with a prompt, else an interactive chat."),
    "chat": ("localllm.cli.chat", "Open the terminal app (chat + model manager)."),
    "list": ("localllm.cli.list", "List installed models."),
    "ps": ("localllm.cli.ps", "List loaded models."),
    "show": ("localllm.cli.show", "Show a model's details."),
    "rm": ("localllm.cli.rm", "Remove models."),
    "cp": ("localllm.cli.cp", "Copy a model to a new name."),
    "verify": ("localllm.cli.verify", "Check installed models' files against their sha256 digests."),
    "create": ("localllm.cli.create", "Create a model from a Modelfile."),
    "quantize": ("localllm.cli.quantize", "Quantize an F32/F16 model (q4_K_M, q8_0, ...)."),
    "stop": ("localllm.cli.stop", "Unload a running model."),
    "serve": ("localllm.cli.serve", "Serve the Ollama and OpenAI APIs."),
    "probe": ("localllm.cli.probe", "Show this machine's hardware and the backend localllm picks."),
    "convert": ("localllm.cli.convert", "Convert an installed GGUF model to MLX, offline (no download)."),
    "bench": ("localllm.cli.bench", "Benchmark a model: prompt/generation speed, TTFT, drafts, KV."),
    "worker": ("localllm.cli.worker", "Serve this machine's devices to another machine (llama.cpp RPC)."),
    "transcribe": ("localllm.cli.transcribe", "Print what is said in an audio file (a model that takes audio)."),
    "launch": ("localllm.cli.launch", "Run a coding agent (claude, codex, opencode) on a local model."),
    "rerank": ("localllm.cli.rerank", "Score documents for a query with a reranking model."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return [*COMMANDS]  # not list(): importing localllm.cli.list binds the name `list` in this module

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module_name, _ = COMMANDS[name]
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name == module_name:
                return None
            raise
        command: click.Command = module.command
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, help_) for name, (_, help_) in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def invoke(self, ctx: click.Context) -> object:  # one sentence and exit 1 for errors a user can cause
        from localllm.errors import LocalLLMError

        try:
            return super().invoke(ctx)
        except LocalLLMError as e:
            click.echo(f"Error: {e}", err=True)
            ctx.exit(1)
        except _backend_errors() as e:
            click.echo(f"Error: {e}", err=True)
            ctx.exit(1)


def _backend_errors() -> tuple[type[BaseException], ...]:
    mod = sys.modules.get("backends.contract.errors")  # only loaded if a backend was used
    return (mod.BackendError,) if mod else ()


@click.group(cls=LazyGroup, invoke_without_command=True,
             context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="localllm", prog_name="localllm")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """Run quantized LLMs on this machine.

    \b
    Examples:
      localllm run smollm2:135m "Why is the sky blue?"
      localllm pull qwen2.5:0.5b
      localllm serve            # Ollama + OpenAI APIs on 127.0.0.1:11434
      localllm                  # the terminal app

    Environment: LOCALLLM_HOME, LOCALLLM_HOST, LOCALLLM_KEEP_ALIVE, ... (see the README).
    """
    if ctx.invoked_subcommand is None:
        from localllm.cli.display import isatty

        if isatty(sys.stdin) and isatty(sys.stdout) and isinstance(ctx.command, click.Group):
            cmd = ctx.command.get_command(ctx, "chat")
            if cmd is not None:
                ctx.invoke(cmd)
                return
        click.echo(ctx.get_help())


def main() -> None:
    cli(prog_name="localllm")


if __name__ == "__main__":
    main()
