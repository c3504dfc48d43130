"""Models of one's own (``localllm create``): the store keeps only what a Modelfile adds and shares the base's
blob; ``rm`` of the base keeps it; ``list``/``show --modelfile`` say what it is; and on the real default model the
Modelfile's SYSTEM, PARAMETERs (temperature 0, stop), MESSAGE history and TEMPLATE change the answer as they say."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from localllm.api import Done, GenerateRequest, Sampling, TextChunk
from localllm.engine import Engine
from localllm.errors import InvalidModelFileError, LocalLLMError, ModelNotFoundError
from localllm.modelfile import Modelfile, ModelfileError, apply_to_request, parse
from localllm.store import Store
from tests.support import DEFAULT_MODEL, TEST_HOME, install_copy, private_paths

TERSE = '''# a terse assistant over the default model
FROM smollm2:135m
SYSTEM """You are a pirate.
Answer in one short sentence."""
PARAMETER temperature 0
PARAMETER num_predict 12
MESSAGE user What is the capital of France?
MESSAGE assistant Paris, matey.
'''


@pytest.fixture
def store(tmp_path, installed_default_model) -> Store:
    """A private store holding the default model (its blob hard-linked from the test home)."""
    pp = private_paths(tmp_path / "home")
    install_copy(pp.models, TEST_HOME / "data" / "models")
    return Store(paths=pp)


def _blobs(store: Store) -> list[str]:
    return sorted(p.name for p in store.paths.blobs.iterdir())


# ------------------------------------------------------------------------------------------ the store


def test_derived_model_stores_only_what_it_adds_and_shares_the_blob(store):
    before = _blobs(store)
    m = store.create("terse", parse(TERSE))
    base = store.get(DEFAULT_MODEL)
    assert (m.weights_digest, m.path, m.base) == (base.weights_digest, base.path, DEFAULT_MODEL)
    assert _blobs(store) == before  # no bytes copied
    manifest = json.loads((store.paths.manifests / "library" / "terse" / "latest.json").read_text())
    assert manifest["derived"] == {
        "base": DEFAULT_MODEL, "parameters": {"temperature": 0.0, "num_predict": 12},
        "system": "You are a pirate.\nAnswer in one short sentence.", "template": None,
        "messages": [{"role": "user", "content": "What is the capital of France?"},
                     {"role": "assistant", "content": "Paris, matey."}],
        "license": [], "adapters": [], "draft": None}


def test_rm_of_the_base_keeps_the_blob_a_derived_model_needs(store):
    store.create("terse", parse(TERSE))
    blob = store.get(DEFAULT_MODEL).path
    store.remove(DEFAULT_MODEL)
    assert blob.is_file() and store.get("terse").path == blob
    assert [(m.name, m.base) for m in store.list()] == [("terse", DEFAULT_MODEL)]
    store.remove("terse")
    assert not blob.exists()  # the last user of the blob went: the blob goes too


def test_a_created_model_has_its_own_digest_a_copy_shares_it_and_rm_keeps_what_others_use(store):
    """Ollama gives a created model its own manifest digest: ``list``'s ID and ``/api/tags``' digest differ from
    the base's, a ``cp`` copy keeps its source's, the same Modelfile again gives the same one; the weights'
    digest (blobs, the prompt cache) stays shared, so ``rm`` of either keeps what the other uses."""
    from localllm.local import installed

    base = store.get(DEFAULT_MODEL)
    assert base.model_digest == base.weights_digest  # a pulled model: its weights' digest, as before
    m = store.create("terse", parse(TERSE))
    assert m.weights_digest == base.weights_digest
    assert m.model_digest != base.model_digest and m.short_id != base.short_id
    assert installed(m).digest == m.model_digest and installed(m).weights_digest == base.weights_digest
    again = store.create("terse2", parse(TERSE))
    assert again.model_digest == m.model_digest  # names and times are not part of it
    other = store.create("warmer", parse(TERSE.replace("temperature 0", "temperature 0.5")))
    assert other.model_digest not in (m.model_digest, base.model_digest)
    assert store.copy("terse", "terse-copy").model_digest == m.model_digest
    assert store.create("plain", parse(f"FROM {DEFAULT_MODEL}\n")).model_digest == base.weights_digest  # adds nothing
    cache = store.paths.prompt_cache / base.weights_digest.removeprefix("sha256:")  # the weights' saved prefixes
    cache.mkdir(parents=True)
    (cache / "entry").write_bytes(b"kv")
    store.remove("terse")
    assert store.get("terse-copy").path.is_file() and cache.is_dir()
    store.remove(DEFAULT_MODEL)
    assert store.get("terse2").path == base.path and base.path.is_file() and cache.is_dir()
    for name in ("plain", "terse2", "warmer", "terse-copy"):  # the last one is a created model
        store.remove(name)
    assert not base.path.exists() and not cache.exists()  # the last user of the weights went: their cache too


def test_a_created_model_and_its_base_load_apart_with_their_own_settings(store):
    """The scheduler keys loaded models by name: the base and a created model over the same blob with another
    ``num_ctx`` are two loaded models, each with its own context and digest (``ps``), and each request gets its
    own model's settings."""
    m = store.create("small-ctx", parse(f"FROM {DEFAULT_MODEL}\nPARAMETER num_ctx 256\nPARAMETER num_predict 2\n"))
    base = store.get(DEFAULT_MODEL)
    with Engine(store, keep_alive=60) as engine:
        req = GenerateRequest(prompt="One, two,", sampling=Sampling(temperature=0.0, seed=0, max_tokens=-1))
        _, small = _answer(engine, "small-ctx", req)
        _, full = _answer(engine, DEFAULT_MODEL, replace(req, sampling=Sampling(temperature=0, max_tokens=4)))
        loaded = {r.name: r for r in engine.ps()}
        assert set(loaded) == {"small-ctx", DEFAULT_MODEL}
        assert loaded["small-ctx"].info.n_ctx == 256 and loaded[DEFAULT_MODEL].info.n_ctx != 256
        assert (loaded["small-ctx"].digest, loaded[DEFAULT_MODEL].digest) == (m.model_digest, base.weights_digest)
        assert small.stats.eval_count <= 2 and full.stats.eval_count == 4


def test_a_model_made_from_a_derived_one_layers_over_it(store):
    store.create("terse", parse(TERSE))
    m = store.create("terser", parse("FROM terse\nPARAMETER num_predict 4\nPARAMETER stop .\n"))
    assert m.base == "terse"
    assert m.derived is not None
    assert m.derived.parameters == {"temperature": 0.0, "num_predict": 4, "stop": ["."]}
    assert m.derived.system == "You are a pirate.\nAnswer in one short sentence." and len(m.derived.messages) == 2


def test_from_a_local_gguf_copies_it_into_the_blobs_and_show_modelfile_recreates_it(store, tmp_path):
    from localllm.local import modelfile_of

    src = tmp_path / "mine.gguf"
    src.write_bytes(store.get(DEFAULT_MODEL).path.read_bytes())
    store.remove(DEFAULT_MODEL)
    assert _blobs(store) == []
    m = store.create("mine", parse(f"FROM {src}\nSYSTEM hi\n"))
    assert m.base is None and m.path.parent == store.paths.blobs and m.path.read_bytes() == src.read_bytes()
    text = modelfile_of(m)
    again = store.create("again", parse(text))
    assert again.derived is not None and m.derived is not None
    assert (again.weights_digest, again.derived.system) == (m.weights_digest, "hi")
    assert _blobs(store) == [m.path.name]


def test_bad_sources_are_one_sentence_and_register_nothing(store, tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF\x03\x00\x00\x00")  # the magic and nothing after it (CVE-2024-39720's 4 bytes and more)
    with pytest.raises(InvalidModelFileError):
        store.create("junk", parse(f"FROM {junk}\n"))
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(InvalidModelFileError, match="not a GGUF|GGUF"):
        store.create("notes", parse(f"FROM {not_gguf}\n"))
    with pytest.raises(ModelNotFoundError, match="not in the model catalog"):
        store.create("x", parse("FROM nosuchmodel:1b\n"))
    with pytest.raises(ModelNotFoundError, match="upload it to /api/blobs first"):
        store.create("x", parse("FROM sha256:" + "0" * 64 + "\n"))
    with pytest.raises(LocalLLMError, match=r"^The adapter ./lora.gguf is not a file\.$"):
        store.create("x", parse("FROM smollm2:135m\nADAPTER ./lora.gguf\n"))
    assert [m.name for m in store.list()] == [DEFAULT_MODEL]
    assert len(_blobs(store)) == 1 and not any(store.paths.downloads.glob("*.partial"))


def test_a_request_gets_the_models_system_history_and_parameters_where_it_left_the_defaults():
    mf = Modelfile("b", {"temperature": 0.0, "stop": ["END"], "num_predict": 9, "seed": 3}, system="S",
                   messages=[{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}])
    req = apply_to_request(mf, GenerateRequest(messages=[{"role": "user", "content": "q2"}]))
    assert [m["content"] for m in req.messages or []] == ["S", "q1", "a1", "q2"]
    assert (req.sampling.temperature, req.sampling.stop, req.sampling.max_tokens, req.sampling.seed) == (
        0.0, ["END"], 9, 3)
    # what the request sets wins: its own system message, its temperature and stop
    own = GenerateRequest(messages=[{"role": "system", "content": "mine"}, {"role": "user", "content": "q2"}],
                          sampling=Sampling(temperature=0.5, stop=["x"]))
    req = apply_to_request(mf, own)
    assert [m["content"] for m in req.messages or []] == ["mine", "q1", "a1", "q2"]
    assert (req.sampling.temperature, req.sampling.stop, req.sampling.max_tokens) == (0.5, ["x"], 9)
    raw = apply_to_request(mf, GenerateRequest(prompt="p"))
    assert raw.prompt == "p" and raw.sampling.stop == ["END"]


def test_a_value_the_request_chose_wins_even_when_it_is_the_default(store):
    """``temperature: 0.8`` (the engine's default) chosen by a request overrides ``PARAMETER temperature 0``, from
    every face: Ollama's options, OpenAI's and Anthropic's fields, ``run --temperature``, the REPL's ``/set``, the
    app's settings and the remote client's options; an API's own default (OpenAI's 1.0) does not."""
    import io

    from localllm.cli.answer import build_settings
    from localllm.cli.interactive import Repl
    from localllm.client import options_json
    from localllm.server.options import api_options, options_of
    from localllm.session import open_session
    from localllm.tui.answer import request_from

    mf = Modelfile("b", {"temperature": 0.0, "top_k": 1, "num_predict": 9})

    def applied(sampling: Sampling) -> Sampling:
        return apply_to_request(mf, GenerateRequest(prompt="p", sampling=sampling)).sampling

    ollama, _ = options_of({"temperature": 0.8, "top_k": 40})
    assert (applied(ollama).temperature, applied(ollama).top_k, applied(ollama).max_tokens) == (0.8, 40, 9)
    openai_unset, _ = api_options(None, {"temperature": 1.0, "top_p": 1.0})
    assert (applied(openai_unset).temperature, applied(openai_unset).top_p) == (0.0, 1.0)  # the model's, then OpenAI's
    openai_set, _ = api_options(None, {"temperature": 1.0, "top_p": 1.0}, temperature=1.0, max_tokens=3)
    assert (applied(openai_set).temperature, applied(openai_set).max_tokens) == (1.0, 3)
    anthropic, _ = api_options(None, temperature=0.8)
    assert applied(anthropic).temperature == 0.8
    assert applied(build_settings(temperature=0.8).sampling).temperature == 0.8
    assert applied(build_settings().sampling).temperature == 0.0
    tui, _ = request_from([{"role": "user", "content": "hi"}], {"temperature": 0.8, "top_k": ""})
    assert (applied(tui.sampling).temperature, applied(tui.sampling).top_k) == (0.8, 1)
    lines = iter(["/set parameter temperature 0.8", "/bye"])
    with Engine(store, keep_alive=0) as engine:  # /set loads nothing
        repl = Repl(open_session(engine=engine), DEFAULT_MODEL, build_settings(), out=io.StringIO(),
                    err=io.StringIO(), read=lambda prompt: next(lines))
        repl.run()
    assert applied(repl.settings.sampling).temperature == 0.8
    remote = options_json(GenerateRequest(prompt="p", sampling=build_settings(temperature=0.8).sampling))
    assert remote == {"temperature": 0.8}  # only what was chosen: the server's model keeps the rest


# ------------------------------------------------------------------------------------------ the CLI


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "localllm", *args], input=stdin, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture
def cli_home(home, installed_default_model) -> Path:
    from localllm.config import paths

    install_copy(paths().models, TEST_HOME / "data" / "models")
    return home


def test_cli_create_list_show_modelfile_and_stdin(cli_home, tmp_path):
    mfile = tmp_path / "Modelfile"
    mfile.write_text(TERSE)
    r = _cli("create", "terse", "-f", str(mfile))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"created 'terse' from '{DEFAULT_MODEL}'"
    assert r.stderr.splitlines()[-1] == "success"
    listed = _cli("list").stdout.splitlines()
    assert listed[0].split() == ["NAME", "ID", "SIZE", "FORMATS", "MODIFIED", "FROM"]
    terse = next(line for line in listed if line.startswith("terse ")).split()
    assert terse[-1] == DEFAULT_MODEL
    assert terse[1] != next(line for line in listed if line.startswith(DEFAULT_MODEL + " ")).split()[1]  # own ID
    shown = _cli("show", "terse", "--modelfile")
    assert shown.returncode == 0, shown.stderr
    assert parse(shown.stdout) == Modelfile(from_=DEFAULT_MODEL, **{
        k: v for k, v in parse(TERSE).__dict__.items() if k != "from_"})
    r = _cli("create", "again", "-f", "-", stdin=shown.stdout)  # the printed Modelfile recreates it
    assert r.returncode == 0, r.stderr
    assert _cli("show", "again", "--modelfile").stdout == shown.stdout
    assert _cli("show", "again", "--system").stdout == "You are a pirate.\nAnswer in one short sentence.\n"


@pytest.mark.parametrize(("text", "message"), [
    ("FROM smollm2:135m\nPARAMETER temperature warm\n",
     "Error: line 2: PARAMETER temperature must be a number, got 'warm'."),
    ("# nothing\nSYSTEM hi\n", "Error: The Modelfile has no FROM line: say which model it builds on "
                               "(FROM smollm2:135m)."),
    ("FROM smollm2:135m\n\nSTOP now\n", "Error: line 3: unknown instruction 'STOP' (a Modelfile takes FROM, "
                                        "PARAMETER, SYSTEM, TEMPLATE, MESSAGE, LICENSE, ADAPTER, DRAFT, "
                                        "PROJECTOR)."),
])
def test_cli_bad_modelfile_is_one_sentence_with_its_line_and_exit_1(cli_home, text, message):
    r = _cli("create", "bad", "-f", "-", stdin=text)
    assert (r.returncode, r.stderr.strip(), r.stdout) == (1, message, "")
    assert "bad" not in _cli("list").stdout


def test_cli_missing_modelfile(cli_home, tmp_path):
    r = _cli("create", "x", "-f", str(tmp_path / "nope"))
    assert r.returncode == 1 and r.stderr.strip().startswith("Error: There is no Modelfile at ")


# ------------------------------------------------------------------------------------------ the real model


def _answer(engine: Engine, name: str, req: GenerateRequest) -> tuple[str, Done]:
    text, done = "", None
    for ev in engine.generate(name, req):
        if isinstance(ev, TextChunk):
            text += ev.text
        elif isinstance(ev, Done):
            done = ev
    assert done is not None
    return text, done


def test_the_modelfile_changes_the_answer_as_it_says(store):
    """On the real default model: the derived model's answer to one question is, token for token, the base
    model's answer to the SYSTEM + MESSAGE history + that question at temperature 0 (the system text and the
    history reach the prompt, before the user's turn), and a PARAMETER stop cuts it where the stop begins."""
    question = [{"role": "user", "content": "And the capital of Spain?"}]
    mf = parse(TERSE)
    store.create("terse", mf)
    with Engine(store, keep_alive=60) as engine:
        by_hand = [{"role": "system", "content": mf.system}, *mf.messages, *question]
        want, want_done = _answer(engine, DEFAULT_MODEL, GenerateRequest(
            messages=by_hand, sampling=Sampling(temperature=0.0, max_tokens=12)))
        plain, plain_done = _answer(engine, DEFAULT_MODEL, GenerateRequest(
            messages=question, sampling=Sampling(temperature=0.0, max_tokens=12)))
        got, got_done = _answer(engine, "terse", GenerateRequest(messages=question))
        assert want.strip() and got == want
        assert got_done.stats.prompt_eval_count == want_done.stats.prompt_eval_count
        assert got_done.stats.prompt_eval_count > plain_done.stats.prompt_eval_count
        assert got_done.stats.eval_count <= 12  # num_predict 12
        # a stop string from inside that answer: the answer ends just before it
        words = want.split()
        assert len(words) >= 2, want  # the history taught it the style: "Madrid, matey."
        stop = words[1]
        store.create("stopper", parse(TERSE + f"PARAMETER stop {json.dumps(stop)}\n"))
        cut, cut_done = _answer(engine, "stopper", GenerateRequest(messages=question))
        assert cut == want[:want.index(stop)] and cut_done.finish_reason == "stop"


def test_a_jinja_template_replaces_the_models_own(store):
    """TEMPLATE: the derived model's prompt is what its template renders (compared with the base model given
    that text as a raw prompt: same tokens evaluated, same greedy answer); a Go construct not translated is
    refused."""
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "<|im_start|>assistant\nSure:")
    store.create("tpl", parse(f'FROM smollm2:135m\nTEMPLATE """{template}"""\nPARAMETER temperature 0\n'))
    rendered = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\nSure:"
    with Engine(store, keep_alive=60) as engine:
        got, got_done = _answer(engine, "tpl", GenerateRequest(
            messages=[{"role": "user", "content": "Name a colour."}], sampling=Sampling(max_tokens=8)))
        want, want_done = _answer(engine, DEFAULT_MODEL, GenerateRequest(
            prompt=rendered, sampling=Sampling(temperature=0.0, max_tokens=8)))
    assert got == want and got_done.stats.prompt_eval_count == want_done.stats.prompt_eval_count
    with pytest.raises(ModelfileError, match="Go-template form"):
        parse('FROM smollm2:135m\nTEMPLATE """{{ with .System }}{{ . }}{{ end }}{{ .Prompt }}"""\n')


def test_cli_run_applies_the_derived_model(cli_home, tmp_path):
    """``localllm run`` of a derived model: its history and system prompt are in the prompt (the verbose stats'
    prompt token count is the base model's with them written out by hand)."""
    assert _cli("create", "terse", "-f", "-", stdin=TERSE).returncode == 0
    derived = _cli("run", "terse", "--verbose", "And the capital of Spain?")
    assert derived.returncode == 0, derived.stderr
    plain = _cli("run", DEFAULT_MODEL, "--verbose", "--temperature", "0", "--num-predict", "12",
                 "And the capital of Spain?")

    def prompt_tokens(err: str) -> int:
        line = next(x for x in err.splitlines() if x.startswith("prompt eval count:"))
        return int(line.split(":")[1].split()[0])

    assert prompt_tokens(derived.stderr) > prompt_tokens(plain.stderr)


# ------------------------------------------------------------------------------------------ quantization


@pytest.fixture(scope="module")
def f32_models(tmp_path_factory, installed_default_model) -> Path:
    """A models directory with ``smol-f32``: the default model requantized to F32 through ``create --quantize``
    (once a module: 540 MB written)."""
    pp = private_paths(tmp_path_factory.mktemp("f32") / "home")
    install_copy(pp.models, TEST_HOME / "data" / "models")
    store = Store(paths=pp)
    m = store.create("smol-f32", parse("FROM smollm2:135m\n"), quantize="f32", requantize=True)
    assert m.quant == "F32" and m.quantized_from == store.get(DEFAULT_MODEL).weights_digest
    return pp.models


@pytest.fixture
def f32_store(tmp_path, f32_models) -> Store:
    """A private store with the default model and ``smol-f32`` (manifests copied, blobs hard-linked)."""
    pp = private_paths(tmp_path / "home")
    for manifest in ("library/smollm2/135m", "library/smol-f32/latest"):
        install_copy(pp.models, f32_models, manifest)
    store = Store(paths=pp)
    assert store.get("smol-f32").quant == "F32"
    return store


def _greedy(engine: Engine, name: str, n: int = 32) -> list[str]:
    """The greedy tokens of one prompt (as the logprobs name them)."""
    toks: list[str] = []
    req = GenerateRequest(messages=[{"role": "user", "content": "Write about the sea."}],
                          sampling=Sampling(temperature=0.0, max_tokens=n), logprobs=True)
    for ev in engine.generate(name, req):
        if isinstance(ev, TextChunk):
            toks += [lp.token for lp in ev.logprobs or []]
    return toks


def test_quantize_q8_0_and_q4_k_m_from_the_f32_variant(f32_store, capsys):
    store = f32_store
    f32 = store.get("smol-f32")
    events: list[str] = []
    q8 = store.create("smol-q8", parse("FROM smol-f32\nSYSTEM kept\n"), quantize="q8_0",
                      progress=lambda p: events.append(p.status))
    q4 = store.create("smol-q4km", parse("FROM smol-f32\n"), quantize="Q4_K_M")
    assert (q8.quant, q4.quant, q8.base, q8.quantized_from) == ("Q8_0", "Q4_K_M", "smol-f32", f32.weights_digest)
    assert q8.path.parent == store.paths.blobs and q8.weights_digest not in (f32.weights_digest, q4.weights_digest)
    assert q4.size < q8.size < f32.size / 3
    assert q8.derived is not None and q8.derived.system == "kept"
    assert any(e.startswith("quantizing F32 model to Q8_0") for e in events)
    assert any(e.startswith(f"quantized to Q8_0: {q8.size:,} bytes") for e in events)
    with Engine(store, keep_alive=0) as engine:
        ref, a8, a4 = (_greedy(engine, n) for n in ("smol-f32", "smol-q8", "smol-q4km"))
    agree8 = next((i for i, (x, y) in enumerate(zip(ref, a8, strict=False)) if x != y), len(ref))
    agree4 = next((i for i, (x, y) in enumerate(zip(ref, a4, strict=False)) if x != y), len(ref))
    with capsys.disabled():
        print(f"\n[quantize] F32 {f32.size:,} B, Q8_0 {q8.size:,} B, Q4_K_M {q4.size:,} B; greedy tokens agreeing "
              f"with F32 before the first difference (of {len(ref)}): Q8_0 {agree8}, Q4_K_M {agree4}")
    assert len(ref) == 32 and agree8 >= 4  # Q8_0 is near-lossless: it follows F32 for a while at least


def test_quantize_reports_its_progress_in_bytes_of_the_planned_size(f32_store, monkeypatch):
    """llama.cpp's quantizer has no progress callback: the output file's size is polled against the size
    llama.cpp's own plan (its dry run) gives, which is the finished file's size exactly; the phase's events climb
    to it, and the last says how big the result is."""
    import backends.llamacpp.quantize

    monkeypatch.setattr(backends.llamacpp.quantize, "POLL_SECONDS", 0.01)  # several polls however fast this machine is
    events: list[tuple[str, int, int]] = []
    q4 = f32_store.create("smol-q4km", parse("FROM smol-f32\n"), quantize="q4_K_M",
                          progress=lambda p: events.append((p.status, p.completed, p.total)))
    phase = [(done, total) for status, done, total in events if status == "quantizing F32 model to Q4_K_M"]
    assert phase[-1] == (q4.size, q4.size) and all(total == q4.size for _, total in phase)
    assert [done for done, _ in phase] == sorted(done for done, _ in phase)
    assert any(0 < done < q4.size for done, _ in phase)  # in between, not only the start and the end
    assert backends.llamacpp.quantize.planned_size(f32_store.get("smol-f32").path, "q8_0") == f32_store.create(
        "smol-q8", parse("FROM smol-f32\n"), quantize="q8_0").size
    assert any(status.startswith(f"quantized to Q4_K_M: {q4.size:,} bytes") for status, _, _ in events)


def test_cli_quantize_shows_a_bar_on_a_terminal_and_lines_when_piped(cli_home):
    """``localllm quantize`` piped: a line when the phase starts (with the planned size) and a percentage line;
    on a terminal, rich's bar as ``pull`` draws it. The last line (stdout) gives the new model's type and size."""
    import os
    import pty

    r = _cli("quantize", DEFAULT_MODEL, "f32", "smol-f32", "--requantize")
    assert r.returncode == 0, r.stderr
    assert "quantizing Q4_1 model to F32 (540 MB)" in r.stderr.splitlines()
    assert any(line.startswith("quantizing Q4_1 model to F32: 100% 540 MB/540 MB") for line in r.stderr.splitlines())
    assert r.stdout == "created 'smol-f32' (F32, 540 MB)\n"
    r = _cli("create", "smol-q4", "-f", "-", "--quantize", "q4_K_M", stdin="FROM smol-f32\nSYSTEM Be brief.\n")
    assert r.returncode == 0, r.stderr
    assert any(line.startswith("quantizing F32 model to Q4_K_M: 100% 105 MB/105 MB") for line in r.stderr.splitlines())
    assert r.stdout == "created 'smol-q4' from 'smol-f32' (Q4_K_M, 105 MB)\n"
    leader, follower = pty.openpty()
    try:
        p = subprocess.run([sys.executable, "-m", "localllm", "quantize", "smol-f32", "q8_0", "smol-q8"],
                           stdout=subprocess.PIPE, stderr=follower, text=True, timeout=300,
                           env={**os.environ, "COLUMNS": "120", "TERM": "xterm"})
        os.close(follower)
        follower = -1
        shown = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the pty's other end is closed: all was read
                break
            if not chunk:
                break
            shown += chunk
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    text = shown.decode(errors="replace")
    assert p.returncode == 0, text
    assert "quantizing F32 model to Q8_0" in text and "━" in text and "144.8/144.8 MB" in text
    assert p.stdout == "created 'smol-q8' (Q8_0, 145 MB)\n"


def test_quantize_refusals_are_one_sentence(f32_store):
    store = f32_store
    with pytest.raises(LocalLLMError, match=r"^Unknown quantization type 'q3_banana': llama.cpp's quantizer takes "):
        store.create("x", parse("FROM smol-f32\n"), quantize="q3_banana")
    with pytest.raises(LocalLLMError, match=r"is already quantized \(Q4_1\).*--requantize"):
        store.create("x", parse("FROM smollm2:135m\n"), quantize="q8_0")
    with pytest.raises(LocalLLMError, match="F32 already"):
        store.create("x", parse("FROM smol-f32\n"), quantize="f32")
    assert "x" not in {m.name for m in store.list()}


def test_a_kill_mid_quantize_registers_nothing_and_leaves_no_blob(cli_home, f32_models):
    import os
    import signal
    import time

    from localllm.config import paths

    install_copy(paths().models, f32_models, "library/smol-f32/latest")  # made by `create --quantize f32`
    assert Store().get("smol-f32").quant == "F32"
    blobs = sorted(p.name for p in paths().blobs.iterdir())
    p = subprocess.Popen([sys.executable, "-m", "localllm", "quantize", "smol-f32", "q4_K_M", "killed"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stderr is not None
        line = p.stderr.readline()
        deadline = time.monotonic() + 120
        while not line.startswith("quantizing F32 model to Q4_K_M") and time.monotonic() < deadline:
            assert line or p.poll() is None, "the quantize ended before it began"
            line = p.stderr.readline()
        time.sleep(0.3)
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.wait()
    assert "killed" not in _cli("list").stdout
    assert sorted(x.name for x in paths().blobs.iterdir()) == blobs
    # the next quantize clears what the killed one left beside the blobs
    r = _cli("quantize", "smol-f32", "q8_0", "ok")
    assert r.returncode == 0, r.stderr
    assert not list(paths().downloads.glob("quantize-*.partial"))


# ------------------------------------------------------------------------------------------ LoRA adapters


def make_lora(path: Path, base_gguf: Path, *, layers: int = 4, rank: int = 8, seed: int = 0,
              wrong_width: bool = False) -> Path:
    """A LoRA GGUF made with the ``gguf`` package: small random deltas on the first ``layers`` layers' attention
    Q and V weights of ``base_gguf`` (``wrong_width``: shapes of another model)."""
    import gguf
    import numpy as np

    from backends.gguf_header import read_header

    shapes = {t.name: t.shape for t in read_header(base_gguf).tensors}
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(rank))
    for i in range(layers):
        for part in ("attn_q", "attn_v"):
            n_in, n_out = shapes[f"blk.{i}.{part}.weight"][:2]
            if wrong_width:
                n_in += 64
            a = rng.normal(0, 0.2, (rank, n_in)).astype(np.float32)  # ggml (n_in, rank)
            b = rng.normal(0, 0.2, (n_out, rank)).astype(np.float32)  # ggml (rank, n_out)
            w.add_tensor(f"blk.{i}.{part}.weight.lora_a", a)
            w.add_tensor(f"blk.{i}.{part}.weight.lora_b", b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _first_logprobs(engine: Engine, name: str) -> list[tuple[str, float]]:
    req = GenerateRequest(messages=[{"role": "user", "content": "Say a colour."}],
                          sampling=Sampling(temperature=0.0, max_tokens=1), logprobs=True, top_logprobs=5)
    for ev in engine.generate(name, req):
        if isinstance(ev, TextChunk) and ev.logprobs:
            return [(t, round(lp, 4)) for t, lp, _ in ev.logprobs[0].top]
    raise AssertionError("no logprobs")


def test_a_lora_adapter_changes_the_logits_and_scale_0_gives_them_back(store, tmp_path):
    base = store.get(DEFAULT_MODEL)
    lora = make_lora(tmp_path / "lora.gguf", base.path)
    on = store.create("lora1", parse(f"FROM smollm2:135m\nADAPTER {lora}\n"))
    off = store.create("lora0", parse(f"FROM smollm2:135m\nADAPTER {lora} 0\n"))
    assert on.derived is not None and on.derived.adapters[0].endswith(" 1")
    assert off.derived is not None and off.derived.adapters[0].endswith(" 0")
    assert store.adapters_of(on)[0][0].parent == store.paths.blobs
    with Engine(store, keep_alive=0) as engine:
        plain, with_lora, scaled_0 = (_first_logprobs(engine, n) for n in (DEFAULT_MODEL, "lora1", "lora0"))
    assert with_lora != plain
    assert scaled_0 == plain
    # rm keeps the adapter's blob while a model uses it
    blob = store.adapters_of(on)[0][0]
    store.remove("lora1")
    assert blob.is_file()
    store.remove("lora0")
    assert not blob.exists()


def test_an_adapter_for_another_base_is_refused_at_create(store, tmp_path):
    base = store.get(DEFAULT_MODEL)
    wrong = make_lora(tmp_path / "wrong.gguf", base.path, wrong_width=True)
    with pytest.raises(InvalidModelFileError, match=r"^The adapter wrong.gguf does not fit this model: .*another base"):
        store.create("x", parse(f"FROM smollm2:135m\nADAPTER {wrong}\n"))
    with pytest.raises(InvalidModelFileError, match="is not a LoRA adapter GGUF"):
        store.create("x", parse(f"FROM smollm2:135m\nADAPTER {base.path}\n"))
    assert "x" not in {m.name for m in store.list()}


def test_repl_save_makes_a_model_of_the_session(store):
    """``/save NAME`` in the ``>>>`` prompt: the session's model, system prompt, parameters and conversation;
    ``/show modelfile`` and ``/show system`` of the saved model say so."""
    import io

    from localllm.cli.answer import build_settings
    from localllm.cli.interactive import Repl
    from localllm.session import open_session

    lines = iter(["/set parameter temperature 0", "/set parameter num_predict 4", "/set system Be brief.", "Hi",
                  "/save brief", "/load brief", "/show modelfile", "/show system", "/bye"])
    out, err = io.StringIO(), io.StringIO()
    with Engine(store, keep_alive=0) as engine:
        repl = Repl(open_session(engine=engine), DEFAULT_MODEL, build_settings(num_ctx=256), out=out, err=err,
                    read=lambda prompt: next(lines))
        repl.run()
    made = store.get("brief")
    assert made.derived is not None and made.base == DEFAULT_MODEL
    assert made.derived.system == "Be brief."
    assert made.derived.parameters == {"temperature": 0.0, "num_predict": 4, "num_ctx": 256}
    assert [m["role"] for m in made.derived.messages] == ["user", "assistant"]
    assert made.derived.messages[0]["content"] == "Hi"
    o = out.getvalue()
    assert "Created new model 'brief'" in o and "FROM smollm2:135m" in o and "PARAMETER num_ctx 256" in o
    assert "Be brief." in o


def test_a_failed_create_frees_the_blobs_it_made(store, tmp_path):
    """FROM a local file (copied into the blobs) with an adapter that does not fit: refused, and the copy goes."""
    base = store.get(DEFAULT_MODEL)
    src = tmp_path / "mine.gguf"
    src.write_bytes(base.path.read_bytes())
    wrong = make_lora(tmp_path / "wrong.gguf", base.path, wrong_width=True)
    store.remove(DEFAULT_MODEL)
    with pytest.raises(InvalidModelFileError, match="does not fit"):
        store.create("x", parse(f"FROM {src}\nADAPTER {wrong}\n"))
    assert _blobs(store) == [] and store.list() == []


def test_load_parameters_and_draft_reach_the_load(store):
    """PARAMETER num_ctx / num_thread and DRAFT (with draft_num_predict) set the load where the request leaves
    them to the planner; what a request asks for wins."""
    from localllm.loader import Loader, LoadOptions

    m = store.create("loadish", parse("FROM smollm2:135m\nPARAMETER num_ctx 512\nPARAMETER num_thread 1\n"
                                      "PARAMETER draft_num_predict 3\nDRAFT ngram\n"))
    got = Loader.model_options(m, LoadOptions())
    assert (got.num_ctx, got.num_thread, got.draft, got.num_draft) == (512, 1, "ngram", 3)
    asked = Loader.model_options(m, LoadOptions(num_ctx=1024, draft="none"))
    assert (asked.num_ctx, asked.draft) == (1024, "none")
    _, plan = Loader(store).plan("loadish")
    assert plan.n_ctx == 512


def test_a_template_applies_on_mlx_too_and_a_lora_is_refused_there(store, tmp_path):
    pytest.importorskip("mlx.core")
    from localllm.api import BackendError
    from localllm.loader import LoadOptions

    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
    store.create("tpl-mlx", parse(f'FROM smollm2:135m\nTEMPLATE """{template}"""\nPARAMETER temperature 0\n'))
    lora = make_lora(tmp_path / "lora.gguf", store.get(DEFAULT_MODEL).path)
    store.create("lora-mlx", parse(f"FROM smollm2:135m\nADAPTER {lora}\n"))
    mlx = LoadOptions(backend="mlx")
    with Engine(store, keep_alive=0) as engine:
        def count(name: str, req: GenerateRequest) -> int:
            done = [e for e in engine.generate(name, req, mlx) if isinstance(e, Done)][0]
            return done.stats.prompt_eval_count

        got = count("tpl-mlx", GenerateRequest(messages=[{"role": "user", "content": "Hi"}],
                                               sampling=Sampling(max_tokens=1)))
        want = count(DEFAULT_MODEL, GenerateRequest(prompt="[user] Hi\n[assistant] ",
                                                    sampling=Sampling(temperature=0.0, max_tokens=1)))
        assert got == want
        with pytest.raises((BackendError, LocalLLMError), match="LoRA adapters run on the llama.cpp backend only"):
            list(engine.generate("lora-mlx", GenerateRequest(prompt="x", sampling=Sampling(max_tokens=1)), mlx))


def test_probe_plans_what_the_engine_loads_for_a_created_model(store):
    """``localllm probe`` plans through the engine's own loader: a created model's ``num_ctx`` is in its plan,
    and the plan is the one the engine then loads (it once rebuilt the plan without the Modelfile's options)."""
    from localllm.cli.probe import plan_for_model
    from localllm.hardware import probe

    store.create("short-ctx", parse(f"FROM {DEFAULT_MODEL}\nPARAMETER num_ctx 512\n"))
    model, p, why = plan_for_model("short-ctx", probe(), num_ctx=None, kv_cache_type="f16", backend="auto",
                                   num_gpu=None, store=store)
    assert why is None and model is not None and p is not None
    assert p.n_ctx == 512 and any(r.startswith("context 512 tokens") for r in p.reasons), p.reasons
    with Engine(store, keep_alive=60) as engine:
        running = engine.load("short-ctx")
        assert running.model.info.n_ctx == 512
        assert running.plan.as_dict() == p.as_dict()


def test_from_a_local_gguf_takes_the_projector_beside_it_as_run_does(store, tmp_path, test_projector):
    """``FROM ./model.gguf`` with an ``mmproj*.gguf`` in the same directory: the created model has it (vision), as
    ``run ./model.gguf`` would use it; the projector is copied into the blobs."""
    import os

    d = tmp_path / "downloaded"
    d.mkdir()
    os.link(store.get(DEFAULT_MODEL).path, d / "model.gguf")
    os.link(test_projector, d / "mmproj-model-f32.gguf")
    m = store.create("seeing", parse(f"FROM {d / 'model.gguf'}\n"))
    assert m.projector is not None and m.projector.vision and m.projector.path.parent == store.paths.blobs
    assert m.projector.path.read_bytes() == test_projector.read_bytes()


def test_cli_pull_mmproj_attaches_a_projector_to_a_created_model(cli_home, tmp_path, test_projector):
    """``pull NAME --mmproj FILE`` for a model made with ``create`` (not in the catalog): the projector is attached,
    nothing is pulled."""
    mfile = tmp_path / "Modelfile"
    mfile.write_text("FROM smollm2:135m\nSYSTEM hi\n")
    assert _cli("create", "mine", "-f", str(mfile)).returncode == 0
    r = _cli("pull", "mine", "--mmproj", str(test_projector))
    assert r.returncode == 0, r.stderr
    assert "vision projector: " in r.stdout and "success: mine (" in r.stdout


def test_cli_create_with_a_projector_line_makes_a_vision_model(cli_home, tmp_path, test_projector):
    """``PROJECTOR ./mmproj.gguf`` in a Modelfile (relative to the Modelfile's folder, like FROM): the created model
    has that projector, so ``show`` lists vision; a missing file and a GGUF that is no projector are one sentence,
    exit 1, and register nothing."""
    import os

    d = tmp_path / "mine"
    d.mkdir()
    os.link(test_projector, d / "vision-proj.gguf")  # not named mmproj*: only the line names it
    (d / "Modelfile").write_text("FROM smollm2:135m\nPROJECTOR ./vision-proj.gguf\n")
    r = _cli("create", "seeing", "-f", str(d / "Modelfile"))
    assert r.returncode == 0, r.stderr
    shown = _cli("show", "seeing")
    assert shown.returncode == 0 and "    vision" in shown.stdout.splitlines(), shown.stdout
    (d / "Missing").write_text("FROM smollm2:135m\nPROJECTOR ./nope.gguf\n")
    r = _cli("create", "blind", "-f", str(d / "Missing"))
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr.strip() == f"Error: The projector {d / 'nope.gguf'} is not a file.", r.stderr
    (d / "NotProj").write_text(f"FROM smollm2:135m\nPROJECTOR {_default_gguf(cli_home)}\n")
    r = _cli("create", "blind", "-f", str(d / "NotProj"))
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1].startswith("Error: "), r.stderr
    assert "is not a vision or audio projector (mmproj) GGUF." in r.stderr
    assert "blind" not in _cli("list").stdout


def _default_gguf(home: Path) -> Path:
    from localllm.config import paths

    return Store(paths=paths()).get(DEFAULT_MODEL).path
