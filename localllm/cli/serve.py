"""``localllm serve``: the Ollama API (``/api/*``) and the OpenAI API (``/v1/*``) on one address.

    $ localllm serve                       # 127.0.0.1:11434, as Ollama
    $ LOCALLLM_HOST=127.0.0.1:8080 localllm serve
    $ localllm serve --host 0.0.0.0:11434  # beyond this machine: a loud warning (set LOCALLLM_API_KEY)
    $ localllm serve --rpc 127.0.0.1:50052,gpu-box:50052   # llama.cpp RPC workers as devices
    $ localllm serve --open                 # and open the web page (http://127.0.0.1:11434/ui/) in a browser
"""

from __future__ import annotations

import os

import click

from localllm.cli.answer import BackendChoice

ENV_HELP = """\b
Environment:
  LOCALLLM_HOST               address to bind (127.0.0.1:11434)
  LOCALLLM_KEEP_ALIVE         how long an idle model stays loaded (5m; -1 = forever)
  LOCALLLM_MAX_LOADED_MODELS  models loaded at once (0 = as memory allows)
  LOCALLLM_MAX_QUEUE          waiting requests before 503 (512)
  LOCALLLM_ORIGINS            extra CORS origins, comma separated (* wildcards)
  LOCALLLM_API_KEY            require Authorization: Bearer <key> on every endpoint but /
  LOCALLLM_MAX_BODY           request body limit in bytes (32 MiB)
  LOCALLLM_KV_CACHE_TYPE      f16 | q8_0 | q4_0
  LOCALLLM_BACKEND            auto | llamacpp | mlx, for requests (auto)
  LOCALLLM_RPC                llama.cpp RPC workers, host:port,... (as --rpc)
  LOCALLLM_DEVICE_MEMORY      cap per device for the planner: RPC0=2GiB,... or 4GiB
  LOCALLLM_CPU_MOE            1: every expert tensor of a MoE model in RAM (as --cpu-moe)
"""


@click.command("serve", epilog=ENV_HELP)
@click.option("--host", "address", metavar="HOST:PORT", default=None,
              help="Address to listen on (default: LOCALLLM_HOST or 127.0.0.1:11434).")
@click.option("--keep-alive", "keep_alive", default=None, metavar="DURATION",
              help="Default keep-alive for loaded models (5m, 1h, seconds, -1 = forever).")
@click.option("--backend", type=BackendChoice(), default=None,
              help="Backend for every request (default: LOCALLLM_BACKEND or auto, the planner's choice).")
@click.option("--rpc", default=None, metavar="HOST:PORT,...",
              help="Add llama.cpp RPC workers (`localllm worker`) as devices (default: LOCALLLM_RPC).")
@click.option("--cpu-moe", is_flag=True, default=False,
              help="Mixtures of experts keep every expert tensor in RAM (default: LOCALLLM_CPU_MOE, else as few as "
                   "the device needs).")
@click.option("--open", "open_page", is_flag=True, help="Open the web page (/ui/) in the default browser.")
@click.option("--debug", is_flag=True, help="Log every request.")
def command(address: str | None, keep_alive: str | None, backend: str | None, rpc: str | None, cpu_moe: bool,
            open_page: bool, debug: bool) -> None:
    """Serve the Ollama and OpenAI APIs (streaming, several models, keep-alive)."""
    from localllm import config
    from localllm.cli.display import ConversionDisplay
    from localllm.engine import Engine
    from localllm.residency import parse_keep_alive
    from localllm.server.run import serve

    config.check_settings()  # a bad LOCALLLM_* value: one sentence now, not an error on every request
    if cpu_moe:
        os.environ["LOCALLLM_CPU_MOE"] = "1"  # the loader reads it for every load
    ka = parse_keep_alive(keep_alive) if keep_alive else parse_keep_alive(None)
    if rpc is not None or os.environ.get("LOCALLLM_RPC"):
        from localllm.devices import use_workers

        for w in use_workers(rpc, say=lambda line: click.echo(line, err=True)):
            click.echo(f"RPC worker {w.endpoint}: {', '.join(w.devices)}, {w.free_bytes // 2**20:,} MiB free",
                       err=True)
    # serve() binds before the engine does any work: a busy port is one sentence at once. A first-use MLX
    # conversion is a line in the log (no bar: the request log shares stderr).
    serve(address, engine=lambda: Engine(keep_alive=ka, backend=backend, on_convert=ConversionDisplay(bar=False)),
          log_level="debug" if debug else "info", open_page=open_page)
