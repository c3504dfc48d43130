"""``localllm probe``: this machine's hardware, the backends that can run here, and how a model
would be loaded (backend, GPU layers, context, memory) and why.

    $ localllm probe                          # plans the default model when it is installed
    $ localllm probe --model llama3.1:8b --ctx 32768 --kv-cache-type q8_0
    $ localllm probe --model ./model.gguf     # a local file is read in place
    $ localllm probe --json                   # HardwareInfo as JSON, plus "model" and "plan"

"Devices" is llama.cpp's own device list (ggml's registry: CPU, CUDA, ROCm, Vulkan, Metal, SYCL, RPC workers),
what the installed build can use; "GPU" rows are what the machine has (NVML, /sys/class/drm), used or not.

Nothing is loaded: the plan is the planner's estimate from the GGUF metadata and the probe.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click

from localllm.cli.answer import BackendChoice
from localllm.cli.display import binary_size
from localllm.config import DEFAULT_MODEL
from localllm.planner import KV_TYPES

if TYPE_CHECKING:
    from localllm.hardware import HardwareInfo
    from localllm.planner import Plan
    from localllm.store import InstalledModel, Store


def plan_for_model(name: str, hw: HardwareInfo, *, num_ctx: int | None, kv_cache_type: str, backend: str,
                   num_gpu: int | None, store: Store | None = None, cpu_moe: bool = False,
                   num_cpu_moe: int | None = None, draft: str = "auto",
                   num_draft: int = 4) -> tuple[InstalledModel | None, Plan | None, str | None]:
    """(installed model or None, plan or None, why there is no plan), prepared as the engine prepares a load
    (:meth:`localllm.loader.Loader.prepare`): the same plan ``run``, ``serve`` and the REPL load — a created
    model's ``num_ctx``, the projector's memory, ``LOCALLLM_NUM_PARALLEL``, ``LOCALLLM_BACKEND``, llama.cpp's
    devices (RPC workers), MLX weights or their conversion, a mixture of experts' ``cpu_moe`` / ``num_cpu_moe``
    (``run --cpu-moe`` / ``--num-cpu-moe N``; ``LOCALLLM_CPU_MOE``), the draft (``--draft``: a draft model's memory
    and layers, the rollback states any draft needs on recurrent memory). A model that is not installed yields no plan
    (the planner needs its GGUF metadata); an impossible request yields PlanError's sentence."""
    from localllm.errors import LocalLLMError, ModelNotFoundError
    from localllm.loader import Loader, LoadOptions
    from localllm.store import Store as _Store

    store = store or _Store()
    loader = Loader(store, hardware=hw)
    try:
        prepared = loader.prepare(name, LoadOptions(num_ctx=num_ctx, kv_cache_type=kv_cache_type, backend=backend,
                                                    num_gpu=num_gpu, cpu_moe=cpu_moe, num_cpu_moe=num_cpu_moe,
                                                    draft=draft, num_draft=num_draft))
        return prepared.model, prepared.plan, None
    except ModelNotFoundError as e:
        return None, None, catalog_estimate(name, hw, store) or f"{e} (The plan needs its GGUF metadata.)"
    except LocalLLMError as e:
        try:
            return store.get(name), None, str(e)
        except LocalLLMError:
            return None, None, str(e)


def catalog_estimate(name: str, hw: HardwareInfo, store: Store) -> str | None:
    """For a catalog model not installed yet: the plan's first filter from the catalog's facts (download size,
    trained context, experts), marked ``≈`` as ``list --catalog`` marks it; None for a name the catalog lacks."""
    from localllm.download import fmt_bytes
    from localllm.errors import LocalLLMError
    from localllm.local import estimate_fit

    try:
        entry, quant = store.catalog.resolve(name)
    except LocalLLMError:
        return None
    size = entry.approx_size if quant == entry.default_quant else None
    size = size or next((m.size for m in entry.mirrors_for(quant)), 0)
    fit = estimate_fit(size or 0, hw)
    facts = [f"{fmt_bytes(size)} {quant}" if size else quant, fit.text or "≈ fit unknown"]
    if entry.context_length:
        facts.append(f"{entry.context_length:,}-token trained context")
    if entry.moe is not None:
        experts = (f", {entry.moe.experts_used} of {entry.moe.experts} experts a token"
                   if entry.moe.experts and entry.moe.experts_used else "")
        facts.append(f"mixture of experts {entry.moe.label()}{experts}")
    return (f"Not installed; an estimate from the catalog (≈: weights + ~20% for the KV cache and buffers): "
            f"{', '.join(facts)}. `localllm pull {entry.installed_name(quant)}` gives the exact plan.")


def _hardware_rows(hw: HardwareInfo) -> list[tuple[str, str]]:
    rows = [("System", f"{hw.os} {hw.arch}"),
            ("CPU", f"{hw.cpu_model}: {hw.physical_cores} physical / {hw.logical_cores} logical cores"),
            ("SIMD", " ".join(hw.simd) or "none found"),
            ("RAM", f"{binary_size(hw.ram_total)} total, {binary_size(hw.ram_available)} available")]
    if not hw.gpus:
        rows.append(("GPU", "none found"))
    for g in hw.gpus:
        if g.vendor == "apple":
            rows.append((f"GPU {g.index}", f"{g.name} (unified memory)"))
        else:
            extra = ", ".join(x for x in ("integrated" if g.integrated else "",
                                          f"driver {g.driver}" if g.driver else "",
                                          f"compute {g.compute_capability}" if g.compute_capability else "",
                                          g.gfx_target or "",
                                          f"PCI {g.pci_id}" if g.pci_id and g.pci_id not in g.name else "") if x)
            memory = (f"{binary_size(g.free_bytes)} free of {binary_size(g.total_bytes)}" if g.total_bytes
                      else "memory not reported")
            rows.append((f"GPU {g.index}", f"{g.name}: {memory}" + (f" ({extra})" if extra else "")))
    if hw.apple_silicon:
        rows.append(("Metal budget", binary_size(hw.metal_budget)))
    for key, b in hw.backends.items():
        rows.append((b.label or key, f"{'yes' if b.available else 'no'}: {b.reason}"))
    return rows


def _device_rows(hw: HardwareInfo) -> list[tuple[str, str, str, str]]:
    """(name, type, description, memory) per device of llama.cpp's own list: what the build can use."""
    rows: list[tuple[str, str, str, str]] = []
    for d in hw.devices:
        where = f"remote, RPC worker {d.endpoint}" if d.remote else d.description
        memory = f"{binary_size(d.free_bytes)} free of {binary_size(d.total_bytes)}" if d.total_bytes else "?"
        rows.append((d.name, d.type, where, memory))
    return rows


def render(hw: HardwareInfo, name: str, model: InstalledModel | None, p: Plan | None, why: str | None,
           draft: str = "auto") -> None:
    from rich.console import Console
    from rich.table import Table

    from localllm.loader import plan_line

    console = Console(highlight=False, soft_wrap=True)
    table = Table(title="Hardware", title_justify="left", show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    for k, v in _hardware_rows(hw):
        table.add_row(k, v)
    console.print(table)
    console.print(f"\n[bold]Devices[/bold] (llama.cpp's own list; llama.cpp build: RPC {'yes' if hw.rpc else 'no'})")
    devices = Table(show_header=False, box=None, padding=(0, 2))
    for _ in range(4):
        devices.add_column()
    for row in _device_rows(hw):
        devices.add_row(*row)
    if hw.devices:
        console.print(devices)
    else:
        console.print("  none read (see Notes)")
    if hw.notes:
        console.print("\n[bold]Notes[/bold]")
        for n in hw.notes:
            console.print(f"  - {n}", markup=False)
    console.print(f"\n[bold]Plan for {name}[/bold]" + (f" ({model.info.get('file_type')}, "
                                                        f"{model.info.get('n_layers')} layers)" if model else ""))
    if p is None:
        console.print(f"  {why}", markup=False)
        return
    console.print(f"  {plan_line(p)}", markup=False)
    for r in p.reasons:
        console.print(f"  - {r}", markup=False)
    from localllm.loader import mtp_note

    note = mtp_note(model.info, p.backend, draft) if model is not None else None
    if note:
        console.print(f"  - {note}", markup=False)
    if p.max_ctx:
        console.print(f"  - largest context that loads the same way: about {p.max_ctx:,} tokens", markup=False)
    if p.advice:
        console.print("\n[bold]Advice[/bold]")
        for line in p.advice.splitlines():
            console.print(f"  {line}", markup=False)


@click.command("probe")
@click.option("--model", "-m", "name", default=DEFAULT_MODEL, show_default=True,
              help="Model to plan for: an installed name or a local .gguf path.")
@click.option("--ctx", "num_ctx", type=click.IntRange(min=1), default=None,
              help="Context size to plan for (default: min(model's, 4096), shrunk to fit).")
@click.option("--kv-cache-type", type=click.Choice(KV_TYPES), default=None,
              help="KV cache type (default: LOCALLLM_KV_CACHE_TYPE or f16).")
@click.option("--backend", type=BackendChoice(), default="auto", show_default=True,
              help="Backend to plan for.")
@click.option("--num-gpu", type=int, default=None, help="Layers to offload (0 = CPU only).")
@click.option("--rpc", default=None, metavar="HOST:PORT,...",
              help="Add llama.cpp RPC workers (`localllm worker`) first: they are listed and planned for "
                   "(default: LOCALLLM_RPC).")
@click.option("--cpu-moe", is_flag=True, default=False,
              help="A mixture of experts: plan every expert tensor in RAM, as `run --cpu-moe` loads it "
                   "(default: LOCALLLM_CPU_MOE, else as few as the device needs).")
@click.option("--num-cpu-moe", type=click.IntRange(min=0), default=None, metavar="N",
              help="A mixture of experts: plan the experts of the first N layers in RAM (llama.cpp's --n-cpu-moe).")
@click.option("--draft", default="auto", show_default=True, metavar="NAME|PATH|ngram|mtp|none",
              help="Plan with this draft, as `run --draft` loads it: a draft model's memory and layers, the rollback "
                   "states any draft needs on recurrent/hybrid memory.")
@click.option("--num-draft", type=click.IntRange(min=1, max=64), default=4, show_default=True,
              help="Most tokens the draft proposes per step.")
@click.option("--json", "as_json", is_flag=True,
              help="Print HardwareInfo as JSON (devices and rpc included), with the model and the plan.")
def command(name: str, num_ctx: int | None, kv_cache_type: str | None, backend: str, num_gpu: int | None,
            rpc: str | None, cpu_moe: bool, num_cpu_moe: int | None, draft: str, num_draft: int,
            as_json: bool) -> None:
    """Show this machine's hardware, llama.cpp's devices and the backend localllm picks.

    "Devices" lists every device the installed llama.cpp build sees (CPU, CUDA, ROCm, Vulkan, Metal, RPC
    workers) with free/total memory; a GPU the build cannot use gets the install command under "Advice".

    \b
    Examples:
      localllm probe
      localllm probe --model llama3.1:8b --ctx 32768 --kv-cache-type q8_0
      localllm probe --json
      localllm probe --rpc 127.0.0.1:50052,gpu-box:50052
      localllm probe --model gpt-oss:20b --cpu-moe
      localllm probe --model qwen2.5:7b --draft qwen2.5:0.5b
    """
    import os
    import sys

    from localllm import config
    from localllm.hardware import probe

    if rpc is not None or os.environ.get("LOCALLLM_RPC"):
        from localllm.devices import use_workers

        use_workers(rpc, say=lambda line: print(line, file=sys.stderr))

    hw = probe()
    kv = kv_cache_type or config.kv_cache_type()
    model, p, why = plan_for_model(name, hw, num_ctx=num_ctx, kv_cache_type=kv, backend=backend, num_gpu=num_gpu,
                                   cpu_moe=cpu_moe, num_cpu_moe=num_cpu_moe, draft=draft, num_draft=num_draft)
    if as_json:
        out = hw.as_dict()
        out["model"] = name
        out["plan"] = p.as_dict() if p else None
        out["plan_error"] = why
        out["mtp_layers"] = int(model.info.get("mtp_layers") or 0) if model is not None else None
        from localllm.loader import mtp_note

        out["mtp_drafting"] = mtp_note(model.info, p.backend, draft) if model is not None and p is not None else None
        click.echo(json.dumps(out, indent=2))
    else:
        render(hw, name, model, p, why, draft)
    if model is not None and p is None:  # the planner refused what was asked (PlanError)
        raise SystemExit(1)
