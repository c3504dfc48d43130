"""The prompt cache on disk: a long prefix is evaluated once, restored in the next process, and every bad
entry is refused, not loaded. Real model (llama.cpp) in real subprocesses where a restart matters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from backends.contract.specs import GenerateRequest, LoadSpec, Sampling
from backends.core.prompt_cache import SUFFIX, PromptCache, PromptCacheSpec
from backends.registry import load
from tests.backends.conftest import collect

SYSTEM = "You are a careful assistant. " + " ".join(
    f"Rule {i}: answer about item {i} precisely and cite the rule." for i in range(40))  # ~740 tokens: above the
# product's min_tokens (512), so the restore tests run with the default threshold


# the tests of what is refused or missed need no long prompt: ~80 tokens with a threshold of 32
SHORT = ". ".join(SYSTEM.split(". ")[:6]) + "."


def ask(q: str, n: int = 24, system: str = SYSTEM) -> GenerateRequest:
    return GenerateRequest(messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
                           sampling=Sampling(temperature=0.0, max_tokens=n))


def _model(path: Path, root: Path, kv: str = "f16", **kw):
    spec = PromptCacheSpec(str(root / "m"), "test-model", max_bytes=kw.pop("max_bytes", 1 << 30),
                           budget_root=str(root), min_tokens=kw.pop("min_tokens", PromptCacheSpec.min_tokens))
    return load("llamacpp", LoadSpec(str(path), n_ctx=2048, slots=1, kv_cache_type=kv),  # type: ignore[arg-type]
                prompt_cache=spec, **kw)


CHILD = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {root!r})
    from tests.backends.test_prompt_cache import _model, ask
    from tests.backends.conftest import collect
    from pathlib import Path
    m = _model(Path({model!r}), Path({cache!r}))
    text, done, _ = collect(m.generate(ask({q!r})))
    m.close()
    print(json.dumps({{"text": text, "restored": done.stats.prompt_restored_tokens,
                      "cached": done.stats.prompt_cached_tokens, "prompt": done.stats.prompt_eval_count}}))
""")


def _child(model: Path, cache: Path, q: str) -> dict:
    code = CHILD.format(root=str(Path(__file__).resolve().parents[2]), model=str(model), cache=str(cache), q=q)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_second_process_restores_the_prefix_and_answers_the_same(derived_model, tmp_path):
    f32 = derived_model("f32")  # greedy output must be identical with and without a restore
    first = _child(f32, tmp_path, "What does rule 7 say?")
    assert first["restored"] == 0
    assert list((tmp_path / "m").glob(f"*{SUFFIX}")), "nothing was saved"
    again = _child(f32, tmp_path, "What does rule 7 say?")  # the whole prompt was saved
    assert again["restored"] == first["prompt"] - 1 and again["text"] == first["text"]
    other = _child(f32, tmp_path, "What does rule 12 say?")  # only the system prompt is shared
    assert other["restored"] > 600 and other["restored"] < other["prompt"]
    with _model(f32, tmp_path / "cold", max_bytes=0) as cold:  # no cache at all: the reference
        text, done, _ = collect(cold.generate(ask("What does rule 12 say?")))
    assert done.stats.prompt_restored_tokens == 0 and other["text"] == text


def test_corrupt_truncated_and_mismatched_entries_are_removed_not_loaded(default_model_path, tmp_path, caplog):
    with _model(default_model_path, tmp_path, min_tokens=32) as m:
        ref, _, _ = collect(m.generate(ask("Hi", system=SHORT)))
    entries = sorted((tmp_path / "m").glob(f"*{SUFFIX}"))
    assert entries
    data = entries[0].read_bytes()
    entries[0].write_bytes(data[: len(data) // 2])  # truncated
    for e in entries[1:]:
        raw = bytearray(e.read_bytes())
        raw[-100] ^= 0xFF  # one flipped byte in the state
        e.write_bytes(bytes(raw))
    bad = {e.name: e.read_bytes() for e in entries}
    with _model(default_model_path, tmp_path, min_tokens=32) as m:
        text, done, _ = collect(m.generate(ask("Hi", system=SHORT)))
        assert done.stats.prompt_restored_tokens == 0 and text == ref
        assert caplog.text.count("truncated or corrupt") == len(entries)
    for e in entries:  # each bad file was removed, and a good one written in its place
        assert e.read_bytes() != bad[e.name]
    with _model(default_model_path, tmp_path, min_tokens=32) as m:
        _, done, _ = collect(m.generate(ask("Hi", system=SHORT)))
        assert done.stats.prompt_restored_tokens == done.stats.prompt_eval_count - 1


def test_another_kv_type_is_a_miss(default_model_path, tmp_path):
    with _model(default_model_path, tmp_path, min_tokens=32) as m:
        collect(m.generate(ask("Hi", system=SHORT)))
    with _model(default_model_path, tmp_path, kv="q8_0", min_tokens=32) as m:
        _, done, _ = collect(m.generate(ask("Hi", system=SHORT)))
        assert done.stats.prompt_restored_tokens == 0
        assert m.metrics().prompt_cache_misses >= 1


def test_a_full_cache_evicts_the_least_recently_used(tmp_path):
    c = PromptCache(tmp_path, key="k", max_bytes=3000, min_tokens=1)
    for i in range(5):
        assert c.save_now([i] * 10, bytes(900))
        os.utime(next(tmp_path.glob(f"{10:07d}-{c._name([i] * 10)}{SUFFIX}")), (i, i))
    left = sorted(p.name for p in tmp_path.glob(f"*{SUFFIX}"))
    assert len(left) <= 3 and c.lookup([4] * 10)[0] == 10 and c.lookup([0] * 10)[0] == 0


def test_an_unwritable_cache_skips_the_save_and_the_answer_comes(default_model_path, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        target = ro
        if os.access(ro, os.W_OK):  # root writes anywhere: a cache under a regular file is unwritable for all
            (tmp_path / "a-file").write_text("")
            target = tmp_path / "a-file" / "cache"
        with _model(default_model_path, target, min_tokens=32) as m:
            text, done, _ = collect(m.generate(ask("Hi", system=SHORT)))
            assert text and done.finish_reason in ("stop", "length")
    finally:
        os.chmod(ro, 0o700)


def test_a_full_disk_skips_the_save_and_the_answer_comes(default_model_path, tmp_path, monkeypatch):
    import errno

    real = os.replace

    def full(src, dst):  # the disk fills up at the last moment: the entry must not appear, nor the temp file
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with _model(default_model_path, tmp_path, min_tokens=32) as m:
        text, done, _ = collect(m.generate(ask("Hi", system=SHORT)))
        m.call(lambda _src: None)  # the loop has finished the request (its save follows the answer)
        m.prompt_cache.flush()
        assert text and done.finish_reason in ("stop", "length")
        assert m.prompt_cache.stats.save_errors >= 1
    monkeypatch.setattr(os, "replace", real)
    assert not list(tmp_path.rglob("*")) or not [p for p in tmp_path.rglob("*") if p.is_file()]


def test_a_second_localllm_run_restores_the_system_prompt_and_rm_deletes_the_entries(tmp_path, default_model):
    """The CLI as a script uses it: the second `localllm run` with the same long system prompt restores it
    from disk (``--verbose`` says so); `localllm rm` of the model deletes its saved prefixes."""
    import shutil

    from localllm.config import paths
    from tests.support import install_copy  # the default model hard-linked into an empty home

    home = tmp_path / "home"
    install_copy(home / "data" / "models", paths().models)
    env = {**os.environ, "LOCALLLM_HOME": str(home), "OMP_WAIT_POLICY": "PASSIVE"}
    system = SYSTEM.replace("careful", "thorough")

    def run(q: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "localllm", "run", default_model.name, q, "--system", system,
                               "--verbose", "--num-predict", "8", "--temperature", "0"], env=env,
                              capture_output=True, text=True, timeout=600)

    first = run("What does rule 3 say?")
    assert first.returncode == 0, first.stderr
    assert "restored from disk" not in first.stderr
    cache = home / "data" / "prompt-cache"
    assert list(cache.rglob(f"*{SUFFIX}")), "the first run saved nothing"
    second = run("What does rule 9 say?")
    assert second.returncode == 0, second.stderr
    assert "restored from disk" in second.stderr, second.stderr
    rm = subprocess.run([sys.executable, "-m", "localllm", "rm", default_model.name], env=env,
                        capture_output=True, text=True, timeout=120)
    assert rm.returncode == 0, rm.stderr
    assert not list(cache.rglob(f"*{SUFFIX}"))
    shutil.rmtree(home, ignore_errors=True)


# ------------------------------------------------------------------ the next turn never waits for the copy


def _turns(m, q1: str = "What does rule 7 say?", q2: str = "And rule 9?") -> tuple[int, dict]:
    """Turn 1, then turn 2 of the same conversation submitted as soon as turn 1's last event arrives (an agent).
    Returns (states copied out of the pool before turn 2's first token, turn 2's stats)."""
    from backends.contract.events import TextChunk

    copies: list[float] = []
    src = m.source
    real = src.state_save

    def counting(seq: int) -> bytes:
        copies.append(1)
        return real(seq)

    m.call(lambda s: setattr(s, "state_save", counting))
    first, done1, _ = collect(m.generate(ask(q1, n=8)))
    turn2 = GenerateRequest(messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q1},
                                      {"role": "assistant", "content": first}, {"role": "user", "content": q2}],
                            sampling=Sampling(temperature=0.0, max_tokens=8))
    before = None
    evs = []
    for ev in m.generate(turn2):
        if before is None and isinstance(ev, TextChunk):
            before = len(copies)
        evs.append(ev)
    done2 = evs[-1]
    return (before if before is not None else len(copies)), {"cached": done2.stats.prompt_cached_tokens,
                                                            "restored": done2.stats.prompt_restored_tokens,
                                                            "prompt": done2.stats.prompt_eval_count,
                                                            "turn1": done1.stats.prompt_eval_count}


def test_the_next_turn_sent_at_once_is_not_delayed_by_the_snapshot(default_model_path, tmp_path):
    """The state of turn 1's prompt is not copied out of llama.cpp between turn 1's end and turn 2's first token
    (it was: on the loop, before turn 2 could start); it is copied once the model idles, and then it is on disk."""
    spec = PromptCacheSpec(str(tmp_path / "m"), "test-model", max_bytes=1 << 30, idle_s=1.0)
    with load("llamacpp", LoadSpec(str(default_model_path), n_ctx=2048, slots=1),  # type: ignore[arg-type]
              prompt_cache=spec) as m:
        copied_before, st = _turns(m)
        assert copied_before == 0
        assert st["cached"] >= st["turn1"] - 1 and st["restored"] == 0  # turn 2 continued turn 1's sequence
        pc = m.prompt_cache
        assert pc is not None
        deadline = time.monotonic() + 30  # idle: the owed prefixes go to disk without a flush or a close
        while pc.stats.saves < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        lengths = sorted(int(p.name.split("-")[0]) for p in (tmp_path / "m").glob(f"*{SUFFIX}"))
    # the system prompt's end and turn 2's whole prompt (turn 1's, which it extends, is not kept)
    assert len(lengths) == 2 and 600 < lengths[0] < st["turn1"] and lengths[1] == st["prompt"], (lengths, st)


def test_the_next_turn_does_not_read_back_the_entry_of_the_prefix_it_holds(default_model_path, tmp_path):
    """Turn 1's prompt on disk (flushed), turn 2 continues the same sequence: the entry is not read (70 MB at 3k
    tokens on this model: read and hashed before turn 2 could start), and nothing is restored."""
    with _model(default_model_path, tmp_path) as m:
        collect(m.generate(ask("What does rule 7 say?", n=8)))
        pc = m.prompt_cache
        assert pc is not None
        pc.flush()
        assert pc.stats.saves >= 1
        _, st = _turns(m, q1="What does rule 7 say?")
        assert st["restored"] == 0 and pc.stats.hits == 0


def test_an_entry_still_waiting_for_the_writer_is_found(tmp_path):
    """A conversation whose KV stream another one took (its turn saved just then) comes back while the model is
    still decoding, before the writer has written it: the lookup finds the bytes in memory."""
    c = PromptCache(tmp_path, key="k", max_bytes=1 << 30, min_tokens=1)
    c.decoding(True)
    c.save([1, 2, 3], b"state of three")
    c.save([1, 2], b"state of two")
    time.sleep(0.3)
    assert not list(tmp_path.glob(f"*{SUFFIX}"))  # not written yet
    assert c.lookup([1, 2, 3, 4]) == (3, b"state of three")  # the longest
    assert c.lookup([1, 2, 9]) == (2, b"state of two")
    assert c.lookup([1, 2, 3, 4], max_len=2) == (2, b"state of two")
    assert c.lookup([7, 8]) == (0, None)
    c.decoding(False)
    c.flush()
    assert c.lookup([1, 2, 3, 4]) == (3, b"state of three")  # and from the disk once written
    c.close()


def test_the_writer_waits_while_the_model_decodes(tmp_path):
    c = PromptCache(tmp_path, key="k", max_bytes=1 << 30, min_tokens=1)
    c.decoding(True)
    c.save([1, 2, 3], bytes(100))
    time.sleep(0.6)
    assert not list(tmp_path.glob(f"*{SUFFIX}"))  # the model decodes: not even hashed
    c.decoding(False)
    deadline = time.monotonic() + 10
    while not list(tmp_path.glob(f"*{SUFFIX}")) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert c.lookup([1, 2, 3, 4]) == (3, bytes(100))
    c.decoding(True)
    c.save([5, 6, 7], bytes(10))
    c.flush()  # a flush does not wait for the model
    assert c.lookup([5, 6, 7]) == (3, bytes(10))
    c.close()


def test_the_next_turn_tokenizes_the_system_prompt_once_per_model_not_every_turn(default_model_path, tmp_path):
    """Where the system prompt ends is a cache point, found by tokenizing the system prompt alone: that is done once,
    not again every turn (~50 ms a turn at an agent's 20k-token system prompt). Turn 2 tokenizes its own prompt
    and nothing more (it was that plus the system prompt again)."""
    with _model(default_model_path, tmp_path) as m:
        seen: list[int] = []
        src = m.source
        real = src.prompt_tokens

        def counting(text: str) -> list[int]:
            toks = real(text)
            seen.append(len(toks))
            return toks

        m.call(lambda s: setattr(s, "prompt_tokens", counting))
        first, done1, _ = collect(m.generate(ask("What does rule 7 say?", n=8)))
        assert sum(seen) > done1.stats.prompt_eval_count  # turn 1: the prompt, and the system prompt alone
        seen.clear()
        turn2 = GenerateRequest(messages=[{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": "What does rule 7 say?"},
                                          {"role": "assistant", "content": first},
                                          {"role": "user", "content": "And rule 9?"}],
                                sampling=Sampling(temperature=0.0, max_tokens=8))
        _, done2, _ = collect(m.generate(turn2))
        assert done2.stats.prompt_cached_tokens > 600  # (the system prompt's end still found: a cache point)
        assert sum(seen) == done2.stats.prompt_eval_count, (seen, done2.stats.prompt_eval_count)


def test_the_next_turn_continues_its_own_sequence_when_the_answer_comes_back_otherwise(default_model_path, tmp_path):
    """Turn 2 sends turn 1's answer back otherwise than it was sampled (a client that trims it, a template that
    re-tokenizes it): the conversation's sequence is cut after the prompt it shares and continues, nothing copied.
    It was copied into another sequence (seq_cp) and the old one, idle beside it, parked (its state copied out of
    llama.cpp) before turn 2's first token: what an agent paid every turn."""
    from backends.contract.events import TextChunk

    with _model(default_model_path, tmp_path) as m:
        calls: list[str] = []
        src = m.source

        def counted(name: str) -> None:
            real = getattr(src, name)

            def wrapper(*a, **k):
                calls.append(name)
                return real(*a, **k)

            setattr(src, name, wrapper)

        m.call(lambda s: [counted(n) for n in ("seq_cp", "state_save")])
        first, done1, _ = collect(m.generate(ask("What does rule 7 say?", n=16)))
        calls.clear()
        turn2 = GenerateRequest(messages=[{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": "What does rule 7 say?"},
                                          {"role": "assistant", "content": first[:len(first) // 2]},
                                          {"role": "user", "content": "And rule 9?"}],
                                sampling=Sampling(temperature=0.0, max_tokens=8))
        before = None
        evs = []
        for ev in m.generate(turn2):
            if before is None and isinstance(ev, TextChunk):
                before = list(calls)
            evs.append(ev)
        assert evs[-1].stats.prompt_cached_tokens >= done1.stats.prompt_eval_count
        assert before == [], before
