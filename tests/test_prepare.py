"""One way to prepare a load (issue 34): ``localllm probe`` prints the plan that ``localllm run`` then loads,
both made by :meth:`localllm.loader.Loader.prepare`. Each case runs the two commands as subprocesses and
compares probe's plan line with the ``plan:`` line of ``run --verbose`` (backend, device, context, slots,
memory, layers offloaded) for what used to plan differently: a vision model (the projector's memory), a created
model with its own ``num_ctx`` (the Modelfile's options) and llama.cpp RPC workers (the devices).

``LOCALLLM_NUM_PARALLEL`` is set for both commands: a one-shot ``run`` otherwise loads one slot (it answers once
and exits), where ``probe`` plans the server's and the REPL's default.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from localllm.errors import LocalLLMError
from localllm.hardware import MiB
from localllm.loader import Loader, LoadOptions, plan_line
from localllm.planner.estimation import _gb
from localllm.store import Store
from tests.support import DEFAULT_MODEL, TEST_HOME, install_copy
from tests.test_planner import machine
from tests.test_rpc import _free_port, _start_worker, needs_rpc

FAST = ["--temperature", "0", "--seed", "1", "--num-predict", "1", "--verbose"]


def _env(home: Path) -> dict[str, str]:
    env = dict(os.environ, LOCALLLM_HOME=str(home), LOCALLLM_NUM_PARALLEL="2", LOCALLLM_PROMPT_CACHE_SIZE="0")
    for k in ("LOCALLLM_BACKEND", "LOCALLLM_RPC", "LOCALLLM_DEVICE_MEMORY", "LOCALLLM_MODELS", "LOCALLLM_HOST"):
        env.pop(k, None)
    return env


def _cli(home: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([sys.executable, "-m", "localllm", *args], capture_output=True, text=True, cwd=cwd,
                       env=_env(home), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _probe_plan(out: str, name: str) -> str:
    """The line under ``Plan for NAME`` in probe's output."""
    lines = out.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(f"Plan for {name}"))
    return lines[i + 1].strip()


def _run_plan(err: str) -> str:
    """The ``plan:`` line of ``run --verbose``'s stats block."""
    found = [line.removeprefix("plan:").strip() for line in err.splitlines() if line.startswith("plan:")]
    assert len(found) == 1, f"run --verbose printed no plan line:\n{err[-2000:]}"
    return found[0]


def _same_plan(home: Path, name: str, *extra: str, cwd: Path | None = None) -> str:
    """Probe ``name``, then run it once; both plan lines, asserted equal (returned)."""
    probed = _probe_plan(_cli(home, "probe", "--model", name, *extra, cwd=cwd).stdout, name)
    ran = _run_plan(_cli(home, "run", name, "Hi", *FAST, *extra, cwd=cwd).stderr)
    assert ran == probed
    return probed


@pytest.fixture
def plan_home(tmp_path, installed_default_model) -> Path:
    """A home of its own holding the default model (manifest copied, blob hard-linked)."""
    install_copy(tmp_path / "home" / "data" / "models", TEST_HOME / "data" / "models")
    return tmp_path / "home"


def test_a_vision_model_plans_its_projector_in_probe_and_run(plan_home, tmp_path, default_model_path,
                                                              test_projector, monkeypatch):
    d = tmp_path / "vlm"
    d.mkdir()
    try:
        os.link(default_model_path, d / "model.gguf")
    except OSError:
        shutil.copyfile(default_model_path, d / "model.gguf")
    shutil.copyfile(test_projector, d / "mmproj-test-f16.gguf")
    line = _same_plan(plan_home, "./model.gguf", cwd=d)
    text_only = _probe_plan(_cli(plan_home, "probe", "--model", DEFAULT_MODEL).stdout, DEFAULT_MODEL)
    assert "2 slots" in line and line != text_only  # the projector's memory is in the vision model's plan

    def mib(plan: str) -> int:
        return int(plan.split(" MiB")[0].rsplit(" ", 1)[-1].replace(",", ""))

    size = test_projector.stat().st_size  # 1.9 MB: the plan lines' totals (whole MiB) differ by it, rounded
    assert abs(mib(line) - mib(text_only) - size / MiB) <= 1, (line, text_only, size)
    # to the byte in the plan itself: the projector file is the only difference
    monkeypatch.setenv("LOCALLLM_HOME", str(plan_home))
    loader = Loader(Store(), hardware=machine(ram_gib=16))
    vision, text = (loader.prepare(str(p), LoadOptions(num_parallel=2)).plan for p in (d / "model.gguf", DEFAULT_MODEL))
    assert vision.memory.total - text.memory.total == vision.memory.weights - text.memory.weights == size
    assert any(r.startswith(f"vision projector {_gb(size)}") for r in vision.reasons), vision.reasons


def test_a_created_model_plans_its_own_num_ctx_in_probe_and_run(plan_home, tmp_path):
    (tmp_path / "Modelfile").write_text(f"FROM {DEFAULT_MODEL}\nPARAMETER num_ctx 768\n", encoding="utf-8")
    _cli(plan_home, "create", "short-ctx", "-f", str(tmp_path / "Modelfile"))
    line = _same_plan(plan_home, "short-ctx")
    assert "768-token context" in line


@needs_rpc
def test_rpc_workers_are_planned_alike_in_probe_and_run(plan_home):
    ports = [_free_port(), _free_port()]
    procs = [_start_worker(plan_home.parent, p) for p in ports]
    try:
        rpc = ",".join(f"127.0.0.1:{p}" for p in ports)
        line = _same_plan(plan_home, DEFAULT_MODEL, "--rpc", rpc)
        assert "llama.cpp on RPC0 + RPC1" in line and "31/31 layers offloaded" in line, line
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def test_prepare_merges_the_options_once_and_its_estimate_is_the_plans(default_model, tmp_path):
    """In-process: the created model's PARAMETERs are in the prepared options, the estimate is the plan's memory,
    a replan keeps the model read once, and a plan that does not fit raises only when asked."""
    from localllm.modelfile import parse
    from localllm.store import Store
    from tests.support import private_paths

    pp = private_paths(tmp_path / "home")
    install_copy(pp.models, TEST_HOME / "data" / "models")
    store = Store(paths=pp)
    store.create("loadish", parse(f"FROM {DEFAULT_MODEL}\nPARAMETER num_ctx 512\nPARAMETER num_thread 1\n"))
    loader = Loader(store, backend="llamacpp")
    prepared = loader.prepare("loadish", LoadOptions(num_parallel=1))
    assert (prepared.options.num_ctx, prepared.options.num_thread, prepared.options.backend) == (512, 1, "llamacpp")
    assert prepared.plan.n_ctx == 512 and prepared.estimate == prepared.plan.memory.total > 0
    assert prepared.devices == prepared.plan.devices == []
    bigger = loader.replan(prepared, num_ctx=1024)
    assert bigger.model is prepared.model and bigger.plan.n_ctx == 1024 and bigger.estimate > prepared.estimate
    assert plan_line(prepared.plan).endswith("0/31 layers offloaded")
    prepared.check_fits()
    with pytest.MonkeyPatch.context() as mp:  # a machine with no memory: the plan says so, check_fits raises
        mp.setattr(loader.hardware, "ram_available", 1 << 20)
        mp.setattr(loader.hardware, "ram_total", 1 << 20)
        tight = loader.prepare("loadish")
        assert tight.plan.verdict == "too_big"
        with pytest.raises(LocalLLMError, match="does not fit this machine"):
            tight.check_fits()


def test_a_model_the_caller_read_is_not_read_from_the_store_again(default_model, monkeypatch):
    """The server reads the installed model to answer 404 first and hands it to the engine: a request that loads
    the model reads the store once, not twice (measured: 2 -> 1 ``Store.get`` per loading ``/api/chat``)."""
    from localllm.api import GenerateRequest, Sampling
    from localllm.engine import Engine
    from localllm.store import Store

    store = Store()
    model = store.get(DEFAULT_MODEL)
    reads: list[str] = []
    real_get = Store.get
    monkeypatch.setattr(Store, "get", lambda self, name: reads.append(name) or real_get(self, name))
    request = GenerateRequest(prompt="Hi", sampling=Sampling(temperature=0, max_tokens=1))
    with Engine(store, keep_alive=60) as engine:
        events = list(engine.generate(DEFAULT_MODEL, request, LoadOptions(num_ctx=512, num_parallel=1),
                                      installed=model))
        assert events and engine.is_loaded(DEFAULT_MODEL)
        assert reads == []
        list(engine.generate(DEFAULT_MODEL, request, LoadOptions(num_ctx=1024, num_parallel=1)))  # reload: reads
        assert reads == [DEFAULT_MODEL]
