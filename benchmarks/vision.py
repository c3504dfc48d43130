"""Images in the decode loop (issue 21): what an image costs, and what it costs the streams beside it.

    python benchmarks/vision.py                       # default model + the made test projector (16 tokens/image)
    python benchmarks/vision.py --model M.gguf --mmproj P.gguf --image photo.jpg --threads 2
    python benchmarks/vision.py --mtmd-cli "$(python benchmarks/llama_tools.py --target llama-mtmd-cli | cut -f2)"

Runs in-process on the backend's decode loop (no HTTP), llama.cpp:

* **image TTFT**: a chat turn with one image vs the same turn without it (greedy, 1 token), cold (the image
  encoded) and warm (the same image again: prefix reuse, nothing encoded) — median of ``--rounds``; the
  projector's encode time from the request's stats;
* **llama.cpp's own path** on the same files and prompt: ``mtmd_tokenize`` + ``mtmd_helper_eval_chunks`` (what
  ``llama-mtmd-cli`` runs for a prompt, without its process start and model load) on a fresh one-sequence
  context, to the logits of the last prompt token — against our cold image TTFT;
* **the longest pause of 3 text streams** while an image request is admitted beside them: the largest gap
  between two tokens of any text stream during the run, vs the same 3 streams with a text-only 4th request;
* with ``--mtmd-cli PATH``, **the ``llama-mtmd-cli`` binary** on the same files: its own image-encode and
  prompt-eval timings (``-lv 4``; load and process start excluded) against our cold image TTFT.

Note: the projector made by ``tests/support_vision.py`` is tiny, so the encode figures are the pipeline's overhead,
not a real ViT's cost. ``OMP_WAIT_POLICY=PASSIVE`` is set (as the tests do): on a machine shared with other work,
llama.cpp's spinning threads otherwise make every figure 5-10x worse.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before llama.cpp's OpenMP starts (see the docstring)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF (default: the default model from the test home)")
    ap.add_argument("--mmproj", default=None, help="projector GGUF (default: the made test projector)")
    ap.add_argument("--image", default=None, help="an image file (default: a generated 64 px PNG)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mtmd-cli", default=None, metavar="PATH",
                    help="also run llama.cpp's llama-mtmd-cli binary (python benchmarks/llama_tools.py --target "
                         "llama-mtmd-cli) on the same files: its own image and prompt timings, load excluded")
    a = ap.parse_args()

    from backends.contract.events import TextChunk
    from backends.contract.specs import GenerateRequest, LoadSpec, Sampling
    from backends.registry import load
    from tests.support_vision import make_projector, png

    model = a.model
    if model is None:
        from tests.support import DEFAULT_MODEL, in_test_home

        model = str(in_test_home(lambda s: s.pull(DEFAULT_MODEL)).path)
    proj = a.mmproj or str(make_projector(Path("/tmp/localllm-bench/mmproj-test.gguf")))
    img = Path(a.image).read_bytes() if a.image else None

    def pic(i: int) -> bytes:
        return img if img is not None and i == 0 else png(seed=1000 + i)

    m = load("llamacpp", LoadSpec(model, n_ctx=2048, slots=4, n_threads=a.threads, mmproj=proj))
    ask = "Describe the picture in one sentence."

    def ttft(images: list[bytes]) -> tuple[float, int, float]:
        msgs = [{"role": "user", "content": ask, **({"images": images} if images else {})}]
        t = time.perf_counter()
        done = None
        for ev in m.generate(GenerateRequest(messages=msgs, sampling=Sampling(temperature=0, max_tokens=1))):
            done = ev
        assert done is not None
        s = done.stats  # type: ignore[attr-defined]
        return time.perf_counter() - t, s.image_tokens, s.image_encode_duration / 1e6

    cold, warm, text, enc = [], [], [], []
    for r in range(a.rounds):
        m.call(lambda s: m.pool.clear())
        text.append(ttft([])[0])
        t, n_img, e = ttft([pic(r)])
        cold.append(t)
        enc.append(e)
        warm.append(ttft([pic(r)])[0])
    med = statistics.median
    prompt = m.call(lambda s: s.render([{"role": "user", "content": "<__media__>\n" + ask}]))
    ref = [helper_prefill(model, proj, prompt, pic(r), a.threads or 2) for r in range(a.rounds)]
    print(f"image tokens per image: {n_img}")
    print(f"llama.cpp's mtmd_helper_eval_chunks, same prompt and image: {med(ref) * 1e3:.1f} ms to the last logits")
    print(f"TTFT text-only {med(text) * 1e3:.1f} ms | with image, cold {med(cold) * 1e3:.1f} ms "
          f"(encode {med(enc):.2f} ms) | same image again {med(warm) * 1e3:.1f} ms")
    if a.mtmd_cli:
        runs = [mtmd_cli(a.mtmd_cli, model, proj, ask, pic(r), a.threads or 2) for r in range(a.rounds)]
        total = med(x[0] + x[1] for x in runs)
        print(f"llama-mtmd-cli (its own timings, load excluded): image encode {med(x[0] for x in runs):.1f} ms + "
              f"prompt eval (image and text) {med(x[1] for x in runs):.1f} ms = {total:.1f} ms to the first token; "
              f"ours cold {med(cold) * 1e3:.1f} ms (ratio {med(cold) * 1e3 / total:.2f})")

    def pauses(fourth_image: bool) -> float:
        m.call(lambda s: m.pool.clear())
        gaps: list[float] = []
        start = threading.Event()

        def stream(i: int) -> None:
            msgs = [{"role": "user", "content": f"Count from {i} to {i + 40}, one number a line."}]
            last = None
            for ev in m.generate(GenerateRequest(messages=msgs, sampling=Sampling(temperature=0, max_tokens=48))):
                if isinstance(ev, TextChunk):
                    now = time.perf_counter()
                    if last is not None and start.is_set():
                        gaps.append(now - last)
                    last = now
                    if not start.is_set() and i == 0:
                        start.set()

        ts = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in ts:
            t.start()
        start.wait(60)
        time.sleep(0.05)
        msgs = [{"role": "user", "content": ask, **({"images": [pic(99)]} if fourth_image else {})}]
        for _ in m.generate(GenerateRequest(messages=msgs, sampling=Sampling(temperature=0, max_tokens=8))):
            pass
        for t in ts:
            t.join()
        return max(gaps) if gaps else 0.0

    print(f"longest pause of 3 text streams: with a text 4th request {pauses(False) * 1e3:.1f} ms | "
          f"with an image 4th request {pauses(True) * 1e3:.1f} ms")
    m.close()


def mtmd_cli(binary: str, model: str, proj: str, ask: str, image: bytes, threads: int) -> tuple[float, float]:
    """(image encode ms, prompt eval ms) as ``llama-mtmd-cli`` reports them for one greedy token (``-lv 4``: its
    "mtmd batch encoding done in" and llama_perf's "prompt eval time", which counts the image's decode with the
    text's). Load and process start are not in them."""
    import re
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".png") as f:
        f.write(image)
        f.flush()
        out = subprocess.run([binary, "-m", model, "--mmproj", proj, "--image", f.name, "-p", ask, "-n", "1",
                              "--temp", "0", "-t", str(threads), "-c", "2048", "--no-warmup", "--perf", "-lv", "4"],
                             capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    log = out.stdout + out.stderr
    enc = sum(float(x) for x in re.findall(r"mtmd batch encoding done in ([0-9.]+) ms", log))
    pe = re.search(r"prompt eval time =\s*([0-9.]+) ms", log)
    if out.returncode != 0 or pe is None:
        raise SystemExit(f"llama-mtmd-cli failed ({out.returncode}):\n{log[-2000:]}")
    return enc, float(pe.group(1))


def helper_prefill(model: str, proj: str, prompt: str, image: bytes, threads: int) -> float:
    """Seconds llama.cpp's own helper takes from the image bytes to the prompt's last logits (load excluded)."""
    import ctypes

    import llama_cpp as L
    import llama_cpp.mtmd_cpp as M

    mp = L.llama_model_default_params()
    lm = L.llama_model_load_from_file(model.encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_threads, cp.n_threads_batch = 2048, 512, 512, threads, threads
    ctx = L.llama_init_from_model(lm, cp)
    par = M.mtmd_context_params_default()
    par.use_gpu, par.n_threads, par.print_timings = False, threads, False
    mctx = M.mtmd_init_from_file(proj.encode(), lm, par)
    try:
        t = time.perf_counter()
        buf = (ctypes.c_uint8 * len(image)).from_buffer_copy(image)
        bm = M.mtmd_helper_bitmap_init_from_buf(mctx, buf, len(image), False)
        raw = prompt.encode()
        txt = M.mtmd_input_text()
        txt.text, txt.text_len, txt.add_special, txt.parse_special = raw, len(raw), True, True
        chunks = M.mtmd_input_chunks_init()
        assert M.mtmd_tokenize(mctx, chunks, ctypes.byref(txt), (M.mtmd_bitmap_p_ctypes * 1)(bm), 1) == 0
        n_past = L.llama_pos(0)
        assert M.mtmd_helper_eval_chunks(mctx, ctx, chunks, 0, 0, 512, True, ctypes.byref(n_past)) == 0
        L.llama_get_logits_ith(ctx, -1)
        dt = time.perf_counter() - t
        M.mtmd_input_chunks_free(chunks)
        M.mtmd_bitmap_free(bm)
        return dt
    finally:
        M.mtmd_free(mctx)
        L.llama_free(ctx)
        L.llama_model_free(lm)


if __name__ == "__main__":
    main()
