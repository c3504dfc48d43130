"""llama.cpp's own device list in the probe, GPUs the build cannot use (AMD, Intel through /sys/class/drm), and
the advice the planner gives for them.

The device list is the real one (ggml's registry in the installed wheel). There is no AMD or Intel GPU here:
a fake sysfs tree (``LOCALLLM_SYSFS_ROOT``) stands in for ``/sys``, laid out as the kernel lays it out (a
``card<N>/device`` link to the PCI device's directory, ``vendor``/``device``/``uevent`` and amdgpu's
``mem_info_vram_*``), and ``rocm-smi``/``vulkaninfo`` are small executables on PATH printing what the real tools
print. The probe's and the planner's own code run unpatched.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from localllm import gpus, hardware
from localllm.ggufinfo import read_gguf
from localllm.gpus import GPU, parse_rocm_smi, parse_vulkaninfo
from localllm.hardware import GiB, HardwareInfo, LlamaDevice, MiB, probe
from localllm.planner import CUDA_ADVICE, ROCM_ADVICE, SYCL_ADVICE, VULKAN_ADVICE, plan
from tests.test_planner import LLAMA31_8B, machine


@pytest.fixture(autouse=True)
def _fresh_cache():
    hardware._cache = None
    yield
    hardware._cache = None


def _card(root: Path, n: int, *, vendor: str, device: str, slot: str, driver: str, vram: int | None = None,
          used: int = 0, product: str | None = None) -> None:
    """``root/class/drm/card<n>/device`` → ``root/devices/pci0000:00/<slot>``, as sysfs has it."""
    pci = root / "devices" / "pci0000:00" / slot
    pci.mkdir(parents=True)
    (pci / "vendor").write_text(vendor + "\n")
    (pci / "device").write_text(device + "\n")
    (pci / "uevent").write_text(f"DRIVER={driver}\nPCI_CLASS=30000\nPCI_ID={vendor[2:]}:{device[2:]}\n"
                                f"PCI_SLOT_NAME={slot}\n")
    if vram is not None:
        (pci / "mem_info_vram_total").write_text(f"{vram}\n")
        (pci / "mem_info_vram_used").write_text(f"{used}\n")
    if product is not None:
        (pci / "product_name").write_text(product + "\n")
    card = root / "class" / "drm" / f"card{n}"
    card.mkdir(parents=True)
    (card / "device").symlink_to(os.path.relpath(pci, card))
    # what else sits there: a connector and a render node of the same device, which are not cards
    (root / "class" / "drm" / f"card{n}-DP-1").mkdir()
    (root / "class" / "drm" / f"renderD{128 + n}").mkdir()


def _amd(root: Path, n: int = 1, **kw) -> None:
    _card(root, n, vendor="0x1002", device="0x744c", slot="0000:03:00.0", driver="amdgpu", vram=16 * GiB,
          used=512 * MiB, **kw)


def _intel_igpu(root: Path, n: int = 0) -> None:
    _card(root, n, vendor="0x8086", device="0x46a6", slot="0000:00:02.0", driver="i915")


def _tools(monkeypatch, tmp_path: Path, **scripts: str) -> None:
    """PATH holds only the given tools (``rocm_smi="..."`` → an executable ``rocm-smi`` running that script; sh
    builtins only, since PATH has nothing else)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    for name, script in scripts.items():
        exe = bin_ / name.replace("_", "-")
        exe.write_text("#!/bin/sh\n" + script)
        exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(bin_))


def _sysfs(monkeypatch, tmp_path: Path) -> Path:
    root = tmp_path / "sys"
    root.mkdir()
    monkeypatch.setenv(gpus.SYSFS_ROOT_ENV, str(root))
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVML either: as on a machine with an AMD card only
    return root


def _local_offload(hw: HardwareInfo) -> bool:
    return any(d.offloads and not d.remote for d in hw.devices)


# ------------------------------------------------------------------------------- llama.cpp's devices


def test_real_device_list_has_the_cpu_with_this_machines_ram():
    psutil = pytest.importorskip("psutil")
    pytest.importorskip("llama_cpp")
    hw = probe(refresh=True)
    [cpu] = [d for d in hw.devices if d.type == "cpu"]
    assert cpu.name == "CPU" and cpu.backend == "CPU" and not cpu.offloads and not cpu.remote
    ram = psutil.virtual_memory().total
    assert abs(cpu.total_bytes - ram) <= ram * 0.10, (cpu.total_bytes, ram)
    assert 0 < cpu.free_bytes <= cpu.total_bytes
    assert [d.index for d in hw.devices] == list(range(len(hw.devices)))
    from backends.llamacpp import devices as ggml_devices
    assert hw.rpc == ggml_devices.rpc_supported()
    assert not any("device list" in n for n in hw.notes)


def test_probe_json_as_a_subprocess_lists_the_devices():
    out = subprocess.run([sys.executable, "-m", "localllm", "probe", "--json"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert isinstance(d["rpc"], bool)
    cpu = [x for x in d["devices"] if x["type"] == "cpu"]
    assert [x["name"] for x in cpu] == ["CPU"] and cpu[0]["total_bytes"] > 0
    assert {"index", "name", "description", "type", "free_bytes", "total_bytes", "backend", "offloads", "remote",
            "endpoint"} <= set(cpu[0])


def test_an_unreadable_device_list_is_a_note_not_a_crash(monkeypatch):
    from backends.llamacpp import devices as ggml_devices
    def broken():
        raise OSError("libggml.so: cannot open shared object file")

    monkeypatch.setattr(ggml_devices, "list_devices", broken)
    hw = probe(refresh=True)
    assert hw.devices == [] and hw.rpc is False
    assert "llama.cpp's device list not read: libggml.so: cannot open shared object file" in hw.notes
    assert hw.ram_total > 0  # the rest of the probe is there


def test_probe_command_shows_the_devices(default_model):
    from click.testing import CliRunner

    from localllm.cli import cli

    r = CliRunner().invoke(cli, ["probe"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    hw = probe()
    assert hw.devices and f"llama.cpp build: RPC {'yes' if hw.rpc else 'no'}" in r.output
    section = r.output.split("Devices", 1)[1].split("Notes", 1)[0]
    for d in hw.devices:
        assert d.name in section and d.type in section and d.description in section


def test_remote_devices_are_marked_with_their_endpoint():
    from localllm.cli.probe import _device_rows

    hw = HardwareInfo("Linux", "x86_64", "cpu", 2, 2, [], 8 * GiB, 8 * GiB, devices=[
        LlamaDevice(0, "CPU", "AMD EPYC", "cpu", 8 * GiB, 8 * GiB, "CPU"),
        LlamaDevice(1, "RPC0", "10.0.0.2:50052", "gpu", 20 * GiB, 24 * GiB, "RPC", offloads=True, remote=True,
                    endpoint="10.0.0.2:50052")], rpc=True)
    assert _device_rows(hw) == [("CPU", "cpu", "AMD EPYC", "8.0 GiB free of 8.0 GiB"),
                                ("RPC0", "gpu", "remote, RPC worker 10.0.0.2:50052", "20.0 GiB free of 24.0 GiB")]


# ------------------------------------------------------------------------------------ sysfs GPUs


def test_an_amd_card_in_sysfs_is_listed_and_the_plan_advises_rocm(monkeypatch, tmp_path, default_model_path):
    root = _sysfs(monkeypatch, tmp_path)
    _amd(root)
    _tools(monkeypatch, tmp_path)  # neither rocm-smi nor vulkaninfo
    hw = probe(refresh=True)
    [g] = hw.gpus
    assert (g.vendor, g.name, g.pci_id, g.driver) == ("amd", "AMD GPU [1002:744c]", "1002:744c", "amdgpu")
    assert (g.total_bytes, g.free_bytes, g.integrated) == (16 * GiB, 16 * GiB - 512 * MiB, False)
    assert not hw.nvidia_gpus
    if _local_offload(hw):
        pytest.skip("hardware: this llama.cpp build offloads to a GPU here")
    p = plan(read_gguf(default_model_path), hw)
    assert p.device == "cpu" and p.n_gpu_layers == 0
    about = [r for r in p.reasons if "AMD" in r]
    assert len(about) == 1 and "found, but this llama.cpp build is CPU-only" in about[0]
    assert about[0].startswith("backend llama.cpp on the CPU: AMD GPU [1002:744c] (16.0 GiB)")
    assert p.advice and ROCM_ADVICE in p.advice and VULKAN_ADVICE in p.advice and CUDA_ADVICE not in p.advice
    assert 'CMAKE_ARGS="-DGGML_HIP=on" pip install --force-reinstall --no-cache-dir llama-cpp-python==0.3.36' \
        in p.advice


def test_probe_command_with_an_amd_card(monkeypatch, tmp_path, default_model):
    from click.testing import CliRunner

    from localllm.cli import cli

    root = _sysfs(monkeypatch, tmp_path)
    _amd(root)
    _tools(monkeypatch, tmp_path)
    r = CliRunner().invoke(cli, ["probe"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "AMD GPU [1002:744c]: 15.5 GiB free of 16.0 GiB (driver amdgpu)" in r.output
    if _local_offload(probe()):
        pytest.skip("hardware: this llama.cpp build offloads to a GPU here")
    assert "Advice" in r.output and ROCM_ADVICE in r.output
    d = json.loads(CliRunner().invoke(cli, ["probe", "--json"], catch_exceptions=False).output)
    assert [(g["vendor"], g["total_bytes"]) for g in d["gpus"]] == [("amd", 16 * GiB)]
    assert ROCM_ADVICE in d["plan"]["advice"]


def test_an_intel_igpu_gets_vulkan_advice(monkeypatch, tmp_path, default_model_path):
    root = _sysfs(monkeypatch, tmp_path)
    _intel_igpu(root)
    _tools(monkeypatch, tmp_path)
    hw = probe(refresh=True)
    [g] = hw.gpus
    assert (g.vendor, g.integrated, g.total_bytes, g.driver) == ("intel", True, 0, "i915")
    if _local_offload(hw):
        pytest.skip("hardware: this llama.cpp build offloads to a GPU here")
    p = plan(read_gguf(default_model_path), hw)
    assert p.device == "cpu"
    assert [r for r in p.reasons if "Intel" in r] == [
        "backend llama.cpp on the CPU: Intel GPU [8086:46a6] (integrated) found, but this llama.cpp build is "
        "CPU-only"]
    assert p.advice and VULKAN_ADVICE in p.advice and SYCL_ADVICE in p.advice and ROCM_ADVICE not in p.advice


def test_tools_name_the_cards_and_an_igpu_beside_a_discrete_gpu_gets_no_advice(monkeypatch, tmp_path):
    root = _sysfs(monkeypatch, tmp_path)
    _intel_igpu(root, 0)
    _amd(root, 1)
    _tools(monkeypatch, tmp_path,
           rocm_smi='echo "============ ROCm System Management Interface ============"\n'
                    'printf "GPU[0]\\t\\t: Card Series: \\t\\tNavi31 [Radeon RX 7900 XTX]\\n"\n'
                    'printf "GPU[0]\\t\\t: Card Model: \\t\\t0x744c\\n"\n'
                    'printf "GPU[0]\\t\\t: GFX Version: \\t\\tgfx1100\\n"\n',
           vulkaninfo='printf "Devices:\\n========\\nGPU0:\\n\\tvendorID           = 0x8086\\n'
                      '\\tdeviceID           = 0x46a6\\n\\tdeviceType         = PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU\\n'
                      '\\tdeviceName         = Intel(R) UHD Graphics (ADL GT2)\\nGPU1:\\n\\tvendorID = 0x10005\\n'
                      '\\tdeviceID = 0x0000\\n\\tdeviceType = PHYSICAL_DEVICE_TYPE_CPU\\n'
                      '\\tdeviceName = llvmpipe\\n"\n')
    hw = probe(refresh=True)
    assert [(g.index, g.vendor, g.name, g.integrated, g.gfx_target) for g in hw.gpus] == [
        (0, "intel", "Intel(R) UHD Graphics (ADL GT2)", True, None),
        (1, "amd", "AMD Navi31 [Radeon RX 7900 XTX]", False, "gfx1100")]
    if _local_offload(hw):
        pytest.skip("hardware: this llama.cpp build offloads to a GPU here")
    p = plan(LLAMA31_8B, hw)
    assert p.advice and "-DGPU_TARGETS=gfx1100" in p.advice and ROCM_ADVICE in p.advice
    assert "Your Intel" not in p.advice and SYCL_ADVICE not in p.advice  # the iGPU is not worth it beside the card


def test_nvidia_in_sysfs_is_skipped_when_nvml_listed_it(monkeypatch, tmp_path):
    from tests.test_hardware import _fake_nvml

    root = _sysfs(monkeypatch, tmp_path)
    _card(root, 0, vendor="0x10de", device="0x2684", slot="0000:01:00.0", driver="nvidia")
    _amd(root, 1)
    _tools(monkeypatch, tmp_path)
    _fake_nvml(monkeypatch, gpus=[{"name": b"NVIDIA GeForce RTX 4090", "total": 24564 * MiB, "free": 23000 * MiB,
                                   "cc": (8, 9)}])
    hw = probe(refresh=True)
    assert [(g.index, g.vendor, g.name) for g in hw.gpus] == [(0, "nvidia", "NVIDIA GeForce RTX 4090"),
                                                              (1, "amd", "AMD GPU [1002:744c]")]
    monkeypatch.setitem(sys.modules, "pynvml", None)  # no NVML: sysfs is the only one to see the NVIDIA card
    hw = probe(refresh=True)
    assert [(g.vendor, g.name, g.total_bytes) for g in hw.gpus] == [("nvidia", "NVIDIA GPU [10de:2684]", 0),
                                                                    ("amd", "AMD GPU [1002:744c]", 16 * GiB)]
    assert any("NVIDIA GPU is in /sys/class/drm, but NVML and nvidia-smi cannot read it" in n for n in hw.notes)


def test_no_drm_directory_is_a_note(monkeypatch, tmp_path):
    _sysfs(monkeypatch, tmp_path)
    _tools(monkeypatch, tmp_path)
    hw = probe(refresh=True)
    assert hw.gpus == []
    assert f"no {tmp_path / 'sys' / 'class' / 'drm'} (no GPU driver loaded, or a container without it)" in hw.notes


def test_a_hanging_tool_is_timed_out(monkeypatch, tmp_path):
    root = _sysfs(monkeypatch, tmp_path)
    _amd(root)
    monkeypatch.setattr(gpus, "GPU_TOOL_TIMEOUT_S", 0.5)
    _tools(monkeypatch, tmp_path, rocm_smi="while :; do :; done\n", vulkaninfo="exit 3\n")
    [g] = probe(refresh=True).gpus
    assert g.name == "AMD GPU [1002:744c]" and g.total_bytes == 16 * GiB
    notes = probe().notes
    assert "rocm-smi did not answer within 0.5 s" in notes
    assert any(n.startswith("vulkaninfo failed") for n in notes)


def test_parsers():
    assert parse_rocm_smi("GPU[1]\t\t: Card series: \t\tVega 20\nGPU[0]\t\t: Card series: \t\tNavi 21\n") == [
        {"card series": "Navi 21"}, {"card series": "Vega 20"}]
    assert parse_vulkaninfo("no GPUs") == {}
    assert parse_vulkaninfo("GPU0:\n\tvendorID = 0x1002\n\tdeviceID = 0x164e\n"
                            "\tdeviceType = PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU\n\tdeviceName = AMD Radeon Graphics\n"
                            ) == {("0x1002", "0x164e"): ("AMD Radeon Graphics", True)}


# --------------------------------------------------------------------------- advice, simulated builds


AMD_7900 = GPU(1, "AMD Radeon RX 7900 XTX", "amd", 24 * GiB, 23 * GiB, "amdgpu", pci_id="1002:744c")


def test_a_cuda_build_on_an_amd_card_advises_rocm():
    p = plan(LLAMA31_8B, machine(ram_gib=32, gpus=[AMD_7900], offload="CUDA"))
    assert p.device == "cpu"
    assert ("backend llama.cpp on the CPU: the build offloads via CUDA, but no such GPU was found "
            "(GPUs: AMD Radeon RX 7900 XTX (24.0 GiB))") in p.reasons
    assert p.advice and "this llama.cpp build offloads via CUDA only" in p.advice and ROCM_ADVICE in p.advice


def test_no_llama_cpp_and_an_amd_card_advises_rocm_instead_of_the_cpu_wheel():
    p = plan(LLAMA31_8B, machine(ram_gib=32, gpus=[AMD_7900], llama=False))
    assert p.advice and ROCM_ADVICE in p.advice and "pip install llama-cpp-python==" not in p.advice


def test_a_vulkan_build_drives_the_amd_card_and_gets_no_install_advice():
    p = plan(LLAMA31_8B, machine(ram_gib=32, gpus=[AMD_7900], offload="Vulkan"))
    assert not p.advice or ROCM_ADVICE not in p.advice
    assert any("offloads via Vulkan to AMD Radeon RX 7900 XTX" in r for r in p.reasons)
