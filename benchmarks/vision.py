"""Images in the decode loop (issue 21): what an image costs, and what it costs the streams beside it.

    python benchmarks/vision.py                       # default model + the made test projector (16 tokens/image)
    python benchmarks/vision.py --model M.gguf --mmproj P.gguf --image photo.jpg --threads 2

Runs in-process on the backend's decode loop (no HTTP), llama.cpp:

* **image TTFT**: a chat turn with one image vs the same turn without it (greedy, 1 token), cold (the image
  encoded) and warm (the same image again: prefix reuse, nothing encoded) — median of ``--rounds``; the
  projector's encode time from the request's stats;
* **the longest pause of 3 text streams** while an image request is admitted beside them: the largest gap
  between two tokens of any text stream during the run, vs the same 3 streams with a text-only 4th request.

Not measured here yet: ``llama-mtmd-cli`` on the same files (the issue's comparison); the projector made by
``tests/support_vision.py`` is tiny, so the encode figures are the pipeline's overhead, not a real ViT's cost.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF (default: the default model from the test home)")
    ap.add_argument("--mmproj", default=None, help="projector GGUF (default: the made test projector)")
    ap.add_argument("--image", default=None, help="an image file (default: a generated 64 px PNG)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()

    from backends.base import GenerateRequest, LoadSpec, Sampling, TextChunk
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

    m = load("llamacpp", LoadSpec(model, n_ctx=2048, n_seq=4, n_threads=a.threads, mmproj=proj))
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
    print(f"image tokens per image: {n_img}")
    print(f"TTFT text-only {med(text) * 1e3:.1f} ms | with image, cold {med(cold) * 1e3:.1f} ms "
          f"(encode {med(enc):.2f} ms) | same image again {med(warm) * 1e3:.1f} ms")

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


if __name__ == "__main__":
    main()
