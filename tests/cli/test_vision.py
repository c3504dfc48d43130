"""Images on the CLI, as subprocesses: a local GGUF with its projector beside it, a path in the prompt (as
``ollama run``), ``--image``, ``--verbose`` image lines, ``pull --mmproj`` / ``list`` / ``show`` / ``rm`` in an
isolated home, and the errors a user can cause."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support_vision import IMAGE_TOKENS, png

FAST = ["--temperature", "0", "--seed", "1", "--num-predict", "4"]


def cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 300):
    return subprocess.run([sys.executable, "-m", "localllm", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})}, timeout=timeout)


@pytest.fixture
def vision_dir(tmp_path, default_model_path, test_projector) -> Path:
    """A directory holding the default model as ``model.gguf`` and the made projector beside it, plus a photo."""
    d = tmp_path / "vlm"
    d.mkdir()
    try:
        os.link(default_model_path, d / "model.gguf")
    except OSError:
        shutil.copyfile(default_model_path, d / "model.gguf")
    shutil.copyfile(test_projector, d / "mmproj-test-f16.gguf")
    (d / "photo.png").write_bytes(png(seed=3))
    return d


def test_a_path_in_the_prompt_is_attached_and_verbose_counts_it(vision_dir):
    r = cli("run", "./model.gguf", "What is in ./photo.png?", "--verbose", *FAST, cwd=vision_dir)
    assert r.returncode == 0, r.stderr
    assert "Added image 'photo.png'" in r.stderr
    assert f"image tokens:         {IMAGE_TOKENS} token(s) of 1 image(s)" in r.stderr
    assert "image encode:         1 encoded in" in r.stderr
    plain = cli("run", "./model.gguf", "What is in ?", "--verbose", *FAST, cwd=vision_dir)
    count = [int(line.split()[3]) for out in (r.stderr, plain.stderr) for line in out.splitlines()
             if line.startswith("prompt eval count:")]
    assert count[0] >= count[1] + IMAGE_TOKENS


def test_image_flag_repeatable_and_show_says_vision(vision_dir):
    (vision_dir / "b.png").write_bytes(png(seed=4))
    r = cli("run", "./model.gguf", "--image", "photo.png", "--image", "b.png", "Compare them.", "--verbose", *FAST,
            cwd=vision_dir)
    assert r.returncode == 0, r.stderr
    assert f"image tokens:         {2 * IMAGE_TOKENS} token(s) of 2 image(s)" in r.stderr
    shown = json.loads(cli("show", "./model.gguf", "--json", cwd=vision_dir).stdout)
    assert "vision" in shown["capabilities"]
    assert shown["projector"]["path"].endswith("mmproj-test-f16.gguf")


def test_bad_image_files_are_one_sentence(vision_dir):
    r = cli("run", "./model.gguf", "--image", "missing.png", "hi", cwd=vision_dir)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "Cannot read the image missing.png" in r.stderr
    (vision_dir / "fake.png").write_text("not an image")
    r = cli("run", "./model.gguf", "--image", "fake.png", "hi", cwd=vision_dir)
    assert r.returncode != 0 and "not a PNG, JPEG" in r.stderr and "Traceback" not in r.stderr


def test_an_image_for_a_text_model(tmp_path, default_model_path):
    (tmp_path / "photo.png").write_bytes(png())
    os.link(default_model_path, tmp_path / "text.gguf")  # no projector beside it
    r = cli("run", "./text.gguf", "--image", "photo.png", "hi", *FAST, cwd=tmp_path)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "no vision projector" in r.stderr


def test_pull_mmproj_list_show_and_rm(home, installed_default_model, test_projector):
    from localllm.config import paths
    from tests.support import TEST_HOME, install_copy

    install_copy(paths().models, TEST_HOME / "data" / "models")
    r = cli("pull", "smollm2:135m", "--mmproj", str(test_projector))
    assert r.returncode == 0, r.stderr
    assert "vision projector:" in r.stdout
    listed = cli("list")
    assert "GGUF+mmproj" in listed.stdout
    entry = json.loads(cli("list", "--json").stdout)[0]
    blob = Path(entry["projector"]["path"])
    assert blob.is_file() and entry["projector"]["size"] == test_projector.stat().st_size
    assert "Projector (vision)" in cli("show", "smollm2:135m").stdout
    assert cli("rm", "smollm2:135m").returncode == 0
    assert not blob.exists()  # rm frees the projector with the weights


def test_pull_mmproj_refuses_a_projector_for_another_model(home, installed_default_model, tmp_path):
    from localllm.config import paths
    from tests.support import TEST_HOME, install_copy
    from tests.support_vision import make_projector

    install_copy(paths().models, TEST_HOME / "data" / "models")
    wide = make_projector(tmp_path / "mmproj-wide.gguf", n_embd=640)
    r = cli("pull", "smollm2:135m", "--mmproj", str(wide))
    assert r.returncode != 0 and "belongs to another model" in r.stderr and "Traceback" not in r.stderr


def test_repl_image_command_and_a_path_in_a_message(vision_dir):
    import io

    from localllm.cli.answer import build_settings
    from localllm.cli.interactive import Repl
    from localllm.engine import Engine
    from localllm.session import open_session

    (vision_dir / "b.png").write_bytes(png(seed=8))
    lines = iter([f"/image {vision_dir / 'photo.png'}", "Describe it.", f"And {vision_dir / 'b.png'}?",
                  "/image missing.png", "/bye"])
    out, err = io.StringIO(), io.StringIO()
    with Engine() as engine:
        repl = Repl(open_session(engine=engine), str(vision_dir / "model.gguf"),
                    build_settings(temperature=0, seed=1, num_predict=4, verbose=True), out=out, err=err,
                    read=lambda prompt: next(lines))
        repl.run()
        users = [m for m in repl.messages if m["role"] == "user"]
    assert [len(m.get("images", [])) for m in users] == [1, 1]  # each turn keeps its picture
    assert users[1]["content"] == "And ?"
    o, e = out.getvalue(), err.getvalue()
    assert "Added image" in o and "Cannot read the image missing.png" in e
    counts = [line for line in e.splitlines() if line.startswith("image tokens:")]
    assert counts == [f"image tokens:         {IMAGE_TOKENS} token(s) of 1 image(s)",
                      f"image tokens:         {2 * IMAGE_TOKENS} token(s) of 2 image(s)"]
    encodes = [line for line in e.splitlines() if line.startswith("image encode:")]
    assert encodes[1].startswith("image encode:         1 encoded")  # the first picture was not encoded again


def test_piped_prompt_with_a_path(vision_dir):
    r = subprocess.run([sys.executable, "-m", "localllm", "run", "./model.gguf", "--verbose", *FAST],
                       input="What is in ./photo.png?\n", capture_output=True, text=True, cwd=vision_dir, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Added image 'photo.png'" in r.stderr and f"image tokens:         {IMAGE_TOKENS}" in r.stderr


def test_an_m_rope_model_answers_as_llama_cpps_own_helper(tmp_path, mrope_model):
    """A Qwen2-VL style model (M-RoPE: an image of 6 x 4 tokens takes 6 positions) through the real CLI: the greedy
    answer is the one ``mtmd_helper_eval_chunks`` leads to on a fresh context, and the same twice."""
    from backends.contract.media import IMAGE_MARKER
    from backends.contract.specs import LoadSpec
    from backends.registry import load
    from tests.support_vision import MROPE_IMAGE, reference_in_subprocess

    model, proj = mrope_model
    d = tmp_path / "qvl"
    d.mkdir()
    try:
        os.link(model, d / "model.gguf")  # (a symlink's projector is looked for beside its target)
    except OSError:
        shutil.copyfile(model, d / "model.gguf")
    shutil.copyfile(proj, d / "mmproj-qwen2vl-f32.gguf")
    pic = png(*MROPE_IMAGE, seed=5)
    (d / "photo.png").write_bytes(pic)
    args = ("run", "./model.gguf", "--image", "photo.png", "Describe the picture.", "--temperature", "0",
            "--seed", "1", "--num-predict", "24", "--verbose")  # long: a random model's text flips rarely
    first, second = cli(*args, cwd=d), cli(*args, cwd=d)
    assert first.returncode == 0, first.stderr
    assert "image tokens:         24 token(s) of 1 image(s)" in first.stderr
    assert first.stdout.strip() and first.stdout == second.stdout
    from localllm.ggufinfo import read_gguf
    from localllm.hardware import probe
    from localllm.planner import plan

    fa = plan(read_gguf(str(model)), probe()).flash_attn  # the helper sums as the CLI's load does (off on the CPU)
    with load("llamacpp", LoadSpec(str(model), n_ctx=1024, n_threads=1)) as m:
        prompt = m.call(lambda s: s.render([{"role": "user", "content": IMAGE_MARKER + "\nDescribe the picture."}]))
        _, toks = reference_in_subprocess(str(model), str(proj), prompt, [pic], n_gen=24, flash_attn=fa)
        want = m.detokenize(toks)
    assert want.startswith(first.stdout.strip()), (first.stdout, want)
