"""Audio on the CLI, as subprocesses: a local GGUF with the made audio projector beside it, a path in the prompt,
``--audio``, ``--verbose`` audio lines, ``localllm transcribe``, ``pull --mmproj`` / ``list`` / ``show`` in an
isolated home, and the errors a user can cause (exit status + one sentence on stderr)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support_audio import AUDIO_TOKENS, wav

FAST = ["--temperature", "0", "--seed", "1", "--num-predict", "4"]


def cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 300):
    return subprocess.run([sys.executable, "-m", "localllm", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})}, timeout=timeout)


@pytest.fixture
def audio_dir(tmp_path, default_model_path, audio_projector) -> Path:
    """The default model as ``model.gguf`` with the made audio projector beside it, plus a 1.5 s memo."""
    d = tmp_path / "alm"
    d.mkdir()
    try:
        os.link(default_model_path, d / "model.gguf")
    except OSError:
        shutil.copyfile(default_model_path, d / "model.gguf")
    shutil.copyfile(audio_projector, d / "mmproj-ultravox-f16.gguf")
    (d / "memo.wav").write_bytes(wav(seed=3))
    return d


def test_a_path_in_the_prompt_and_the_audio_flag(audio_dir):
    r = cli("run", "./model.gguf", "Transcribe ./memo.wav", "--verbose", *FAST, cwd=audio_dir)
    assert r.returncode == 0, r.stderr
    assert "Added audio 'memo.wav' (1.5 s)" in r.stderr
    assert f"audio tokens:         {AUDIO_TOKENS} token(s) of 1 clip(s)" in r.stderr
    assert "audio encode:         1 chunk(s) encoded in" in r.stderr
    (audio_dir / "b.wav").write_bytes(wav(seed=4))
    r = cli("run", "./model.gguf", "--audio", "memo.wav", "--audio", "b.wav", "Compare.", "--verbose", *FAST,
            cwd=audio_dir)
    assert r.returncode == 0, r.stderr
    assert f"audio tokens:         {2 * AUDIO_TOKENS} token(s) of 2 clip(s)" in r.stderr
    shown = json.loads(cli("show", "./model.gguf", "--json", cwd=audio_dir).stdout)
    assert "audio" in shown["capabilities"] and "vision" not in shown["capabilities"]


def test_transcribe_prints_the_text(audio_dir):
    r = cli("transcribe", "./model.gguf", "memo.wav", "--verbose", "--num-predict", "6", cwd=audio_dir)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and f"audio tokens:         {AUDIO_TOKENS} token(s)" in r.stderr
    again = cli("transcribe", "./model.gguf", "memo.wav", "--num-predict", "6", cwd=audio_dir)
    assert again.stdout == r.stdout  # greedy by default


def test_bad_audio_files_are_one_sentence(audio_dir, tmp_path, default_model_path):
    def refused(*args: str, says: str, cwd: Path = audio_dir) -> None:
        r = cli(*args, cwd=cwd)
        assert r.returncode != 0 and "Traceback" not in r.stderr and says in r.stderr, r.stderr

    refused("transcribe", "./model.gguf", "missing.wav", says="Cannot read the audio file missing.wav")
    (audio_dir / "fake.wav").write_text("not audio at all")
    refused("transcribe", "./model.gguf", "fake.wav", says="not a WAV, MP3 or FLAC")
    (audio_dir / "cut.wav").write_bytes(wav(seed=5)[:3000])
    refused("run", "./model.gguf", "--audio", "cut.wav", "hi", says="truncated")
    (audio_dir / "voice.ogg").write_bytes(b"OggS\x00\x02" + b"\x00" * 64)
    refused("run", "./model.gguf", "--audio", "voice.ogg", "hi", says="Ogg (Vorbis/Opus) audio is not supported")
    (tmp_path / "memo.wav").write_bytes(wav())
    os.link(default_model_path, tmp_path / "text.gguf")  # no projector beside it
    refused("transcribe", "./text.gguf", "memo.wav", says="no audio projector", cwd=tmp_path)


def test_pull_mmproj_list_and_show_say_audio(home, installed_default_model, audio_projector):
    from localllm.config import paths
    from tests.support import TEST_HOME, install_copy

    install_copy(paths().models, TEST_HOME / "data" / "models")
    r = cli("pull", "smollm2:135m", "--mmproj", str(audio_projector))
    assert r.returncode == 0, r.stderr
    assert "audio projector:" in r.stdout
    assert "GGUF+mmproj(audio)" in cli("list").stdout
    shown = cli("show", "smollm2:135m").stdout
    assert "Projector (audio)" in shown and "    audio" in shown


def test_repl_audio_command_and_a_follow_up(audio_dir):
    import io

    from localllm.cli.answer import build_settings
    from localllm.cli.interactive import Repl
    from localllm.engine import Engine
    from localllm.session import open_session

    lines = iter([f"/audio {audio_dir / 'memo.wav'}", "Transcribe it.", "And again?", "/audio missing.wav", "/bye"])
    out, err = io.StringIO(), io.StringIO()
    with Engine() as engine:
        repl = Repl(open_session(engine=engine), str(audio_dir / "model.gguf"),
                    build_settings(temperature=0, seed=1, num_predict=4, verbose=True), out=out, err=err,
                    read=lambda prompt: next(lines))
        repl.run()
    o, e = out.getvalue(), err.getvalue()
    assert "Added audio" in o and "(1.5 s)" in o and "Cannot read the audio file missing.wav" in e
    tokens = [line for line in e.splitlines() if line.startswith("audio tokens:")]
    assert tokens == [f"audio tokens:         {AUDIO_TOKENS} token(s) of 1 clip(s)"] * 2  # the clip stays in the chat
    encodes = [line for line in e.splitlines() if line.startswith("audio encode:")]
    assert encodes[1].endswith("(reused)")  # the follow-up did not encode it again
