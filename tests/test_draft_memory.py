"""Every draft in the plan (issues 34 and 36): a draft model (``--draft NAME|PATH``, the catalog's pairing) is
planned beside the target as the loader loads it (its weights, one slot of KV cache, its compute buffer, its layers
where the plan puts them), and any draft on recurrent/hybrid memory (a draft model, n-gram, MTP) costs the
rollback states llama.cpp keeps for it (``n_rs_seq = num_draft``). Planned vs what llama.cpp says it allocated
(``ModelInfo.allocations``, the draft model's buffers included) on the CPU; the default model drafts for itself.
llama.cpp logs each buffer with two decimals of MiB: what the planner has to the byte (KV caches, rollback states)
is asserted to that resolution (``LOG_STEP`` a buffer line), the rest (compute buffers) within the README's
figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from localllm.ggufinfo import read_gguf
from localllm.hardware import MiB
from localllm.loader import Loader, LoadOptions, plan_line
from localllm.planner import Plan, plan
from localllm.store import Store
from tests.support_memory import LOG_STEP
from tests.test_moe_placement import _GEN as _MOE_GEN
from tests.test_mtp_facts import cli
from tests.test_planner import RTX_4090, machine
from tests.test_rpc import _env, _free_port, _start_worker, needs_rpc

N_CTX, SLOTS, K = 1024, 2, 4


def _load(name: str, draft: str) -> tuple[Plan, dict[str, int], str | None]:
    """(the plan, llama.cpp's buffers by kind over all devices, the drafter) of a load of ``name`` on the CPU with
    ``draft``, as the engine loads it (Loader.prepare, Loader.load)."""
    loader = Loader(Store(), hardware=machine(ram_gib=16))  # a CPU-only machine wherever the test runs
    prepared = loader.prepare(name, LoadOptions(num_ctx=N_CTX, num_parallel=SLOTS, num_draft=K, draft=draft))
    loaded, _ = loader.load(prepared, None)
    with loaded as m:
        out: dict[str, int] = {}
        for kinds in m.info.allocations.values():
            for kind, n in kinds.items():
                out[kind] = out.get(kind, 0) + n
        return prepared.plan, out, m.info.draft


def test_a_draft_model_is_planned_as_llama_cpp_allocates_it(home, default_model_path):
    name = str(default_model_path)
    p, drafted, drafter = _load(name, name)
    plain, alone, _ = _load(name, "none")
    assert drafter == name and p.draft_n_gpu_layers == 0
    allocated = sum(drafted.values()) - sum(alone.values())  # its weights, KV cache (one slot), compute buffer
    assert p.memory.draft > 0 and p.memory.total - plain.memory.total == p.memory.draft
    assert p.memory.draft == pytest.approx(allocated, rel=0.01), (p.memory, drafted, alone)  # measured: -0.71 %
    one = alone["kv"] / (SLOTS + plain.prefill_flash_attn)  # a slot's cells (the prefill context holds one slot's)
    assert abs(drafted["kv"] - alone["kv"] - one) <= 3 * LOG_STEP  # one slot's context (0 B)
    line = next(r for r in p.reasons if r.startswith("draft model "))
    assert f"+{p.memory.draft / MiB:.0f} MiB on the CPU" in line and "--draft none" in line, line
    assert "draft model +" in plan_line(p) and "draft" not in plan_line(plain)


def test_a_gpu_plan_loads_the_draft_model_where_it_puts_it(home, default_model_path):
    """On a GPU that holds both the draft's layers are offloaded as planned: the load's DraftSpec says so."""
    name = str(default_model_path)
    loader = Loader(Store(), hardware=machine(ram_gib=64, gpus=[RTX_4090], offload="CUDA"))
    prepared = loader.prepare(name, LoadOptions(draft=name))
    p = prepared.plan
    assert p.draft_n_gpu_layers == read_gguf(default_model_path).n_layers + 1 and p.memory.draft > 0
    spec = loader.spec(prepared.model, prepared.options, p)
    assert spec.draft is not None and spec.draft.kind == "model"
    assert spec.draft.n_gpu_layers == p.draft_n_gpu_layers
    assert "layers on the GPU" in next(r for r in p.reasons if r.startswith("draft model "))


def test_ngram_drafting_on_a_hybrid_plans_its_rollback_states(home, hybrid_model):
    """llama.cpp keeps num_draft more states of each sequence's recurrent layers for any draft on a hybrid (here
    prompt lookup, no second model): the plan counts them as it allocates them, to the log's resolution (its two RS
    buffer lines; measured: 933,888 B planned, 933,233 read)."""
    name = str(hybrid_model)
    p, drafted, drafter = _load(name, "ngram")
    plain, alone, _ = _load(name, "none")
    assert drafter == "ngram"
    info = read_gguf(hybrid_model)
    planned = p.memory.kv_cache - plain.memory.kv_cache
    assert planned == info.recurrent_bytes * 2 * SLOTS * K > 0  # two sequence ids a slot, K states each
    assert abs(planned - (drafted["kv"] - alone["kv"])) <= 2 * LOG_STEP, (drafted, alone)
    assert p.memory.total - plain.memory.total == planned
    line = next(r for r in p.reasons if r.startswith("draft rollback states"))
    assert f"+{planned / MiB:.1f} MiB for n-gram drafting" in line and "--draft none" in line, line
    assert not any("rollback" in r for r in plain.reasons)


def test_every_draft_kind_counts_the_rollback_states_once(hybrid_model, default_model_path):
    """A draft model, n-gram and MTP drafting cost a hybrid the same rollback states, counted once (MTP's with
    them); a plain transformer has none to keep."""
    info, hw = read_gguf(hybrid_model), machine(ram_gib=16)
    base = plan(info, hw, num_ctx=N_CTX, num_parallel=SLOTS)
    kinds = {kind: plan(info, hw, num_ctx=N_CTX, num_parallel=SLOTS, num_draft=K, draft_kind=kind)
             for kind in ("ngram", "model", "mtp")}
    for kind, p in kinds.items():
        assert p.memory.rollback == p.memory.total - base.memory.total == info.recurrent_bytes * 2 * SLOTS * K, kind
    twice = plan(info, hw, num_ctx=N_CTX, num_parallel=SLOTS, num_draft=K, mtp_draft=K)  # no MTP layers: no MTP
    assert twice.memory.rollback == kinds["ngram"].memory.rollback and twice.memory.mtp == 0
    dense = read_gguf(default_model_path)
    assert plan(dense, hw, num_ctx=N_CTX, num_draft=K, draft_kind="ngram").memory.rollback == 0


def test_probe_plans_the_draft_as_run_loads_it(home, default_model_path, hybrid_model):
    name = str(default_model_path)
    r = cli("probe", "--model", name, "--draft", name)
    assert r.returncode == 0, r.stderr
    assert any(line.strip().startswith("- draft model ") and "on the CPU" in line for line in r.stdout.splitlines())
    probed = next(line.strip() for line in r.stdout.splitlines() if "layers offloaded; draft model +" in line)
    ran = cli("run", name, "Hi", "--temperature", "0", "--num-predict", "1", "--verbose", "--draft", name)
    assert ran.returncode == 0, ran.stderr
    assert "draft model +" in next(line for line in ran.stderr.splitlines() if line.startswith("plan:"))
    assert probed.split("; ", 1)[1] in ran.stderr  # the same layers and draft as probe planned
    r = cli("probe", "--model", str(hybrid_model), "--draft", "ngram")
    assert r.returncode == 0, r.stderr
    assert any(line.strip().startswith("- draft rollback states: +") for line in r.stdout.splitlines()), r.stdout
    missing = cli("probe", "--model", name, "--draft", "no-such-draft:1b")
    assert missing.returncode == 1
    assert "Draft model no-such-draft:1b is not installed" in missing.stdout + missing.stderr


def test_draft_none_and_no_pairing_plan_no_draft(home, default_model_path):
    """The default model has no catalog pairing as a path and no MTP layers: auto plans no draft at all."""
    loader = Loader(Store(), hardware=machine(ram_gib=16))
    for draft in ("auto", "none"):
        p = loader.prepare(str(Path(default_model_path)), LoadOptions(draft=draft)).plan
        assert p.memory.draft == 0 and p.memory.rollback == 0 and not any("draft" in r for r in p.reasons)


_GEN = _MOE_GEN.replace(
    "LoadOptions(num_ctx=256, num_parallel=1)",
    "LoadOptions(num_ctx=256, num_parallel=1, draft=os.environ['DRAFT_UNDER_TEST'])").replace(
    '"n_cpu_moe": plan.n_cpu_moe,', '"n_cpu_moe": plan.n_cpu_moe, "draft": plan.memory.draft, '
    '"draft_ngl": plan.draft_n_gpu_layers, "drafter": lm.info.draft,').replace(
    '"compute": d.compute,', '"compute": d.compute, "draft": d.draft,')


def _on_worker(home: Path, model: Path, rpc: str, draft: str, cap: str) -> dict:
    r = subprocess.run([sys.executable, "-c", _GEN], capture_output=True, text=True, timeout=300,
                       env=_env(home, MODEL_UNDER_TEST=str(model), RPC_UNDER_TEST=rpc, DRAFT_UNDER_TEST=draft,
                                LOCALLLM_DEVICE_MEMORY=cap))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _with_and_without_draft(home: Path, model: Path, cap: str) -> tuple[dict, dict]:
    """``model`` on a fresh RPC worker capped by ``cap`` (LOCALLLM_DEVICE_MEMORY), drafting for itself and not."""
    worker = _start_worker(home, port := _free_port())
    try:
        return (_on_worker(home, model, f"127.0.0.1:{port}", str(model), cap),
                _on_worker(home, model, f"127.0.0.1:{port}", "none", cap))
    finally:
        worker.kill()
        worker.wait(10)


@needs_rpc
def test_on_a_capped_rpc_worker_the_draft_model_stays_where_planned(tmp_path, default_model_path):
    """The target split over a capped RPC worker and the CPU keeps its planned split with a draft model, and the
    draft model (a partial offload leaves the devices no room for it) is planned and allocated on the CPU:
    nothing more on the worker, the CPU's buffers grow by the planned draft within 1 % (measured: 0.64 %)."""
    on, off = _with_and_without_draft(tmp_path, default_model_path, "RPC0=120MiB")
    assert on["drafter"] == str(default_model_path) and on["text"] == off["text"]
    n_layers = read_gguf(default_model_path).n_layers
    assert 0 < on["ngl"] == off["ngl"] < n_layers + 1, on["reasons"]  # a partial offload, the same with the draft
    assert on["plan"] == off["plan"] and on["draft_ngl"] == 0 and on["draft"] > 0
    assert on["alloc"]["RPC0"] == off["alloc"]["RPC0"]  # the worker holds the target's layers only
    added = sum(on["alloc"]["CPU"].values()) - sum(off["alloc"]["CPU"].values())
    assert added == pytest.approx(on["draft"], rel=0.01), (on["alloc"], off["alloc"])


@needs_rpc
def test_a_draft_model_goes_to_the_worker_that_holds_the_whole_target(tmp_path, default_model_path):
    """The whole target on an RPC worker with room to spare: the draft model goes there too, whole (its load on
    that device), and the worker's buffers grow by the planned draft within 0.1 % (measured: 153,396,480 B planned,
    153,385,696 read), the worker's total within 0.5 % (0.18 %); the same greedy text."""
    on, off = _with_and_without_draft(tmp_path, default_model_path, "RPC0=2GiB")
    n_layers = read_gguf(default_model_path).n_layers
    assert on["ngl"] == off["ngl"] == n_layers + 1 and on["draft_ngl"] == n_layers + 1, on["reasons"]
    assert on["drafter"] == str(default_model_path) and on["text"] == off["text"]
    [d] = on["plan"]
    assert d["total"] <= d["usable"]
    on_worker = sum(on["alloc"]["RPC0"].values()) - sum(off["alloc"]["RPC0"].values())
    assert on_worker == pytest.approx(d["draft"], rel=0.001), (on["alloc"], off["alloc"], d)
    assert d["total"] == pytest.approx(sum(on["alloc"]["RPC0"].values()), rel=0.005)
    line = next(r for r in on["reasons"] if r.startswith("draft model "))
    assert f"on RPC0, all {n_layers + 1} layers" in line, line


def test_over_two_devices_the_draft_model_goes_to_the_one_with_more_room(default_model_path):
    """Two devices hold the whole target: the draft model goes whole to the one with the most room left, and
    where neither has room for it, to the CPU, the target's split unchanged either way."""
    from dataclasses import replace

    from localllm.hardware import GiB, LlamaDevice

    info = read_gguf(default_model_path)
    hw = replace(machine(ram_gib=16), rpc=True, devices=[
        LlamaDevice(0, "CPU", "cpu", "cpu", 8 * GiB, 8 * GiB, "CPU"),
        *(LlamaDevice(i + 1, f"RPC{i}", f"127.0.0.1:{50052 + i}", "gpu", 20 * GiB, 20 * GiB, "RPC", offloads=True,
                      remote=True, endpoint=f"127.0.0.1:{50052 + i}") for i in range(2))])
    alone = plan(info, hw, num_ctx=N_CTX, num_parallel=1, tensor_split=[1, 1], device_memory={"RPC1": GiB})
    p = plan(info, hw, num_ctx=N_CTX, num_parallel=1, tensor_split=[1, 1], device_memory={"RPC1": GiB}, draft=info)
    assert p.draft_device == "RPC0" and p.draft_n_gpu_layers == info.n_layers + 1  # RPC0 has 20 GiB, RPC1 1 GiB
    a, b = p.devices
    assert (a.layers, b.layers) == (alone.devices[0].layers, alone.devices[1].layers) and b.draft == 0
    assert a.draft == p.memory.draft - (p.memory.cpu - alone.memory.cpu) > 0
    assert p.memory.gpu == sum(d.total for d in p.devices)
    # no room for it beside the target on either device: on the CPU
    caps = {"RPC0": alone.devices[0].total + a.draft // 2, "RPC1": alone.devices[1].total + a.draft // 2}
    q = plan(info, hw, num_ctx=N_CTX, num_parallel=1, tensor_split=[1, 1], device_memory=caps, draft=info)
    assert q.draft_device is None and q.draft_n_gpu_layers == 0 and all(d.draft == 0 for d in q.devices)
    assert q.n_gpu_layers == info.n_layers + 1 and q.memory.cpu - alone.memory.cpu == q.memory.draft

def test_a_catalog_pairing_never_costs_the_model_its_fit_or_context(home, default_model_path):
    """The catalog's draft (auto) is planned beside the model; where the model fits only without it, it loads and
    decodes plainly, and the plan says why. A draft asked for by name is not second-guessed."""
    from dataclasses import replace

    from localllm.catalog import Catalog

    name = str(default_model_path)
    store = Store()
    entry = replace(Catalog.load().get("smollm2:1.7b"), draft=name)  # a pairing with the file itself
    paired = replace(store.get(name), catalog=entry)
    opts = LoadOptions(num_ctx=N_CTX, num_parallel=SLOTS)
    roomy = Loader(store, hardware=machine(ram_gib=16)).prepare(name, opts, model=paired)
    assert roomy.plan.memory.draft > 0 and roomy.options.draft == "auto"
    tight = Loader(store, hardware=machine(ram_gib=1.4)).prepare(name, opts, model=paired)
    assert tight.plan.fits and tight.plan.memory.draft == 0 and tight.options.draft == "none"
    assert any(r.startswith("draft model ") and "not used" in r for r in tight.plan.reasons), tight.plan.reasons
    asked = Loader(store, hardware=machine(ram_gib=1.4)).prepare(name, replace(opts, draft=name))
    assert not asked.plan.fits and asked.plan.memory.draft > 0
    # nor does it shrink a context the planner chooses: the model keeps its default context and drops the draft
    default = Loader(store, hardware=machine(ram_gib=1.6)).prepare(name, LoadOptions(num_parallel=1), model=paired)
    assert default.plan.n_ctx == 4096 and default.plan.memory.draft == 0, default.plan.reasons
    assert any("a smaller context with it" in r for r in default.plan.reasons), default.plan.reasons
