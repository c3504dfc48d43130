"""Planner decisions a user would notice, on simulated machines and real model metadata.

Machines are built as ``HardwareInfo`` directly (this machine has no GPU). Models are the real
default model (its GGUF read by ``read_gguf``) and ``GGUFInfo`` built from the published metadata of
popular GGUFs (bartowski's Q4_K_M files; config.json of each model). The memory arithmetic is
checked against llama.cpp's own buffer sizes for the default model.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from backends.descriptor import BackendStatus
from localllm.errors import PlanError
from localllm.ggufinfo import GGUFInfo, read_gguf
from localllm.gpus import GPU
from localllm.hardware import GiB, HardwareInfo, MiB, probe
from localllm.mlxmodels import MLXWeights, mlx_weights
from localllm.planner import CUDA_OVERHEAD, GPU_MARGIN, HOST_OVERHEAD, estimate, plan

HAS_MLX = {"mlx": MLXWeights(installed=True)}  # the planner's answer for a model whose MLX weights are installed


def meta(name: str, *, size: int, layers: int, embd: int, heads: int, kv_heads: int, head_dim: int, ctx: int,
         vocab: int, params: int, sliding_window: int | None = None, arch: str = "llama") -> GGUFInfo:
    return GGUFInfo(path=f"/nonexistent/{name}.gguf", file_size=size, architecture=arch, name=name, n_layers=layers,
                    n_embd=embd, n_head=heads, n_head_kv=kv_heads, head_dim_k=head_dim, head_dim_v=head_dim,
                    context_length=ctx, vocab_size=vocab, file_type="Q4_K_M", parameters=params, chat_template=None,
                    license=None, sliding_window=sliding_window)


# bartowski/Meta-Llama-3.1-8B-Instruct-GGUF Q4_K_M: 4.92 GB; 32 layers, 8 KV heads of 128
LLAMA31_8B = meta("Llama 3.1 8B", size=4_920_739_232, layers=32, embd=4096, heads=32, kv_heads=8, head_dim=128,
                  ctx=131072, vocab=128256, params=8_030_261_248)
# bartowski/Meta-Llama-3.1-70B-Instruct-GGUF Q4_K_M: 42.5 GB; 80 layers
LLAMA31_70B = meta("Llama 3.1 70B", size=42_520_395_584, layers=80, embd=8192, heads=64, kv_heads=8, head_dim=128,
                   ctx=131072, vocab=128256, params=70_553_706_496)
# bartowski/Llama-3.2-1B-Instruct-GGUF Q4_K_M: 0.81 GB; 16 layers, head dim 64
LLAMA32_1B = meta("Llama 3.2 1B", size=807_690_656, layers=16, embd=2048, heads=32, kv_heads=8, head_dim=64,
                  ctx=131072, vocab=128256, params=1_235_814_400)
# bartowski/Qwen2.5-7B-Instruct-GGUF Q4_K_M: 4.68 GB; 28 layers, 4 KV heads of 128
QWEN25_7B = meta("Qwen2.5 7B", size=4_683_073_184, layers=28, embd=3584, heads=28, kv_heads=4, head_dim=128,
                 ctx=32768, vocab=152064, params=7_615_616_512, arch="qwen2")
# bartowski/Qwen2.5-14B-Instruct-GGUF Q4_K_M: 8.99 GB; 48 layers, 8 KV heads of 128
QWEN25_14B = meta("Qwen2.5 14B", size=8_988_110_976, layers=48, embd=5120, heads=40, kv_heads=8, head_dim=128,
                  ctx=32768, vocab=152064, params=14_770_033_664, arch="qwen2")
# bartowski/google_gemma-3-4b-it-GGUF Q4_K_M: 2.49 GB; 34 layers, 4 KV heads of 256, sliding window 1024
GEMMA3_4B = meta("Gemma 3 4B", size=2_489_757_856, layers=34, embd=2560, heads=8, kv_heads=4, head_dim=256,
                 ctx=131072, vocab=262144, params=3_880_263_168, sliding_window=1024, arch="gemma3")


def _backends(*, llama=True, offload=None, mlx=False, mlx_metal=False) -> dict[str, BackendStatus]:
    return {
        "llamacpp": BackendStatus("llamacpp", llama, "llama-cpp-python 0.3.36" if llama else "not importable",
                                  bool(offload), "", gpu_backend=offload),
        "mlx": BackendStatus("mlx", mlx, "mlx 0.32.4 with mlx-lm" if mlx else "mlx is not importable", mlx_metal,
                             "", gpu_backend="Metal" if mlx_metal else None),
    }


def machine(*, ram_gib: float, cores: int = 8, gpus=(), apple=False, metal_budget=None, **backends) -> HardwareInfo:
    ram = int(ram_gib * GiB)
    return HardwareInfo(os="Darwin" if apple else "Linux", arch="arm64" if apple else "x86_64", cpu_model="test CPU",
                        physical_cores=cores, logical_cores=cores * 2, simd=["avx2"], ram_total=ram,
                        ram_available=ram * 3 // 4, gpus=list(gpus), apple_silicon=apple, metal_budget=metal_budget,
                        backends=_backends(**backends),
                        notes=[] if gpus or apple else ["NVML not available: simulated", "nvidia-smi not found"])


RTX_4090 = GPU(0, "NVIDIA GeForce RTX 4090", "nvidia", 24564 * MiB, 23900 * MiB, "550.54.14", "8.9")
RTX_4060 = GPU(0, "NVIDIA GeForce RTX 4060", "nvidia", 8188 * MiB, 7800 * MiB, "550.54.14", "8.9")


@pytest.fixture
def desktop_4090():
    return machine(ram_gib=64, cores=16, gpus=[RTX_4090], offload="CUDA")


@pytest.fixture
def desktop_8gb():
    return machine(ram_gib=32, gpus=[RTX_4060], offload="CUDA")


@pytest.fixture
def laptop():
    """A CPU-only laptop: 16 GB RAM, 8 cores, no GPU."""
    return machine(ram_gib=16, cores=8)


def mac16(**kw) -> HardwareInfo:
    """A 16 GB M-series Mac; no budget from MLX, so the 2/3-of-RAM rule applies."""
    kw.setdefault("offload", "Metal")
    return machine(ram_gib=16, apple=True, **kw)


def line(p, word: str) -> str:
    """The reason line that starts with ``word`` (else the first that mentions it)."""
    found = [r for r in p.reasons if r.startswith(word)] or [r for r in p.reasons if word in r]
    assert found, f"no reason mentions {word!r}: {p.reasons}"
    return found[0]


# ----------------------------------------------------------------------------------- NVIDIA cards


def test_8b_on_a_24gb_card_goes_entirely_on_the_gpu(desktop_4090):
    p = plan(LLAMA31_8B, desktop_4090)
    assert (p.backend, p.device, p.verdict, p.verdict_text) == ("llamacpp", "cuda", "gpu", "fits on GPU")
    assert p.n_gpu_layers == 33  # 32 layers + the output layer
    assert p.n_ctx == 4096 and p.n_threads == 16 and p.advice is None
    assert p.memory.gpu <= RTX_4090.free_bytes - GPU_MARGIN
    assert "all 32 layers" in line(p, "on the GPU")
    assert p.flash_attn is True and "the GPU kernels cover head size 128" in line(p, "flash attention")


def test_the_flash_attention_setting_is_honoured_on_a_gpu_too(desktop_4090):
    """``LOCALLLM_FLASH_ATTENTION=off`` turns it off where the GPU kernels would run it (it was ignored there: the
    head-size rule came first), and the plan counts the attention buffer that then takes GPU memory."""
    on, off = plan(LLAMA31_8B, desktop_4090), plan(LLAMA31_8B, desktop_4090, flash_attn="off")
    assert off.flash_attn is False and "LOCALLLM_FLASH_ATTENTION=off" in line(off, "flash attention")
    assert off.memory.gpu > on.memory.gpu
    assert plan(LLAMA31_8B, desktop_4090, flash_attn="off", kv_cache_type="q8_0").flash_attn is True


def test_8b_on_an_8gb_card_with_32k_context_is_partial(desktop_8gb):
    p = plan(LLAMA31_8B, desktop_8gb, num_ctx=32768)
    assert p.verdict == "partial" and p.n_ctx == 32768
    assert 0 < p.n_gpu_layers < 32
    assert p.verdict_text == f"partial offload {p.n_gpu_layers}/33 layers"  # llama.cpp counts the output layer
    budget = RTX_4060.free_bytes - GPU_MARGIN
    # as many layers as fit, and not one more
    assert p.memory.gpu <= budget
    assert estimate(LLAMA31_8B, 32768, "f16", p.n_gpu_layers + 1, flash_attn=p.flash_attn).gpu > budget
    assert "the rest run on the CPU" in line(p, "layers and the output layer (-ngl")


def test_8b_on_an_8gb_card_at_the_default_context_fits(desktop_8gb):
    p = plan(LLAMA31_8B, desktop_8gb)
    assert p.verdict == "gpu" and p.n_ctx == 4096
    assert p.max_ctx and 4096 <= p.max_ctx < 32768  # and it says how far the context could go


def test_70b_on_a_24gb_card_is_partial_and_fits_in_ram(desktop_4090):
    p = plan(LLAMA31_70B, desktop_4090)
    assert p.verdict == "partial" and 30 <= p.n_gpu_layers <= 50


def test_num_gpu_is_honoured(desktop_4090):
    p = plan(LLAMA31_8B, desktop_4090, num_gpu=10)
    assert (p.verdict, p.n_gpu_layers, p.verdict_text) == ("partial", 10, "partial offload 10/33 layers")
    assert "num_gpu 10" in line(p, "9 of 32 layers and the output layer (-ngl 10) on the GPU")
    p0 = plan(LLAMA31_8B, desktop_4090, num_gpu=0)
    assert (p0.device, p0.verdict, p0.n_gpu_layers, p0.memory.gpu) == ("cpu", "cpu", 0, 0)


def test_num_gpu_beyond_the_card_is_honoured_with_a_warning(desktop_8gb):
    p = plan(LLAMA31_70B, desktop_8gb, num_gpu=81)
    assert p.n_gpu_layers == 81 and p.verdict == "gpu"
    assert "loading may fail" in line(p, "num_gpu 81")


def test_two_gpus_add_up(desktop_8gb):
    two = machine(ram_gib=32, gpus=[RTX_4060, GPU(1, "NVIDIA GeForce RTX 4060", "nvidia", 8188 * MiB, 7800 * MiB)],
                  offload="CUDA")
    one = plan(LLAMA31_8B, desktop_8gb, num_ctx=32768)
    both = plan(LLAMA31_8B, two, num_ctx=32768)
    assert both.n_gpu_layers > one.n_gpu_layers


def test_cpu_only_build_with_an_nvidia_gpu_says_how_to_get_cuda():
    hw = machine(ram_gib=64, gpus=[RTX_4090], offload=None)
    p = plan(LLAMA31_8B, hw)
    assert (p.device, p.verdict, p.n_gpu_layers) == ("cpu", "cpu", 0)
    assert "CPU-only" in line(p, "backend")
    assert p.advice is not None
    cmd = 'CMAKE_ARGS="-DGGML_CUDA=on" pip install --force-reinstall --no-cache-dir llama-cpp-python==0.3.36'
    assert cmd in p.advice
    assert "nvcc" in p.advice and "CUDA toolkit" in p.advice
    assert "-DCMAKE_CUDA_ARCHITECTURES=89" in p.advice  # from the card's compute capability


def test_gpu_build_without_a_gpu_runs_on_the_cpu(laptop):
    hw = machine(ram_gib=16, offload="CUDA")
    p = plan(LLAMA31_8B, hw)
    assert p.device == "cpu" and "no such GPU" in line(p, "backend")


# ------------------------------------------------------------------------------------ CPU machines


def test_70b_on_a_laptop_does_not_fit_and_says_by_how_much(laptop):
    p = plan(LLAMA31_70B, laptop)
    assert (p.verdict, p.verdict_text) == ("too_big", "does not fit")
    why = line(p, "does not fit")
    need = float(re.search(r"needs ([\d.]+) GiB", why).group(1))
    assert need > 39 and "16.0 GiB total" in why  # the 39.6 GiB of weights alone
    assert p.max_ctx is None


def test_8b_on_a_laptop_runs_on_the_cpu(laptop):
    p = plan(LLAMA31_8B, laptop)
    assert (p.backend, p.device, p.verdict, p.verdict_text) == ("llamacpp", "cpu", "cpu", "CPU")
    # off on the CPU: its kernel takes a short batch's cached keys one at a time (a next turn at depth: ~6x)
    assert p.n_threads == 8 and p.flash_attn is False
    assert "flash attention off on the CPU" in line(p, "flash attention")
    on = plan(LLAMA31_8B, laptop, flash_attn="on")  # LOCALLLM_FLASH_ATTENTION=on
    assert on.flash_attn is True and "LOCALLLM_FLASH_ATTENTION=on" in line(on, "flash attention")
    embed = plan(replace(LLAMA31_8B, pooling="mean"), laptop)  # a pooling model's whole-input batches: the tiled kernel
    assert embed.flash_attn is True and "pooling model" in line(embed, "flash attention")
    off = plan(LLAMA31_8B, laptop, flash_attn="off")  # LOCALLLM_FLASH_ATTENTION=off: the next turn at depth
    assert off.flash_attn is False and "LOCALLLM_FLASH_ATTENTION=off" in line(off, "flash attention")
    q8 = plan(LLAMA31_8B, laptop, flash_attn="off", kv_cache_type="q8_0")  # a quantized V cache needs it
    assert q8.flash_attn is True
    assert "no usable GPU (NVML not available: simulated; nvidia-smi not found)" in line(p, "backend")


def test_default_context_shrinks_when_ram_is_tight():
    e4096 = estimate(LLAMA31_8B, 4096, "f16", 0)
    e2048 = estimate(LLAMA31_8B, 2048, "f16", 0)
    ram = (e4096.cpu + e2048.cpu) // 2 + GiB  # room for 2048 tokens, not for 4096 (1 GiB is kept for the OS)
    p = plan(LLAMA31_8B, machine(ram_gib=ram / GiB))
    assert p.verdict == "cpu" and p.n_ctx == 2048
    assert "reduced from 4,096" in line(p, "context")


def test_explicit_context_too_big_for_memory_is_refused_with_numbers(laptop):
    with pytest.raises(PlanError) as e:
        plan(LLAMA31_8B, laptop, num_ctx=131072)
    msg = str(e.value)
    assert "131,072-token context does not fit" in msg and "16.0 GiB KV cache" in msg
    most = int(re.search(r"at most about ([\d,]+) tokens", msg).group(1).replace(",", ""))
    assert plan(LLAMA31_8B, laptop, num_ctx=most).verdict == "cpu"  # the number it gives works
    with pytest.raises(PlanError):
        plan(LLAMA31_8B, laptop, num_ctx=most + 1024)


def test_explicit_context_beyond_training_is_refused(laptop):
    with pytest.raises(PlanError, match=r"40,000-token context is more than Qwen2.5 7B was trained for \(32,768"):
        plan(QWEN25_7B, laptop, num_ctx=40000)


def test_a_model_too_big_at_any_context_is_a_verdict_not_an_error(laptop):
    p = plan(LLAMA31_70B, laptop, num_ctx=2048)
    assert p.verdict == "too_big"


# -------------------------------------------------------------------------------------- KV cache


def test_q8_0_kv_halves_the_kv_estimate_and_turns_on_flash_attention(laptop):
    f16 = plan(LLAMA31_8B, laptop, num_ctx=8192, num_parallel=1)
    q8 = plan(LLAMA31_8B, laptop, num_ctx=8192, kv_cache_type="q8_0", num_parallel=1)
    assert f16.memory.kv_cache == 8192 * 128 * 1024  # 128 KiB per token: 1 GiB at 8k
    assert q8.memory.kv_cache == f16.memory.kv_cache * 34 // 64  # q8_0 blocks: 34 bytes per 32 values
    assert q8.flash_attn is True  # a quantized V cache needs it (f16 on the CPU: off)
    assert "needs it for a quantized (q8_0) V cache" in line(q8, "flash attention")
    assert "quantized (q8_0) V cache" in line(q8, "flash attention")
    q4 = plan(LLAMA31_8B, laptop, num_ctx=8192, kv_cache_type="q4_0", num_parallel=1)
    assert q4.memory.kv_cache == f16.memory.kv_cache * 18 // 64 and q4.flash_attn


def test_quantized_kv_lets_more_layers_onto_a_small_card(desktop_8gb):
    f16 = plan(LLAMA31_8B, desktop_8gb, num_ctx=32768)
    q8 = plan(LLAMA31_8B, desktop_8gb, num_ctx=32768, kv_cache_type="q8_0")
    assert q8.n_gpu_layers > f16.n_gpu_layers


def test_qwen_kv_per_token(desktop_8gb):
    p = plan(QWEN25_7B, desktop_8gb)
    assert p.verdict == "gpu"
    assert "56.0 KiB per token" in line(p, "KV cache f16")  # 28 layers × 4 heads × (128+128) × 2 bytes


def test_sliding_window_models_are_noted(desktop_8gb):
    p = plan(GEMMA3_4B, desktop_8gb)
    assert "window 1,024" in line(p, "sliding-window")


def test_unknown_kv_type_is_refused(laptop):
    with pytest.raises(PlanError, match="KV cache type 'q5_1' is not one of f16, q8_0, q4_0"):
        plan(LLAMA31_8B, laptop, kv_cache_type="q5_1")


# ----------------------------------------------------------------------------------------- Apple


def test_mac_with_mlx_and_an_mlx_build_picks_mlx():
    hw = mac16(mlx=True, mlx_metal=True)
    p = plan(LLAMA31_8B, hw, weights=HAS_MLX)
    assert (p.backend, p.device, p.verdict) == ("mlx", "metal", "gpu")
    assert "Metal working-set budget" in line(p, "unified memory")
    assert "10.7 GiB" in line(p, "unified memory")  # 2/3 of 16 GiB


def test_mac_without_mlx_falls_back_to_llamacpp_metal_and_says_why():
    p = plan(LLAMA31_8B, mac16(), weights=HAS_MLX)
    assert (p.backend, p.device, p.verdict) == ("llamacpp", "metal", "gpu")
    assert "mlx is not importable" in line(p, "MLX not used")
    assert "localllm[mlx]" in (p.advice or "")


def test_mac_without_an_mlx_build_uses_llamacpp_metal():
    p = plan(LLAMA31_8B, mac16(mlx=True, mlx_metal=True))
    assert (p.backend, p.device) == ("llamacpp", "metal")
    assert "no MLX build" in line(p, "MLX not used")


def test_mac_model_over_the_metal_budget_falls_back_to_llamacpp():
    hw = mac16(mlx=True, mlx_metal=True)
    p = plan(QWEN25_14B, hw, weights=HAS_MLX, num_ctx=16384)
    assert p.backend == "llamacpp" and p.device == "metal"
    assert "more than the 10.7 GiB Metal working-set budget" in line(p, "MLX not used")
    assert p.verdict == "partial"


def test_metal_budget_from_the_probe_is_used():
    hw = mac16(mlx=True, mlx_metal=True, metal_budget=4 * GiB)
    p = plan(LLAMA31_8B, hw, weights=HAS_MLX)
    assert p.backend == "llamacpp" and p.verdict == "partial"


# ------------------------------------------------------------- Apple: MLX weights, conversion, fallback
# The four cases a Mac meets, on simulated Apple probes: MLX weights installed / a GGUF that converts /
# one that does not / too big for the Metal budget. MLXWeights is what mlx_weights() reports for a model.

INSTALLED = MLXWeights(installed=True, weights_bytes=4_520_000_000, source="mlx-community/X-4bit@1a2b3c4d5e6f")
CONVERTS = MLXWeights(convertible=True, weights_bytes=5_100_000_000,
                      source="Q4_K requantized 4-bit, Q6_K requantized 8-bit")
REFUSED = MLXWeights(why_not="The MLX converter does not handle the 'mamba' architecture (it handles gemma3, "
                             "llama, phi3, qwen2, qwen3; Mistral GGUFs are 'llama')")


def test_mac_with_mlx_weights_installed_picks_mlx_and_says_which():
    p = plan(LLAMA31_8B, mac16(mlx=True, mlx_metal=True), weights={"mlx": INSTALLED})
    assert (p.backend, p.device, p.verdict, p.mlx_convert) == ("mlx", "metal", "gpu", False)
    assert "MLX weights of Llama 3.1 8B installed (mlx-community/X-4bit@1a2b3c4d5e6f)" in line(p, "backend MLX")
    assert p.memory.weights == INSTALLED.weights_bytes  # the MLX directory's size, not the GGUF's
    assert "the installed MLX directory" in line(p, "MLX weights")


def test_mac_with_a_convertible_gguf_picks_mlx_and_converts_on_first_use():
    p = plan(LLAMA31_8B, mac16(mlx=True, mlx_metal=True), weights={"mlx": CONVERTS})
    assert (p.backend, p.device, p.verdict, p.mlx_convert) == ("mlx", "metal", "gpu", True)
    why = line(p, "backend MLX")
    assert "its GGUF converts to MLX (once, offline, before the first load: Q4_K requantized 4-bit" in why
    assert p.memory.weights == CONVERTS.weights_bytes  # the requantized size counts, not the file's
    assert "requantized tensors counted" in line(p, "MLX weights")
    assert p.as_dict()["mlx_convert"] is True


def test_mac_with_a_gguf_that_does_not_convert_uses_llamacpp_metal_and_says_why():
    p = plan(LLAMA31_8B, mac16(mlx=True, mlx_metal=True), weights={"mlx": REFUSED})
    assert (p.backend, p.device, p.mlx_convert) == ("llamacpp", "metal", False)
    assert "does not handle the 'mamba' architecture" in line(p, "MLX not used")
    assert line(p, "backend llama.cpp on Metal")
    with pytest.raises(PlanError, match="--backend mlx cannot run Llama 3.1 8B: no MLX weights are installed for "
                                        "it and the MLX converter does not handle the 'mamba' architecture"):
        plan(LLAMA31_8B, mac16(mlx=True, mlx_metal=True), backend="mlx", weights={"mlx": REFUSED})


def test_mac_model_too_big_for_the_metal_budget_uses_llamacpp_whichever_mlx_it_has():
    for mw in (MLXWeights(installed=True, weights_bytes=8_300_000_000, source="mlx-community/Qwen2.5-14B-4bit"),
               MLXWeights(convertible=True, weights_bytes=9_400_000_000)):
        p = plan(QWEN25_14B, mac16(mlx=True, mlx_metal=True), weights={"mlx": mw}, num_ctx=16384)
        assert (p.backend, p.device, p.mlx_convert) == ("llamacpp", "metal", False)
        assert "Metal working-set budget" in line(p, "MLX not used") and p.verdict == "partial"


def test_the_requantized_size_decides_the_fit():
    """A conversion bigger than the GGUF (float32 scales on the CPU, 8-bit Q6_K tensors) is counted as it is."""
    hw = mac16(mlx=True, mlx_metal=True, metal_budget=int(6.2 * GiB))
    small = plan(LLAMA31_8B, hw, weights={"mlx": MLXWeights(convertible=True, weights_bytes=4_400_000_000)})
    big = plan(LLAMA31_8B, hw, weights={"mlx": MLXWeights(convertible=True, weights_bytes=6_300_000_000)})
    assert small.backend == "mlx" and big.backend == "llamacpp"
    # each conversion's own size is what was weighed: 4.4 GB is 4.1 GiB; 6.3 GB of weights make 6.6 GiB in all
    assert "MLX weights 4.1 GiB: the conversion's size" in line(small, "MLX weights")
    assert "MLX needs 6.6 GiB, more than the 6.2 GiB Metal working-set budget" in line(big, "MLX not used")


def test_backend_mlx_converts_a_convertible_gguf_anywhere():
    p = plan(LLAMA32_1B, machine(ram_gib=16, mlx=True), backend="mlx", weights={"mlx": CONVERTS})
    assert (p.backend, p.device, p.mlx_convert) == ("mlx", "cpu", True)
    assert "asked for with --backend mlx; its GGUF converts" in line(p, "backend MLX")


def test_mlx_weights_of_real_models(default_model, gemma_model, tmp_path):
    """What mlx_weights() says on a simulated Mac for the two real models (their GGUF headers), and that
    the Linux laptop case asks nothing (no header read)."""
    from dataclasses import replace

    from localllm.formats import Weights

    mac = mac16(mlx=True, mlx_metal=True)
    smol = replace(default_model, weights={})
    mw = mlx_weights(smol, mac)
    assert mw.convertible and not mw.installed and "Q4_1 kept 4-bit" in mw.source
    assert mw.weights_bytes and mw.weights_bytes > 0.9 * default_model.size  # f16 scales on Metal
    on_cpu = mlx_weights(smol, machine(ram_gib=16, mlx=True), backend="mlx")
    assert on_cpu.weights_bytes > mw.weights_bytes  # float32 scales on the CPU
    gem = mlx_weights(replace(gemma_model, weights={}), mac)
    assert gem.convertible and "Q4_K requantized 4-bit" in gem.source and "Q6_K requantized 8-bit" in gem.source
    p = plan(GGUFInfo(**gemma_model.info), mac, weights={"mlx": gem})
    assert p.backend == "mlx" and p.mlx_convert and p.memory.weights == gem.weights_bytes
    assert mlx_weights(smol, machine(ram_gib=16)) == MLXWeights()  # Linux, no --backend mlx: not asked
    d = tmp_path / "mlx"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"x" * 1000)
    got = mlx_weights(replace(default_model, weights={"mlx": Weights("mlx", d)}), mac)
    assert got.installed and got.weights_bytes == 1000
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 100)
    assert "Cannot read" in mlx_weights(replace(default_model, weights={}, path=bad), mac).why_not


# ---------------------------------------------------------------------------------- --backend


def test_backend_mlx_without_mlx_is_refused(laptop):
    with pytest.raises(PlanError, match="--backend mlx cannot be used here: mlx is not importable"):
        plan(LLAMA31_8B, laptop, backend="mlx", weights=HAS_MLX)


def test_backend_mlx_without_mlx_weights_is_refused():
    with pytest.raises(PlanError, match="needs MLX weights of Llama 3.1 8B"):
        plan(LLAMA31_8B, mac16(mlx=True, mlx_metal=True), backend="mlx")


def test_backend_llamacpp_overrides_mlx():
    p = plan(LLAMA31_8B, mac16(mlx=True, mlx_metal=True), backend="llamacpp", weights=HAS_MLX)
    assert p.backend == "llamacpp" and "--backend llamacpp" in line(p, "backend")


def test_backend_mlx_on_linux_cpu():
    hw = machine(ram_gib=16, mlx=True)
    p = plan(LLAMA32_1B, hw, backend="mlx", weights=HAS_MLX)
    assert (p.backend, p.device, p.verdict) == ("mlx", "cpu", "cpu")


def test_mlx_kv_quantization_constraints():
    hw = mac16(mlx=True, mlx_metal=True)
    assert plan(LLAMA31_8B, hw, weights=HAS_MLX, kv_cache_type="q8_0").kv_cache_type == "q8_0"
    p = plan(GEMMA3_4B, hw, weights=HAS_MLX, kv_cache_type="q8_0")  # rotating cache: f16 instead, said so
    assert p.backend == "mlx" and p.kv_cache_type == "f16" and "rotating" in line(p, "MLX cannot use q8_0")
    with pytest.raises(PlanError, match="rotating"):
        plan(GEMMA3_4B, hw, backend="mlx", weights=HAS_MLX, kv_cache_type="q8_0")


def test_unknown_backend_is_refused(laptop):
    with pytest.raises(PlanError, match="Backend 'cuda' is not one of auto, llamacpp, mlx"):
        plan(LLAMA31_8B, laptop, backend="cuda")


def test_no_backend_installed_still_plans_and_says_what_to_install():
    hw = machine(ram_gib=16, llama=False)
    p = plan(LLAMA32_1B, hw)
    assert p.backend == "llamacpp" and p.verdict == "cpu"
    assert "pip install llama-cpp-python==0.3.36" in p.advice


# ------------------------------------------------------------------------------------------ draft


def test_draft_model_shares_the_gpu_when_both_fit(desktop_4090):
    alone = plan(LLAMA31_8B, desktop_4090)
    p = plan(LLAMA31_8B, desktop_4090, draft=LLAMA32_1B)
    assert p.draft_n_gpu_layers == 17 and p.n_gpu_layers == 33
    assert p.memory.draft > 0.8 * GiB and p.memory.total == alone.memory.total + p.memory.draft
    assert "on the GPU" in line(p, "draft model")


def test_draft_model_goes_to_the_cpu_when_the_card_is_full(desktop_8gb):
    p = plan(LLAMA31_8B, desktop_8gb, num_ctx=32768, draft=LLAMA32_1B)
    assert p.draft_n_gpu_layers == 0 and "on the CPU" in line(p, "draft model")


# --------------------------------------------------------------------------------------- estimate


def test_estimate_is_consistent():
    for ngl in (0, 1, 16, 32, 33, -1):
        m = estimate(LLAMA31_8B, 4096, "f16", ngl)
        assert m.total == m.weights + m.kv_cache + m.compute + m.overhead == m.gpu + m.cpu
    gpu = [estimate(LLAMA31_8B, 4096, "f16", k).gpu for k in range(35)]
    assert gpu == sorted(gpu) and gpu[0] == 0 and gpu[33] == gpu[34]  # 33: every layer and the output
    # llama.cpp's -ngl N offloads the output layer first (N = 1), then the last N - 1 repeating layers, one each
    layer = gpu[3] - gpu[2]
    assert gpu[1] - gpu[0] > layer > 0 and all(gpu[k + 1] - gpu[k] == layer for k in range(2, 33))
    assert estimate(LLAMA31_8B, 4096, "f16", 1).overhead == CUDA_OVERHEAD + HOST_OVERHEAD
    assert estimate(LLAMA31_8B, 4096, "f16", -1) == estimate(LLAMA31_8B, 4096, "f16", 33)


def test_plan_as_dict_is_json(desktop_4090):
    d = json.loads(json.dumps(plan(LLAMA31_8B, desktop_4090).as_dict()))
    assert d["verdict"] == "gpu" and d["memory"]["total"] > 0 and d["summary"].startswith("llama.cpp on CUDA")


# ------------------------------------------------------------------------- the real default model


@pytest.fixture(scope="module")
def smollm2(default_model_path) -> GGUFInfo:
    return read_gguf(default_model_path)


def test_default_model_on_every_simulated_machine(smollm2, desktop_4090, desktop_8gb, laptop):
    for hw in (desktop_4090, desktop_8gb):
        p = plan(smollm2, hw)
        assert (p.verdict, p.n_gpu_layers, p.n_ctx) == ("gpu", 31, 4096)  # 30 layers + output; min(8192, 4096)
    p = plan(smollm2, laptop, num_parallel=1)
    assert (p.verdict, p.n_ctx) == ("cpu", 4096) and p.memory.total < 512 * MiB
    p = plan(smollm2, laptop)  # 4 slots: 4 × 4,096 tokens, and the flash-attention prefill context's 4,096
    assert (p.slots, p.n_ctx) == (4, 4096) and p.memory.kv_cache == 5 * 4096 * smollm2.kv_bytes_per_token("f16")
    assert p.prefill_flash_attn and "360 MiB for 16,384 tokens" in line(p, "KV cache")
    p = plan(smollm2, mac16(mlx=True, mlx_metal=True), weights=HAS_MLX)
    assert p.backend == "mlx" and p.verdict == "gpu"


def test_default_model_tied_embeddings_are_duplicated_on_the_gpu(smollm2):
    # SmolLM2 has no output.weight: llama.cpp copies token_embd to the GPU as the output layer
    tb = smollm2.extra["tensor_bytes"]
    assert tb["output"] is None
    output_only, cpu = estimate(smollm2, 4096, "f16", 1), estimate(smollm2, 4096, "f16", 0)  # -ngl 1: the output
    assert output_only.weights - cpu.weights == tb["token_embd"] + tb["other"]


def test_default_model_on_this_machine(smollm2):
    hw = probe(refresh=True)
    p = plan(smollm2, hw)
    assert p.n_ctx == 4096 and p.n_threads == hw.physical_cores and p.verdict != "too_big"
    gpu_build = hw.backends["llamacpp"].gpu_offload
    assert p.device == ("cuda" if hw.nvidia_gpus and gpu_build else "metal" if hw.apple_silicon else "cpu")


_LOAD = """
import llama_cpp
llama_cpp.Llama({path!r}, n_ctx={ctx}, n_gpu_layers=0, verbose=True, flash_attn={fa},
                type_k={t}, type_v={t}).close()
"""
_GGML_TYPE = {"f16": 1, "q4_0": 2, "q8_0": 8}


@pytest.mark.parametrize("kv,fa,ctx", [("f16", False, 8192), ("q8_0", True, 4096), ("q4_0", True, 2048)])
def test_estimate_matches_llamacpps_own_buffers(smollm2, kv, fa, ctx):
    """Load the default model in llama.cpp and compare the buffer sizes it logs with the estimate."""
    pytest.importorskip("llama_cpp")
    if probe().backends["llamacpp"].gpu_offload:
        pytest.skip("hardware: a GPU build places buffers differently; this calibrates the CPU path")
    out = subprocess.run([sys.executable, "-c", _LOAD.format(path=smollm2.path, ctx=ctx, fa=fa, t=_GGML_TYPE[kv])],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]

    def mib(pattern: str) -> float:
        return float(re.search(pattern + r"\s*=\s*([\d.]+) MiB", out.stderr).group(1))

    m = estimate(smollm2, ctx, kv, 0, flash_attn=fa)
    assert m.weights / MiB == pytest.approx(mib(r"CPU_Mapped model buffer size"), abs=0.01)
    assert m.kv_cache / MiB == pytest.approx(mib(r"CPU KV buffer size"), abs=0.01)
    assert m.compute / MiB == pytest.approx(mib(r"CPU compute buffer size"), rel=0.05)


_LOAD_SLOTS = """
import llama_cpp
llama_cpp.llama_backend_init()
m = llama_cpp.llama_model_load_from_file({path!r}.encode(), llama_cpp.llama_model_default_params())
cp = llama_cpp.llama_context_default_params()
cp.n_ctx, cp.n_seq_max, cp.kv_unified, cp.n_batch, cp.n_ubatch = {ctx}, {slots}, {unified}, 512, 512
cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
llama_cpp.llama_free(llama_cpp.llama_init_from_model(m, cp))
"""


@pytest.mark.parametrize("slots,ctx,unified", [(4, 8192, False), (8, 32768, False), (4, 8192, True)])
def test_the_attention_buffer_without_flash_attention_spans_a_slots_stream(smollm2, slots, ctx, unified):
    """Flash attention off (the CPU default): the score matrix covers one sequence's KV stream, not the pool (8
    slots of 4,096: ~100 MiB, not the ~640 MiB of a pool-wide matrix), unless the pool is unified."""
    pytest.importorskip("llama_cpp")
    if probe().backends["llamacpp"].gpu_offload:
        pytest.skip("hardware: a GPU build places buffers differently; this calibrates the CPU path")
    out = subprocess.run([sys.executable, "-c", _LOAD_SLOTS.format(path=smollm2.path, ctx=ctx, slots=slots,
                                                                  unified=unified)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    logged = float(re.search(r"CPU compute buffer size\s*=\s*([\d.]+) MiB", out.stderr).group(1))
    m = estimate(smollm2, ctx, "f16", 0, flash_attn=False, slots=slots, kv_unified=unified)
    assert m.compute / MiB == pytest.approx(logged, rel=0.05)


def test_long_prompts_get_a_flash_attention_context_where_the_plan_turns_it_off(smollm2, laptop, desktop_4090):
    """On the CPU the plan decodes without flash attention and evaluates long prompt chunks in a second one-slot
    context with it on (backends.llamacpp._prefill): planned, counted in memory, said; nowhere else."""
    p = plan(smollm2, laptop)
    one = 4096 * smollm2.kv_bytes_per_token("f16")
    assert p.prefill_flash_attn and p.memory.prefill > one  # its cells and its compute buffer
    assert "(+" in line(p, "long prompts") and "flash attention on" in line(p, "long prompts")
    assert p.memory.total == plan(smollm2, laptop, flash_attn="off").memory.total + p.memory.prefill
    for other in (plan(smollm2, laptop, flash_attn="on"),  # on everywhere: nothing to add
                  plan(smollm2, laptop, flash_attn="off"),  # asked off: off everywhere
                  plan(smollm2, laptop, num_parallel=1),  # one slot: a unified pool, no stream to move cells into
                  plan(smollm2, laptop, kv_unified=True),
                  plan(smollm2, laptop, kv_cache_type="q8_0"),  # a quantized V cache: flash attention on
                  plan(replace(smollm2, pooling="mean"), laptop),
                  plan(smollm2, desktop_4090)):  # the GPU: on
        assert not other.prefill_flash_attn and other.memory.prefill == 0
        assert not [r for r in other.reasons if r.startswith("long prompts")]


def test_the_prefill_context_never_costs_the_model_its_slots_or_fit(smollm2):
    roomy, tight = plan(smollm2, machine(ram_gib=2.5)), plan(smollm2, machine(ram_gib=1.75))
    assert roomy.prefill_flash_attn and (roomy.n_ctx, roomy.slots) == (4096, 4)
    assert not tight.prefill_flash_attn and (tight.n_ctx, tight.slots) == (4096, 4) and tight.memory.prefill == 0
    assert "its prefill context (+187 MiB) would cost slots (2 instead of 4)" in line(tight, "long prompts")


def test_the_prefill_context_is_counted_as_llama_cpp_allocates_it(smollm2):
    """The estimate of the prefill context (one slot's KV cache and a flash-attention compute buffer) against what
    llama.cpp logs for that context: 4 slots of 4,096 tokens, within 5%."""
    pytest.importorskip("llama_cpp")
    if probe().backends["llamacpp"].gpu_offload:
        pytest.skip("hardware: a GPU build places buffers differently; this calibrates the CPU path")
    code = _LOAD_SLOTS.format(path=smollm2.path, ctx=4096, slots=1, unified=True).replace(
        "LLAMA_FLASH_ATTN_TYPE_DISABLED", "LLAMA_FLASH_ATTN_TYPE_ENABLED")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    logged = sum(float(x) for x in re.findall(r"CPU (?:KV|compute) buffer size\s*=\s*([\d.]+) MiB", out.stderr))
    m = estimate(smollm2, 4 * 4096, "f16", 0, flash_attn=False, slots=4, prefill_flash=True)
    assert m.prefill / MiB == pytest.approx(logged, rel=0.05)


# ------------------------------------------------------------- probe and the engine on a simulated Mac


@pytest.fixture
def private_default(home, default_model):
    """The default model installed in an empty home of this test only (hard links: no copy), without
    any MLX build next to it."""
    import os
    import shutil

    from localllm.config import paths
    from localllm.store import Store

    src_manifest = next(p for p in (Path(default_model.path).parents[1] / "manifests").rglob("135m.json"))
    dst = paths().manifests / src_manifest.relative_to(Path(default_model.path).parents[1] / "manifests")
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src_manifest, dst)
    data = json.loads(dst.read_text())
    data["mlx_path"], data["mlx"], data["weights"] = None, None, {}
    dst.write_text(json.dumps(data))
    paths().blobs.mkdir(parents=True, exist_ok=True)
    os.link(default_model.path, paths().blobs / Path(default_model.path).name)
    m = Store().get("smollm2:135m")
    assert m.weights_of("mlx") is None
    return m


def test_probe_and_the_engine_pick_mlx_for_a_convertible_gguf_on_a_mac(private_default, capsys):
    """What ``localllm probe`` and ``run --verbose`` print come from these plans."""
    from localllm.cli import probe as probe_cmd
    from localllm.engine import Engine

    mac = mac16(mlx=True, mlx_metal=True)
    model, p, why = probe_cmd.plan_for_model("smollm2:135m", mac, num_ctx=None, kv_cache_type="f16",
                                             backend="auto", num_gpu=None)
    assert why is None and (p.backend, p.device, p.mlx_convert) == ("mlx", "metal", True)
    assert "its GGUF converts to MLX (once, offline, before the first load: Q4_1 kept 4-bit" in line(p, "backend MLX")
    probe_cmd.render(mac, "smollm2:135m", model, p, None)
    out = capsys.readouterr().out
    assert "MLX on Metal" in out and "its GGUF converts to MLX" in out

    engine = Engine(hardware=mac)
    try:
        ep = engine.prepare("smollm2:135m").plan
    finally:
        engine.close()
    assert ep.backend == "mlx" and ep.mlx_convert and ep.reasons == p.reasons
    # a Linux machine plans llama.cpp without reading anything for MLX
    _, lp, _ = probe_cmd.plan_for_model("smollm2:135m", machine(ram_gib=16, mlx=True), num_ctx=None,
                                        kv_cache_type="f16", backend="auto", num_gpu=None)
    assert lp.backend == "llamacpp" and not any("MLX" in r for r in lp.reasons)


def test_an_audio_projector_is_counted_and_named():
    """An audio projector (or one doing both) is planned as a vision one is: on llama.cpp, its memory counted."""
    hw = mac16(mlx=True, mlx_metal=True)
    p = plan(LLAMA31_8B, hw, weights=HAS_MLX, projector_bytes=300 * MiB, projector_kind="audio")
    assert p.backend == "llamacpp" and "has an audio projector" in line(p, "MLX not used")
    assert "on the GPU with the model" in line(p, "audio projector 300 MiB")
    forced = plan(LLAMA31_8B, hw, weights=HAS_MLX, projector_bytes=300 * MiB, projector_kind="audio", backend="mlx")
    assert "audio is refused" in line(forced, "audio projector")
    base = plan(LLAMA31_8B, machine(ram_gib=32))
    both = plan(LLAMA31_8B, machine(ram_gib=32), projector_bytes=300 * MiB, projector_kind="vision+audio")
    assert both.memory.total == base.memory.total + 300 * MiB and "vision+audio projector" in " ".join(both.reasons)


def test_a_vision_model_on_a_mac_runs_on_llamacpp_metal_and_says_why():
    """mlx-lm has no vision: a model with a projector takes llama.cpp (Metal) unless MLX is forced; the projector's
    memory is counted with the weights, on the GPU with the layers."""
    hw = mac16(mlx=True, mlx_metal=True)
    plain = plan(LLAMA31_8B, hw, weights=HAS_MLX)
    p = plan(LLAMA31_8B, hw, weights=HAS_MLX, projector_bytes=600 * MiB)
    assert plain.backend == "mlx" and (p.backend, p.device) == ("llamacpp", "metal")
    assert "has a vision projector" in line(p, "MLX not used")
    assert "on the GPU with the model" in line(p, "vision projector")
    forced = plan(LLAMA31_8B, hw, weights=HAS_MLX, projector_bytes=600 * MiB, backend="mlx")
    assert forced.backend == "mlx" and "images are refused" in line(forced, "vision projector")
    cpu = plan(LLAMA31_8B, machine(ram_gib=32), projector_bytes=600 * MiB)
    base = plan(LLAMA31_8B, machine(ram_gib=32))
    assert cpu.memory.total == base.memory.total + 600 * MiB and cpu.memory.cpu == base.memory.cpu + 600 * MiB


def test_each_backend_is_judged_by_its_own_weights_formats_answer():
    """Issue 45: the planner took one answer (``mlx=``, MLX's) and judged every backend whose weights are not the GGUF
    by it, so with MLX weights installed a backend of a third format whose weights are not there was taken too.
    Now it takes an answer per format and judges each backend by its own."""
    from backends import descriptor
    from backends.descriptor import Backend
    from localllm.formats import PlanWeights

    toy = Backend(name="toyfmt", label="Toy", source="tests.toyformat:ToySource", weights="toyfmt", memory="layers",
                  install="(the tests)", priority=5)  # before llama.cpp on Linux
    descriptor.register(toy)
    try:
        hw = machine(ram_gib=16)
        hw.backends["toyfmt"] = BackendStatus("toyfmt", True, "toy", False, "")
        p = plan(LLAMA32_1B, hw, weights=HAS_MLX)  # MLX's weights are there, the toy format's are not
        assert p.backend == "llamacpp"
        assert any(r.startswith("Toy not used: no Toy build") for r in p.reasons), p.reasons
        p = plan(LLAMA32_1B, hw, weights={**HAS_MLX, "toyfmt": PlanWeights(installed=True)})
        assert p.backend == "toyfmt"
    finally:
        descriptor.unregister("toyfmt")
