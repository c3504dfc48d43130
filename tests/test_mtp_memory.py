"""The plan counts what drafting from a model's own MTP layers allocates (issue 36): the MTP context's KV cache (the
MTP layers only), the target's rollback states of its recurrent layers (``1 + n_rs_seq`` copies, as for any draft),
the drafter's hidden rows and the MTP context's compute and output buffers. Checked against what llama.cpp says it
allocated (``ModelInfo.allocations``, the MTP context's buffers included) on the made Qwen3.5 hybrid with an MTP
block: its KV cache and rollback states (the planner has them to the byte) to the log's resolution (llama.cpp logs
two decimals of MiB a buffer: ``LOG_STEP`` a line), its compute buffer within 0.5 % on the CPU and 4 % on an RPC
worker (measured: 0.11 %, 3.0 %)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from backends.contract.specs import DraftSpec, LoadSpec
from backends.core.loop import LoadedModel
from backends.llamacpp.source import LlamaCppSource
from localllm.ggufinfo import read_gguf
from localllm.hardware import MiB
from localllm.planner import estimate, plan
from localllm.planner.estimation import mtp_bytes, rollback_bytes
from tests.backends.test_mtp_draft import made_mtp
from tests.support_memory import LOG_STEP
from tests.test_moe_placement import _GEN as _MOE_GEN
from tests.test_planner import machine
from tests.test_rpc import _env, _free_port, _start_worker, needs_rpc

N_CTX, SLOTS, K = 1024, 2, 4


@pytest.fixture(scope="module")
def mtp_path(default_model_path, test_cache) -> Path:
    return made_mtp(Path(default_model_path), test_cache, "random")


def _allocated(path: Path, draft: bool) -> tuple[dict[str, int], str | None]:
    """llama.cpp's buffers by kind (all devices) of a load with or without MTP drafting, and its drafter."""
    spec = LoadSpec(str(path), n_ctx=N_CTX, slots=SLOTS, n_threads=1,
                    draft=DraftSpec("mtp", num_draft=K) if draft else None)
    with LoadedModel(LlamaCppSource, spec, name=path.stem) as m:
        out: dict[str, int] = {}
        for kinds in m.info.allocations.values():
            for kind, n in kinds.items():
                out[kind] = out.get(kind, 0) + n
        return out, m.info.draft


def test_the_trunk_counts_without_its_mtp_layers(mtp_path):
    # llama.cpp's target context holds the trunk's memory only: 1 attention layer, 3 recurrent (layer 4 is MTP)
    info = read_gguf(mtp_path)
    assert (info.n_layers, info.mtp_layers, info.recurrent_layers, info.attention_layers) == (5, 1, 3, 1)


def test_the_plan_counts_what_mtp_drafting_allocates(mtp_path):
    info = read_gguf(mtp_path)
    with_mtp, drafter = _allocated(mtp_path, True)
    assert drafter == "mtp"
    plain, _ = _allocated(mtp_path, False)
    m = mtp_bytes(info, N_CTX * SLOTS, "f16", SLOTS, K)
    rollback = rollback_bytes(info, SLOTS, K)  # every draft's on recurrent memory (test_draft_memory: ngram's)
    # the MTP context's KV cache (its one layer, every cell) and the rollback states of the 3 recurrent layers
    kv = with_mtp["kv"] - plain["kv"]
    assert abs(kv - (m["cache"] + rollback)) <= 3 * LOG_STEP, (kv, m)  # the RS lines and MTP KV line; -1,147 B
    # its compute and output buffers: the logits of its small batch (backends.llamacpp.mtp.mtp_batch) and a row an id
    compute = with_mtp["compute"] - plain["compute"]
    assert compute == pytest.approx(m["compute"], rel=0.005), (compute, m)
    # the plan's difference: those and the drafter's hidden rows (Python memory, not llama.cpp's)
    hw = machine(ram_gib=16)
    drafting = plan(info, hw, num_ctx=N_CTX, num_parallel=SLOTS, mtp_draft=K)
    none = plan(info, hw, num_ctx=N_CTX, num_parallel=SLOTS)
    added = drafting.memory.total - none.memory.total
    assert added == drafting.memory.mtp + drafting.memory.rollback == sum(m.values()) + rollback
    assert added - m["rows"] == pytest.approx(kv + compute, rel=0.005)
    assert m["rows"] == 512 * info.n_embd * 4 * 2 * SLOTS  # a ring a sequence id (two a slot)
    line = next(r for r in drafting.reasons if r.startswith("MTP drafting"))
    assert f"+{drafting.memory.mtp / MiB:.0f} MiB" in line and "--draft none" in line, line
    line = next(r for r in drafting.reasons if r.startswith("draft rollback states"))
    assert f"+{rollback / MiB:.1f} MiB for MTP drafting" in line, line
    assert not any("MTP drafting" in r or "rollback" in r for r in none.reasons)
    # estimate() itself: nothing without MTP layers to draft from
    assert estimate(read_gguf(mtp_path), N_CTX, mtp_draft=0).mtp == 0


def test_probe_and_run_plan_mtp_drafting_and_draft_none_plans_without(home, mtp_path):
    from tests.test_mtp_facts import cli
    from tests.test_prepare import _probe_plan, _run_plan

    name = str(mtp_path)
    r = cli("probe", "--model", name)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert any(line.strip().startswith("- MTP drafting (4 tokens a step from the model's 1 MTP layer): +")
               for line in lines), r.stdout
    assert any(line.strip().startswith("- draft rollback states: +") for line in lines), r.stdout
    fast = ["Hi", "--temperature", "0", "--num-predict", "1", "--verbose"]
    drafting = cli("run", name, *fast)
    plain = cli("run", name, *fast, "--draft", "none")
    assert drafting.returncode == 0 and plain.returncode == 0, drafting.stderr + plain.stderr
    assert "drafting:             MTP layers: on" in drafting.stderr

    def mib(line: str) -> int:
        return int(line.split(" MiB")[0].rsplit(" ", 1)[-1])

    assert mib(_run_plan(drafting.stderr)) > mib(_run_plan(plain.stderr)) + 10  # its compute buffer: ~12 MiB
    assert mib(_probe_plan(r.stdout, name)) > mib(_run_plan(plain.stderr))


_GEN = _MOE_GEN.replace("LoadOptions(num_ctx=256, num_parallel=1)",
                        "LoadOptions(num_ctx=256, num_parallel=1, draft=os.environ['DRAFT_UNDER_TEST'])")


def _on_worker(home: Path, model: Path, rpc: str, draft: str) -> dict:
    r = subprocess.run([sys.executable, "-c", _GEN], capture_output=True, text=True, timeout=300,
                       env=_env(home, MODEL_UNDER_TEST=str(model), RPC_UNDER_TEST=rpc, DRAFT_UNDER_TEST=draft))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@needs_rpc
def test_on_an_rpc_worker_the_mtp_context_is_planned_where_llama_cpp_allocates_it(tmp_path, mtp_path):
    """Every layer on one RPC worker: what MTP drafting adds there (the MTP context's cache and compute buffer, the
    rollback states) is what the plan adds to that device: the KV cache to the log's resolution (two lines against
    one: measured +5,981 B of 94,372), the compute buffer within 4 % (measured: +3.0 %)."""
    worker = _start_worker(tmp_path, port := _free_port())
    try:
        rpc = f"127.0.0.1:{port}"
        on, off = _on_worker(tmp_path, mtp_path, rpc, "auto"), _on_worker(tmp_path, mtp_path, rpc, "none")
    finally:
        worker.kill()
        worker.wait(10)
    assert on["ngl"] == off["ngl"] > 0
    [p_on], [p_off] = on["plan"], off["plan"]
    assert p_on["name"] == "RPC0" and "RPC0" in on["alloc"]
    added = {kind: on["alloc"]["RPC0"].get(kind, 0) - off["alloc"]["RPC0"].get(kind, 0) for kind in ("kv", "compute")}
    assert abs(added["kv"] - (p_on["kv"] - p_off["kv"])) <= 3 * LOG_STEP, (on, off)
    assert added["compute"] == pytest.approx(p_on["compute"] - p_off["compute"], rel=0.04), (on, off)
