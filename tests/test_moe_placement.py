"""A mixture of experts on a device too small for it: attention and shared tensors on the device, the experts of
as few first layers as needed in RAM (llama.cpp's ``--n-cpu-moe N``), planned from the GGUF's expert bytes and
checked on a real device path (an RPC worker on loopback): what llama.cpp allocates there within 1 % of the
plan, kind by kind, the CPU's compute buffer (which runs the experts in RAM) within 10 %, the same greedy answer as
the CPU (issue 36)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from localllm.ggufinfo import read_gguf
from localllm.hardware import GiB, LlamaDevice, MiB
from localllm.planner import estimate, plan
from tests.test_planner import machine
from tests.test_rpc import _env, _free_port, _start_worker, _worker_capped, needs_rpc

# 4 layers of 8 experts (12 MiB of experts a layer, 1 MiB of attention and router): experts are most of a layer
BIG = {"FF": 1024, "experts": 8}
# what a capped worker may map beyond its start: the model with every expert in RAM fits, with them it does not
MOE_ROOM = 72 * MiB  # measured: every expert in RAM loads from ~50 MiB, all on the device from ~95


@pytest.fixture(scope="module")
def big_moe(default_model_path, test_cache) -> Path:
    from tests.support import file_key
    from tests.support_memory import make_moe

    return make_moe(default_model_path, test_cache / "derived" / f"moe-big-gpt-oss-{file_key(default_model_path)}.gguf",
                    dims=BIG)


def _rpc_machine(free: int = 20 * GiB):
    """A CPU machine with one RPC worker's device (as the probe lists a worker added)."""
    return replace(machine(ram_gib=16), rpc=True, devices=[
        LlamaDevice(0, "CPU", "cpu", "cpu", 8 * GiB, 8 * GiB, "CPU"),
        LlamaDevice(1, "RPC0", "127.0.0.1:50052", "gpu", free, free, "RPC", offloads=True, remote=True,
                    endpoint="127.0.0.1:50052")])


def _plan(info, cap_mib: int | None = None, **kw):
    return plan(info, _rpc_machine(), num_ctx=256, num_parallel=1,
                device_memory={"RPC0": cap_mib * MiB} if cap_mib else None, **kw)


def test_experts_of_the_first_layers_stay_in_ram_when_the_device_cannot_hold_them_all(big_moe):
    info = read_gguf(big_moe)
    L, eb = info.n_layers, info.expert_bytes
    whole = _plan(info)
    assert whole.verdict == "gpu" and whole.n_cpu_moe == 0 and whole.n_gpu_layers == L + 1
    need = whole.devices[0].total
    # room for everything but one and a half layers' experts: the experts of the first two stay in RAM
    p = _plan(info, (need - eb[0] * 3 // 2) // MiB)
    assert p.n_gpu_layers == L + 1 and p.n_cpu_moe == 2, p.reasons
    assert p.verdict == "partial" and p.verdict_text == f"experts of 2/{L} layers in RAM"
    [d] = p.devices
    assert d.total <= d.usable_bytes and d.layers == L and d.output
    assert d.weights == whole.devices[0].weights - eb[0] - eb[1]
    line = next(r for r in p.reasons if r.startswith("experts of the first 2 of 4 layers in RAM"))
    assert "attention, router and shared tensors fit on the device" in line and "8 experts a layer, 2 used" in line
    # the experts' bytes move to RAM, and the CPU's compute buffer grows to run them
    cpu_compute = p.memory.compute - whole.memory.compute
    assert 0 < cpu_compute < 16 * MiB
    assert p.memory.cpu == whole.memory.cpu + eb[0] + eb[1] + cpu_compute
    assert p.memory.total == whole.memory.total + cpu_compute
    # less room: more layers' experts in RAM, never fewer layers on the device while the experts can move
    q = _plan(info, (need - eb[0] * 7 // 2) // MiB)
    assert q.n_gpu_layers == L + 1 and q.n_cpu_moe == 4
    # the estimate moves exactly the expert bytes
    full = estimate(info, 256, n_gpu_layers=L + 1, device="gpu")
    moved = estimate(info, 256, n_gpu_layers=L + 1, device="gpu", n_cpu_moe=3)
    assert full.gpu - moved.gpu == sum(eb[:3]) and moved.weights == full.weights


def test_num_gpu_still_splits_whole_layers_and_cpu_moe_keeps_every_expert_in_ram(big_moe, default_model_path):
    info = read_gguf(big_moe)
    L, eb = info.n_layers, info.expert_bytes
    need = _plan(info).devices[0].total
    forced = _plan(info, (need - eb[0] * 3 // 2) // MiB, num_gpu=3)
    assert forced.n_gpu_layers == 3 and forced.n_cpu_moe == 0 and forced.verdict_text == "partial offload 3/5 layers"
    assert any("num_gpu places whole layers" in r for r in forced.reasons)
    every = _plan(info, cpu_moe=True)
    assert every.n_cpu_moe == L and every.n_gpu_layers == L + 1
    assert any(r.startswith(f"experts of all {L} layers in RAM") and "cpu_moe" in r for r in every.reasons)
    assert every.devices[0].weights == _plan(info).devices[0].weights - sum(eb)
    assert _plan(info, num_cpu_moe=1).n_cpu_moe == 1
    # all experts in RAM and still no room even for the output layer and its logits: the CPU alone (fewer layers
    # with their experts in RAM: tests/test_moe_layers.py)
    tight = _plan(info, (need - sum(eb) - 40 * MiB) // MiB)
    assert tight.n_cpu_moe == 0 and tight.n_gpu_layers == 0
    # a dense model has no experts to place
    dense = plan(read_gguf(default_model_path), _rpc_machine(), num_ctx=256, num_parallel=1,
                 device_memory={"RPC0": 60 * MiB})
    assert dense.n_cpu_moe == 0 and not any("expert" in r for r in dense.reasons)


_GEN = textwrap.dedent("""
    import json, os, sys
    from localllm import devices
    rpc = os.environ.get("RPC_UNDER_TEST")
    if rpc:
        devices.use_workers(rpc, say=lambda line: print(line, file=sys.stderr))
    from localllm.api import GenerateRequest, Sampling, TextChunk
    from localllm.engine import Engine
    from localllm.loader import LoadOptions
    e = Engine()
    rm = e.load(os.environ["MODEL_UNDER_TEST"], LoadOptions(num_ctx=256, num_parallel=1))
    lm, plan = rm.model, rm.plan
    req = GenerateRequest(prompt="The capital of France is", sampling=Sampling(temperature=0, max_tokens=16, seed=1))
    text = "".join(ev.text for ev in lm.generate(req) if isinstance(ev, TextChunk))
    print(json.dumps({"text": text, "ngl": lm.info.n_gpu_layers, "alloc": lm.info.allocations,
                      "n_cpu_moe": plan.n_cpu_moe, "gpu": plan.memory.gpu,
                      "compute": plan.memory.compute,
                      "plan": [{"name": d.name, "weights": d.weights, "kv": d.kv_cache, "compute": d.compute,
                                "total": d.total, "usable": d.usable_bytes} for d in plan.devices],
                      "reasons": plan.reasons}))
    e.close()
    os._exit(0)
""")


def _generate(home: Path, model: Path, rpc: str | None = None, **env: str) -> dict:
    extra = dict(env, MODEL_UNDER_TEST=str(model))
    if rpc:
        extra["RPC_UNDER_TEST"] = rpc
    r = subprocess.run([sys.executable, "-c", _GEN], env=_env(home, **extra), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@needs_rpc
def test_on_an_rpc_worker_the_experts_placed_in_ram_are_where_llama_cpp_allocates_them(tmp_path, big_moe):
    """One worker capped below the model: llama.cpp allocates on it within 1 % of the plan, kind by kind (measured:
    weights -0.01 %, compute +0.78 %, total +0.39 %), the experts of the planned layers land in host memory, the
    CPU's compute buffer is the plan's within 10 % (measured: -7.7 %), and the greedy answer is the CPU's."""
    info = read_gguf(big_moe)
    cpu = _generate(tmp_path, big_moe)
    assert cpu["ngl"] == 0 and cpu["text"]
    worker = _start_worker(tmp_path, port := _free_port())
    try:
        out = _generate(tmp_path, big_moe, f"127.0.0.1:{port}", LOCALLLM_DEVICE_MEMORY="RPC0=100MiB")
        # the CLI's flag: every expert in RAM, said by --verbose after the answer
        r = subprocess.run([sys.executable, "-m", "localllm", "run", str(big_moe), "Hi", "--rpc", f"127.0.0.1:{port}",
                            "--cpu-moe", "--verbose", "--num-predict", "2", "--num-ctx", "256"],
                           env=_env(tmp_path, LOCALLLM_NUM_PARALLEL="1"), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert f"experts in RAM:       the first {info.n_layers} layer(s) of {info.n_layers}" in r.stderr, r.stderr
    finally:
        worker.kill()
        worker.wait(10)
    assert out["ngl"] == info.n_layers + 1 and 0 < out["n_cpu_moe"] < info.n_layers, out["reasons"]
    [d] = out["plan"]
    got = out["alloc"]["RPC0"]
    assert d["total"] <= d["usable"]
    for mine, theirs in (("weights", "weights"), ("compute", "compute"), ("total", None)):
        real = sum(got.values()) if theirs is None else got[theirs]
        assert abs(d[mine] / real - 1) <= 0.01, (mine, d, got)
    # the device holds every layer but the planned layers' experts, which llama.cpp put in host memory
    moved = sum(info.expert_bytes[:out["n_cpu_moe"]])
    assert out["alloc"]["CPU"]["weights"] >= moved
    # the CPU runs those experts: its compute buffer, as planned (the plan's compute = the device's + the CPU's)
    assert abs((out["compute"] - d["compute"]) / out["alloc"]["CPU"]["compute"] - 1) <= 0.10, out["alloc"]
    tb = info.extra["tensor_bytes"]
    assert got["weights"] < sum(tb["layers"]) + tb["output"] - moved * 0.9
    assert out["text"] == cpu["text"]


def test_the_options_reach_the_load_from_the_api_the_cli_and_a_modelfile():
    from localllm.cli.answer import build_settings
    from localllm.errors import LocalLLMError
    from localllm.modelfile import PARAMETERS
    from localllm.server.options import options_of

    _, load = options_of({"cpu_moe": True, "num_cpu_moe": 3})
    assert load.cpu_moe and load.num_cpu_moe == 3
    assert options_of({"num_cpu_moe": -1})[1].num_cpu_moe is None  # -1 = the planner's choice, as num_gpu
    with pytest.raises(Exception, match="cpu_moe"):
        options_of({"cpu_moe": "yes"})
    s = build_settings(cpu_moe=True, num_cpu_moe=2)
    assert s.load.cpu_moe and s.load.num_cpu_moe == 2
    assert PARAMETERS["num_cpu_moe"] == "integer" and PARAMETERS["cpu_moe"] == "boolean"
    with pytest.raises(LocalLLMError, match="num_cpu_moe must be 0 or more"):
        from localllm.ggufinfo import GGUFInfo

        plan(GGUFInfo(path="", file_size=1, architecture="gpt-oss", name="m", n_layers=2, n_embd=8, n_head=1,
                      n_head_kv=1, head_dim_k=8, head_dim_v=8, context_length=512, vocab_size=8, file_type="F32",
                      parameters=1, chat_template=None, license=None), machine(ram_gib=4), num_cpu_moe=-2)


def test_over_two_devices_the_experts_of_the_first_layers_go_until_each_device_fits(big_moe):
    """llama.cpp keeps the experts of the *first* N layers in RAM, and the first layers are on the first device:
    when the second device is the short one, N grows until its own layers' experts leave it."""
    info = read_gguf(big_moe)
    hw = _rpc_machine()
    hw = replace(hw, devices=[*hw.devices, LlamaDevice(2, "RPC1", "127.0.0.1:50053", "gpu", 20 * GiB, 20 * GiB, "RPC",
                                                       offloads=True, remote=True, endpoint="127.0.0.1:50053")])
    roomy = plan(info, hw, num_ctx=256, num_parallel=1, tensor_split=[1, 1])
    [a, b] = roomy.devices
    assert (a.layers, b.layers, b.output) == (3, 1, True) and roomy.n_cpu_moe == 0  # the output counts in the split
    eb = info.expert_bytes
    # RPC1 (layer 3 and the output) short of half its layer's experts: every layer's experts must go
    caps = {"RPC0": a.total, "RPC1": b.total - eb[3] // 2}
    p = plan(info, hw, num_ctx=256, num_parallel=1, device_memory=caps, tensor_split=[1, 1])
    assert p.n_gpu_layers == info.n_layers + 1 and p.n_cpu_moe == 4, p.reasons
    assert all(d.total <= d.usable_bytes for d in p.devices)
    assert p.devices[0].weights == a.weights - sum(eb[:3]) and p.devices[1].weights == b.weights - eb[3]
    # RPC0 short instead: the experts of its first layer suffice
    p = plan(info, hw, num_ctx=256, num_parallel=1, device_memory={"RPC0": a.total - eb[0] // 2}, tensor_split=[1, 1])
    assert p.n_cpu_moe == 1 and p.devices[1].weights == b.weights


@needs_rpc
def test_out_of_device_memory_at_load_a_moe_keeps_its_experts_in_ram_before_it_gives_up_layers(tmp_path, big_moe):
    """The device takes less than the plan counted on (another process filled it): a mixture of experts loads
    again with every expert in RAM and every layer's attention still offloaded, not with half its layers, says so
    in one line, and answers as the CPU does."""
    info = read_gguf(big_moe)
    L = info.n_layers
    args = [sys.executable, "-m", "localllm", "run", str(big_moe), "--temperature", "0", "--seed", "1",
            "--num-predict", "16", "--num-ctx", "256", "The capital of France is"]
    env = _env(tmp_path, LOCALLLM_NUM_PARALLEL="1")
    cpu = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert cpu.returncode == 0 and cpu.stdout.strip(), cpu.stderr[-2000:]
    # room for every layer's attention, the output layer and the compute buffer, not for the 48 MiB of experts
    worker, port = _worker_capped(tmp_path, MOE_ROOM)
    try:
        r = subprocess.run([*args, "--rpc", f"127.0.0.1:{port}", "--verbose"], env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert worker.poll() is None  # the worker lives on
    finally:
        worker.kill()
        worker.wait(10)
    assert r.stdout.strip() == cpu.stdout.strip()
    lines = [ln for ln in r.stderr.splitlines() if "out of device memory" in ln]
    assert lines == [f"{big_moe}: out of device memory at load with {L + 1} layers offloaded; loading with "
                     f"{L + 1} layers offloaded, every expert in RAM"], r.stderr[-3000:]
    assert f"experts in RAM:       the first {L} layer(s) of {L}" in r.stderr, r.stderr[-3000:]
