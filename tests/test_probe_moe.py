"""``probe --cpu-moe`` / ``--num-cpu-moe N`` plan what ``run --cpu-moe`` / ``--num-cpu-moe N`` loads (issue 36): on
the made mixture of experts with an RPC worker's device to offload to (on the CPU alone the experts have nowhere else
to go), probe's plan line is ``run --verbose``'s; a bad ``--num-cpu-moe`` is one sentence and a non-zero exit."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.test_moe_placement import big_moe  # noqa: F401 - the fixture
from tests.test_prepare import _cli, _probe_plan, _same_plan, plan_home  # noqa: F401 - plan_home: the fixture
from tests.test_rpc import _free_port, _start_worker, needs_rpc


@pytest.fixture
def worker(plan_home):  # noqa: F811 - the fixture
    port = _free_port()
    proc = _start_worker(plan_home.parent, port)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(10)


@needs_rpc
def test_probe_plans_the_experts_in_ram_as_run_loads_them(plan_home, big_moe, worker):  # noqa: F811
    name, rpc = str(big_moe), worker
    every = _same_plan(plan_home, name, "--rpc", rpc, "--cpu-moe")
    assert "experts of 4/4 layers in RAM" in every, every
    first = _same_plan(plan_home, name, "--rpc", rpc, "--num-cpu-moe", "1")
    assert "experts of 1/4 layers in RAM" in first, first
    default = _probe_plan(_cli(plan_home, "probe", "--model", name, "--rpc", rpc).stdout, name)
    assert "experts of" not in default and len({every, first, default}) == 3  # the options change the plan
    out = _cli(plan_home, "probe", "--model", name, "--rpc", rpc, "--cpu-moe").stdout
    assert "asked for with cpu_moe" in out, out


@pytest.mark.parametrize("value", ["-1", "two"])
def test_a_bad_num_cpu_moe_is_one_sentence(home, value):
    r = subprocess.run([sys.executable, "-m", "localllm", "probe", "--num-cpu-moe", value], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    [error] = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert error.startswith("Error: Invalid value for '--num-cpu-moe': ") and error.count(".") <= 2, r.stderr
    assert "--cpu-moe" in subprocess.run([sys.executable, "-m", "localllm", "probe", "--help"], capture_output=True,
                                         text=True, timeout=120).stdout
