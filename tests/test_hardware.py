"""The hardware probe: the real one on this machine, and every failure it must survive.

This machine has no GPU, so NVML, nvidia-smi, Apple Silicon and the GPU builds of llama.cpp are
simulated (fake modules, a fake ``nvidia-smi`` executable on PATH, patched ``platform``); the
probe's own code runs unpatched.
"""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys
import types
from pathlib import Path

import pytest

from backends.descriptor import parse_gpu_backend
from localllm import gpus, hardware
from localllm.gpus import parse_nvidia_smi
from localllm.hardware import GiB, MiB, probe, simd_from_flags
from tests.support import tiny_gguf


@pytest.fixture(autouse=True)
def _fresh_cache():
    hardware._cache = None
    yield
    hardware._cache = None


# ------------------------------------------------------------------------------------ the real probe


def test_real_probe_describes_this_machine():
    hw = probe(refresh=True)
    assert hw.os == os.uname().sysname
    assert hw.cpu_model and hw.cpu_model != "unknown CPU"
    assert 1 <= hw.physical_cores <= hw.logical_cores == len(os.sched_getaffinity(0))  # the cores it may run on
    assert 0 < hw.ram_available <= hw.ram_total
    if hw.os == "Linux" and hw.arch == "x86_64":
        flags = Path("/proc/cpuinfo").read_text()
        assert ("avx2" in hw.simd) == (" avx2" in flags)
        assert ("sse3" in hw.simd) == (" pni" in flags or " sse3" in flags)
    assert set(hw.backends) == {"llamacpp", "mlx"}
    # as_dict is plain JSON
    again = json.loads(json.dumps(hw.as_dict()))
    assert again["ram_total"] == hw.ram_total and again["backends"]["llamacpp"]["name"] == "llamacpp"


def test_real_probe_says_why_no_gpu_was_found():
    hw = probe(refresh=True)
    if hw.gpus:
        pytest.skip("hardware: this machine has a GPU")
    text = " ".join(hw.notes)
    assert "NVML" in text or hw.os == "Darwin"
    assert "nvidia-smi" in text or hw.os == "Darwin"


def test_real_llamacpp_status_matches_the_library():
    llama_cpp = pytest.importorskip("llama_cpp")
    b = probe(refresh=True).backends["llamacpp"]
    assert b.available
    # llama_supports_gpu_offload() is true for RPC alone; the status counts a local GPU backend only
    local_gpu = bool(llama_cpp.llama_supports_gpu_offload()) and parse_gpu_backend(b.detail) is not None
    assert b.gpu_offload == local_gpu
    assert ("with RPC" in b.reason) == bool(llama_cpp.llama_supports_rpc())
    assert b.version == llama_cpp.__version__
    assert "CPU" in b.detail  # llama_print_system_info()
    assert ("CPU-only" in b.reason) == (not b.gpu_offload)


def test_probe_is_cached_until_refresh():
    a = probe()
    assert probe() is a
    b = probe(refresh=True)
    assert b is not a and probe() is b


def test_probe_never_raises_even_when_everything_breaks(monkeypatch):
    def boom():
        raise RuntimeError("simulated")

    monkeypatch.setattr(hardware, "_probe", boom)
    hw = probe(refresh=True)
    assert hw.gpus == [] and hw.physical_cores >= 1
    assert hw.notes == ["hardware probe failed: simulated"]


def test_one_broken_part_does_not_take_the_others_down(monkeypatch):
    def broken_cores():
        raise RuntimeError("psutil exploded")

    monkeypatch.setattr(hardware, "_cores", broken_cores)
    hw = probe(refresh=True)
    assert "core count probe failed: psutil exploded" in hw.notes
    assert hw.physical_cores == os.cpu_count() and hw.ram_total > 0


# ------------------------------------------------------------------------------------ CPU parsing


def test_simd_from_x86_and_arm_flags():
    assert simd_from_flags("fpu sse sse2 pni ssse3 fma cx16 sse4_1 sse4_2 avx f16c avx2 avx512f avx512bw") == [
        "sse3", "ssse3", "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw"]
    # ARM Linux (e.g. Graviton 3)
    assert simd_from_flags("fp asimd evtstrm aes asimdhp cpuid asimddp sve i8mm bf16 sve2") == [
        "neon", "fp16", "dotprod", "i8mm", "bf16", "sve", "sve2"]
    assert simd_from_flags("") == []


def test_cpu_model_from_arm_cpuinfo_and_fallback():
    arm = "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd\nCPU part\t: 0xd40\n\nHardware\t: BCM2835\n"
    assert hardware._cpu_model("Linux", arm) == "BCM2835"
    assert hardware._simd("Linux", "aarch64", arm) == ["neon"]
    assert hardware._cpu_model("Linux", "") not in ("", None)  # platform fallback


# ------------------------------------------------------------------------------------------ NVIDIA


def _fake_nvml(monkeypatch, *, init_error: str | None = None, gpus=()):
    """A stand-in for nvidia-ml-py: no GPU here, so NVML itself cannot be exercised."""
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    m.NVMLError = NVMLError
    state = {"shutdown": 0}

    def init():
        if init_error:
            raise NVMLError(init_error)

    m.nvmlInit = init
    m.nvmlShutdown = lambda: state.__setitem__("shutdown", state["shutdown"] + 1)
    m.nvmlSystemGetDriverVersion = lambda: b"550.54.14"
    m.nvmlDeviceGetCount = lambda: len(gpus)
    m.nvmlDeviceGetHandleByIndex = lambda i: gpus[i]
    m.nvmlDeviceGetName = lambda h: h["name"]
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=h["total"], free=h["free"], used=0)
    m.nvmlDeviceGetCudaComputeCapability = lambda h: h["cc"]
    monkeypatch.setitem(sys.modules, "pynvml", m)
    return state


def _fake_smi(monkeypatch, tmp_path: Path, script: str) -> None:
    """Put an executable ``nvidia-smi`` (a real process) first on PATH."""
    exe = tmp_path / "bin" / "nvidia-smi"
    exe.parent.mkdir(exist_ok=True)
    exe.write_text("#!/bin/sh\n" + script)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ['PATH']}")


def _no_smi(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))


def test_nvml_success_reads_every_field(monkeypatch, tmp_path):
    state = _fake_nvml(monkeypatch, gpus=[{"name": b"NVIDIA GeForce RTX 4090", "total": 24564 * MiB,
                                           "free": 23000 * MiB, "cc": (8, 9)}])
    _no_smi(monkeypatch, tmp_path)
    hw = probe(refresh=True)
    [g] = hw.gpus
    assert (g.index, g.name, g.vendor) == (0, "NVIDIA GeForce RTX 4090", "nvidia")
    assert (g.total_bytes, g.free_bytes) == (24564 * MiB, 23000 * MiB)
    assert (g.driver, g.compute_capability) == ("550.54.14", "8.9")
    assert state["shutdown"] == 1
    assert not any("NVML" in n for n in hw.notes)


def test_missing_nvidia_ml_py_and_missing_nvidia_smi(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails like an uninstalled package
    _no_smi(monkeypatch, tmp_path)
    hw = probe(refresh=True)
    assert hw.gpus == []
    assert any(n.startswith("NVML not available: nvidia-ml-py is not installed") for n in hw.notes)
    assert "nvidia-smi not found on PATH" in hw.notes


def test_nvml_init_error_falls_back_to_nvidia_smi(monkeypatch, tmp_path):
    _fake_nvml(monkeypatch, init_error="Driver Not Loaded")
    _fake_smi(monkeypatch, tmp_path, 'echo "0, NVIDIA GeForce RTX 3060, 12288, 11000, 535.104.05, 8.6"\n'
                                     'echo "1, Tesla T4, 15360, 15000, 535.104.05, 7.5"\n')
    hw = probe(refresh=True)
    assert "NVML not available: Driver Not Loaded" in hw.notes
    assert [(g.index, g.name, g.total_bytes // MiB, g.free_bytes // MiB, g.compute_capability) for g in hw.gpus] == [
        (0, "NVIDIA GeForce RTX 3060", 12288, 11000, "8.6"), (1, "Tesla T4", 15360, 15000, "7.5")]
    assert hw.gpus[0].driver == "535.104.05"


def test_nvidia_smi_garbage_is_a_note_not_a_crash(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    _fake_smi(monkeypatch, tmp_path, 'echo "this is not csv"\n')
    hw = probe(refresh=True)
    assert hw.gpus == []
    assert any(n.startswith("nvidia-smi output not understood") for n in hw.notes)


def test_nvidia_smi_without_a_driver(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    _fake_smi(monkeypatch, tmp_path, "echo \"NVIDIA-SMI has failed because it couldn't communicate with the "
                                     "NVIDIA driver.\"\nexit 9\n")
    hw = probe(refresh=True)
    assert hw.gpus == []
    assert any("nvidia-smi failed (exit 9): NVIDIA-SMI has failed" in n for n in hw.notes)


def test_nvidia_smi_that_hangs_is_timed_out(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(gpus, "NVIDIA_SMI_TIMEOUT_S", 0.5)
    _fake_smi(monkeypatch, tmp_path, "exec sleep 30\n")
    hw = probe(refresh=True)
    assert hw.gpus == []
    assert "nvidia-smi did not answer within 0.5 s" in hw.notes


def test_old_nvidia_smi_without_compute_cap(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    _fake_smi(monkeypatch, tmp_path, 'case "$1" in *compute_cap*) echo \'Field "compute_cap" is not a valid field '
                                     'to query.\' >&2; exit 2;; esac\necho "0, Quadro P4000, 8192, 8000, 470.57.02"\n')
    [g] = probe(refresh=True).gpus
    assert (g.name, g.compute_capability, g.total_bytes) == ("Quadro P4000", None, 8192 * MiB)


def test_parse_nvidia_smi_rejects_short_lines():
    with pytest.raises(ValueError):
        parse_nvidia_smi("0, name")
    with pytest.raises(ValueError):
        parse_nvidia_smi("")
    assert parse_nvidia_smi("0, X, 100, 50, [N/A], [N/A]")[0].driver is None


# ----------------------------------------------------------------------------------- Apple Silicon


def _fake_mac(monkeypatch, *, arch="arm64", ram=16 * GiB, sysctl=None, mlx_info=None):
    values = {"machdep.cpu.brand_string": "Apple M2 Pro", "hw.optional.neon": "1",
              "hw.optional.arm.FEAT_DotProd": "1", "hw.optional.arm.FEAT_FP16": "1",
              "hw.optional.arm.FEAT_I8MM": "0", "hw.optional.arm64": "1"}
    values.update(sysctl or {})
    monkeypatch.setattr(hardware.platform, "system", lambda: "Darwin")
    monkeypatch.setattr(hardware.platform, "machine", lambda: arch)
    monkeypatch.setattr(hardware, "_sysctl", lambda name: values.get(name))
    monkeypatch.setattr(hardware, "_ram", lambda notes: (ram, ram // 2))
    if mlx_info is None:
        monkeypatch.setitem(sys.modules, "mlx", None)
        monkeypatch.setitem(sys.modules, "mlx.core", None)
    else:  # MLX on a Mac: Metal available, device_info with the working-set size
        core = types.ModuleType("mlx.core")
        core.__version__ = "0.32.4"
        core.device_info = lambda: dict(mlx_info)
        core.default_device = lambda: "Device(gpu, 0)"
        core.metal = types.SimpleNamespace(is_available=lambda: True)
        pkg = types.ModuleType("mlx")
        pkg.core = core
        monkeypatch.setitem(sys.modules, "mlx", pkg)
        monkeypatch.setitem(sys.modules, "mlx.core", core)


def test_apple_silicon_without_mlx_uses_the_ram_rule(monkeypatch):
    _fake_mac(monkeypatch, ram=16 * GiB)
    hw = probe(refresh=True)
    assert hw.apple_silicon and hw.cpu_model == "Apple M2 Pro"
    assert hw.simd == ["neon", "fp16", "dotprod"]
    assert hw.metal_budget == 16 * GiB * 2 // 3
    assert [(g.vendor, g.total_bytes) for g in hw.gpus] == [("apple", hw.metal_budget)]
    assert any("2/3 of RAM" in n for n in hw.notes)
    assert not hw.backends["mlx"].available and "mlx is not importable" in hw.backends["mlx"].reason


def test_apple_silicon_budget_from_mlx(monkeypatch):
    _fake_mac(monkeypatch, ram=24 * GiB, mlx_info={"max_recommended_working_set_size": 19 * GiB,
                                                  "device_name": "Apple M3"})
    hw = probe(refresh=True)
    assert hw.metal_budget == 19 * GiB
    mlx = hw.backends["mlx"]
    assert mlx.gpu_backend == "Metal" and mlx.gpu_offload
    assert mlx.available == (importlib.util.find_spec("mlx_lm") is not None)


def test_raised_wired_limit_wins(monkeypatch):
    _fake_mac(monkeypatch, ram=64 * GiB, sysctl={"iogpu.wired_limit_mb": "57344"})
    hw = probe(refresh=True)
    assert hw.metal_budget == 57344 * MiB
    assert any("iogpu.wired_limit_mb" in n for n in hw.notes)


def test_rosetta_is_not_apple_silicon_and_says_so(monkeypatch):
    _fake_mac(monkeypatch, arch="x86_64")
    hw = probe(refresh=True)
    assert not hw.apple_silicon and hw.metal_budget is None and hw.gpus == []
    assert any("Rosetta" in n for n in hw.notes)


def test_metal_budget_rule():
    assert hardware.metal_budget_rule(16 * GiB) == 16 * GiB * 2 // 3
    assert hardware.metal_budget_rule(36 * GiB) == 24 * GiB
    assert hardware.metal_budget_rule(128 * GiB) == 96 * GiB  # the M3 Max figure LM Studio logs


# ----------------------------------------------------------------------------------------- backends


def test_llamacpp_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    b = probe(refresh=True).backends["llamacpp"]
    assert not b.available and not b.gpu_offload
    assert b.reason.startswith("llama-cpp-python is not importable")


def test_llamacpp_cuda_build_is_recognised(monkeypatch):
    fake = types.ModuleType("llama_cpp")
    fake.__version__ = "0.3.36"
    fake.llama_supports_gpu_offload = lambda: True
    fake.llama_print_system_info = lambda: b"CUDA : ARCHS = 890 | USE_GRAPHS = 1 | CPU : AVX2 = 1 |"
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    b = probe(refresh=True).backends["llamacpp"]
    assert (b.available, b.gpu_offload, b.gpu_backend) == (True, True, "CUDA")
    assert b.reason == "llama-cpp-python 0.3.36, GPU offload via CUDA"


def test_parse_gpu_backend():
    assert parse_gpu_backend("CPU : SSE3 = 1 | AVX = 1 | LLAMAFILE = 1 | OPENMP = 1 |") is None
    assert parse_gpu_backend("Metal : EMBED_LIBRARY = 1 | CPU : NEON = 1 | ARM_FMA = 1 |") == "Metal"
    assert parse_gpu_backend("Vulkan : | CPU : AVX2 = 1 |") == "Vulkan"


def test_probe_runs_in_a_fresh_interpreter():
    """End to end, no patching: what ``localllm probe`` sees."""
    out = subprocess.run([sys.executable, "-c", "import json; from localllm.hardware import probe; "
                          "print(json.dumps(probe().as_dict()))"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["logical_cores"] == len(os.sched_getaffinity(0)) and d["ram_total"] > 0


def test_a_process_limited_to_one_core_plans_one_thread():
    """``taskset -c 0 localllm ...`` or a container's cpuset: the probe counts the cores the process may run on,
    so llama.cpp gets one thread, not one per core of the machine waiting for a core it cannot have."""
    code = ("import os, json; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from localllm.hardware import probe; from backends.llamacpp.checks import physical_cores; "
            "hw = probe(); print(json.dumps([hw.physical_cores, hw.logical_cores, physical_cores()]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [1, 1, 1]


# ------------------------------------------------------------------------------- `localllm probe`


def _cli(*args: str):
    from click.testing import CliRunner

    from localllm.cli import cli

    return CliRunner().invoke(cli, ["probe", *args], catch_exceptions=False)


def test_probe_command_reports_hardware_and_the_default_models_plan(default_model):
    r = _cli()
    assert r.exit_code == 0, r.output
    hw = probe()
    assert "Hardware" in r.output and hw.cpu_model in r.output
    assert f"{hw.physical_cores} physical / {hw.logical_cores} logical cores" in r.output
    assert "Plan for smollm2:135m (Q4_1, 30 layers)" in r.output
    where = "CUDA" if hw.nvidia_gpus and hw.backends["llamacpp"].gpu_offload else "CPU"
    assert f"llama.cpp on {where}" in r.output and "4,096-token context" in r.output
    assert "- backend llama.cpp" in r.output  # and why
    for note in hw.notes:
        assert note in r.output


def test_probe_command_json(default_model):
    r = _cli("--json", "--kv-cache-type", "q8_0")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert {"os", "cpu_model", "physical_cores", "simd", "ram_total", "gpus", "backends", "notes"} <= set(d)
    assert d["model"] == "smollm2:135m" and d["plan_error"] is None
    assert d["plan"]["kv_cache_type"] == "q8_0" and d["plan"]["flash_attn"] is True
    assert d["plan"]["n_layers"] == 30 and d["plan"]["memory"]["total"] > 0


def test_probe_command_local_file(default_model_path):
    r = _cli("--model", str(default_model_path), "--ctx", "8192")  # read in place
    assert r.exit_code == 0 and "8,192-token context" in r.output


def test_probe_command_refusals(home, installed_default_model, tmp_path):
    """In a home of its own holding the default model without MLX weights (whatever other tests built in
    the shared test home): an impossible context is refused; ``--backend mlx`` plans a conversion on first
    use where the GGUF converts and refuses, naming why, where it does not."""
    from tests.support import TEST_HOME, install_copy

    models = home / "data" / "models"
    install_copy(models, TEST_HOME / "data" / "models")
    manifest = models / "manifests" / "library" / "smollm2" / "135m.json"
    manifest.write_text(json.dumps(json.loads(manifest.read_text()) | {"mlx_path": None, "weights": {}}))
    r = _cli("--ctx", "9000")
    assert r.exit_code == 1 and "9,000-token context is more than" in r.output and "8,192 tokens" in r.output
    r = _cli("--backend", "mlx")
    if not probe().backends["mlx"].available:  # the test extras install mlx[cpu]: its half must run, not vanish
        pytest.skip(f"mlx is not installed here (pip install -e '.[test]'): {probe().backends['mlx'].reason}")
    assert r.exit_code == 0, r.output
    assert "backend MLX" in r.output and "its GGUF converts to MLX (once, offline" in r.output
    assert not (models / "mlx").exists()  # planning converts nothing
    tiny = tiny_gguf(tmp_path / "tiny-bloom.gguf", "bloom")
    r = _cli("--model", str(tiny), "--backend", "mlx")
    assert r.exit_code == 1
    assert "has no MLX weights and its GGUF cannot be converted to MLX" in r.output and "'bloom'" in r.output
    assert "--backend llamacpp" in r.output


def test_probe_command_backend_mlx_where_mlx_cannot_run(home, installed_default_model, monkeypatch):
    """Where MLX is missing, ``--backend mlx`` is refused in one sentence that says why (the probe is made to
    report it missing: the suite itself always has mlx[cpu])."""
    import dataclasses

    from backends.descriptor import BackendStatus
    from tests.support import TEST_HOME, install_copy

    install_copy(home / "data" / "models", TEST_HOME / "data" / "models")
    hw = probe()
    missing = BackendStatus("mlx", False, "No module named 'mlx'", False, label="MLX")
    monkeypatch.setattr(hardware, "probe", lambda refresh=False: dataclasses.replace(
        hw, backends={**hw.backends, "mlx": missing}))
    r = _cli("--backend", "mlx")
    assert r.exit_code == 1
    assert "--backend mlx cannot be used here: No module named 'mlx'" in r.output and "Traceback" not in r.output
    assert _cli().exit_code == 0  # the default choice still plans (llama.cpp)


def test_probe_command_without_the_model_installed(home):
    r = _cli()
    assert r.exit_code == 0
    # a catalog model not yet installed is planned from the catalog's facts, marked as an estimate (issue 48)
    assert "Hardware" in r.output and "Not installed; an estimate from the catalog" in r.output
    assert "`localllm pull smollm2:135m` gives the exact plan" in r.output
    d = json.loads(_cli("--json").output)
    assert d["plan"] is None and "Not installed" in d["plan_error"] and "98 MB Q4_1" in d["plan_error"]
