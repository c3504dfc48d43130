"""Audio in the decode loop (issue 38): what a clip costs, and what it costs the streams beside it.

    python benchmarks/audio.py                        # default model + the made ultravox projector (60 tokens/30 s)
    python benchmarks/audio.py --audio talk.mp3 --threads 2
    python benchmarks/audio.py --mtmd-cli "$(python benchmarks/llama_tools.py --target llama-mtmd-cli | cut -f2)"

Runs in-process on the backend's decode loop (no HTTP), llama.cpp:

* **audio TTFT**: a chat turn with one clip vs the same turn without it (greedy, 1 token), cold (decoded,
  resampled, mel spectrogram, encoded) and warm (the same clip again: prefix reuse, nothing encoded) — median of
  ``--rounds``; the projector's encode time from the request's stats;
* **llama.cpp's own path** on the same files and prompt: ``mtmd_helper_bitmap_init_from_buf`` + ``mtmd_tokenize``
  + ``mtmd_helper_eval_chunks`` (what ``llama-mtmd-cli`` runs, without its process start and model load) on a
  fresh one-sequence context, to the logits of the last prompt token — against our cold audio TTFT;
* **the longest pause of 3 text streams** while an audio request is admitted beside them: the largest gap between
  two tokens of any text stream, vs the same 3 streams with a text-only 4th request;
* with ``--mtmd-cli PATH``, **the ``llama-mtmd-cli`` binary** on the same files: its own audio-encode and
  prompt-eval timings (``-lv 4``; load and process start excluded) against our cold audio TTFT.

The projector made by ``tests/support_audio.py`` is tiny (a 2-block, 64-wide encoder), so the encode figures are
the pipeline's overhead (decode, resample, mel, a 1500-position encoder pass per 30 s chunk), not a real Whisper's.
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
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before llama.cpp's OpenMP starts (as benchmarks/vision.py)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF (default: the default model from the test home)")
    ap.add_argument("--mmproj", default=None, help="audio projector GGUF (default: the made ultravox projector)")
    ap.add_argument("--audio", default=None, help="a WAV/MP3/FLAC file (default: a generated 1.5 s WAV)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--mtmd-cli", default=None, metavar="PATH",
                    help="also run llama.cpp's llama-mtmd-cli binary on the same files (its own timings)")
    a = ap.parse_args()

    from backends.contract.events import TextChunk
    from backends.contract.specs import GenerateRequest, LoadSpec, Sampling
    from backends.registry import load
    from benchmarks.vision import helper_prefill
    from tests.support_audio import make_audio_projector, wav

    model = a.model
    if model is None:
        from tests.support import DEFAULT_MODEL, in_test_home

        model = str(in_test_home(lambda s: s.pull(DEFAULT_MODEL)).path)
    proj = a.mmproj or str(make_audio_projector(Path("/tmp/localllm-bench/mmproj-ultravox-test.gguf")))
    given = Path(a.audio).read_bytes() if a.audio else None

    def clip(i: int) -> bytes:  # a different clip each round (cold means not seen before), the given one first
        return given if given is not None and i == 0 else wav(seed=1000 + i)

    m = load("llamacpp", LoadSpec(model, n_ctx=2048, slots=4, n_threads=a.threads, mmproj=proj))
    ask = "Transcribe the audio."

    def ttft(clips: list[bytes]) -> tuple[float, int, float]:
        msgs = [{"role": "user", "content": ask, **({"images": clips} if clips else {})}]
        t = time.perf_counter()
        done = None
        for ev in m.generate(GenerateRequest(messages=msgs, sampling=Sampling(temperature=0, max_tokens=1))):
            done = ev
        assert done is not None
        s = done.stats  # type: ignore[attr-defined]
        return time.perf_counter() - t, s.audio_tokens, s.audio_encode_duration / 1e6

    cold, warm, text, enc = [], [], [], []
    n_tok = 0
    for r in range(a.rounds):
        m.call(lambda s: m.pool.clear())
        text.append(ttft([])[0])
        t, n_tok, e = ttft([clip(r)])
        cold.append(t)
        enc.append(e)
        warm.append(ttft([clip(r)])[0])
    med = statistics.median
    prompt = m.call(lambda s: s.render([{"role": "user", "content": "<__media__>\n" + ask}]))
    ref = [helper_prefill(model, proj, prompt, clip(r), a.threads or 2) for r in range(a.rounds)]
    print(f"audio tokens per clip: {n_tok}")
    print(f"llama.cpp's mtmd_helper_eval_chunks, same prompt and clip: {med(ref) * 1e3:.1f} ms to the last logits")
    print(f"TTFT text-only {med(text) * 1e3:.1f} ms | with audio, cold {med(cold) * 1e3:.1f} ms "
          f"(encode {med(enc):.2f} ms) | same clip again {med(warm) * 1e3:.1f} ms")
    if a.mtmd_cli:
        runs = [mtmd_cli(a.mtmd_cli, model, proj, ask, clip(r), a.threads or 2) for r in range(a.rounds)]
        total = med(x[0] + x[1] for x in runs)
        print(f"llama-mtmd-cli (its own timings, load excluded): audio encode {med(x[0] for x in runs):.1f} ms + "
              f"prompt eval (audio and text) {med(x[1] for x in runs):.1f} ms = {total:.1f} ms to the first token; "
              f"ours cold {med(cold) * 1e3:.1f} ms (ratio {med(cold) * 1e3 / total:.2f})")

    def pauses(fourth_audio: bool) -> float:
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
        msgs = [{"role": "user", "content": ask, **({"images": [clip(99)]} if fourth_audio else {})}]
        for _ in m.generate(GenerateRequest(messages=msgs, sampling=Sampling(temperature=0, max_tokens=8))):
            pass
        for t in ts:
            t.join()
        return max(gaps) if gaps else 0.0

    print(f"longest pause of 3 text streams: with a text 4th request {pauses(False) * 1e3:.1f} ms | "
          f"with an audio 4th request {pauses(True) * 1e3:.1f} ms")
    m.close()


def mtmd_cli(binary: str, model: str, proj: str, ask: str, clip: bytes, threads: int) -> tuple[float, float]:
    """(audio encode ms, prompt eval ms) as ``llama-mtmd-cli`` reports them for one greedy token (``-lv 4``: its
    "mtmd batch encoding done in" and llama_perf's "prompt eval time", which counts the audio's decode with the
    text's). Load and process start are not in them; the clip's decode and mel spectrogram are in neither."""
    import re
    import subprocess
    import tempfile

    from localllm.audio import clip_info

    info = clip_info(clip)
    suffix = "." + (info.format.lower() if info else "wav")
    with tempfile.NamedTemporaryFile(suffix=suffix) as f:
        f.write(clip)
        f.flush()
        out = subprocess.run([binary, "-m", model, "--mmproj", proj, "--audio", f.name, "-p", ask, "-n", "1",
                              "--temp", "0", "-t", str(threads), "-c", "2048", "--no-warmup", "--perf", "-lv", "4"],
                             capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    log = out.stdout + out.stderr
    enc = sum(float(x) for x in re.findall(r"mtmd batch encoding done in ([0-9.]+) ms", log))
    pe = re.search(r"prompt eval time =\s*([0-9.]+) ms", log)
    if out.returncode != 0 or pe is None:
        raise SystemExit(f"llama-mtmd-cli failed ({out.returncode}):\n{log[-2000:]}")
    return enc, float(pe.group(1))


if __name__ == "__main__":
    main()
