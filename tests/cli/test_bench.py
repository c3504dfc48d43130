"""`localllm bench`: the --json structure and the table on a tiny run of the real default model."""

from __future__ import annotations

import json

from click.testing import CliRunner

from localllm.cli import cli
from localllm.cli.bench import make_prompt, summary


def bench(*args: str):
    return CliRunner().invoke(cli, ["bench", *args], catch_exceptions=False)


def test_summary_mean_and_sample_std():
    assert summary([2.0, 4.0, 6.0]) == {"mean": 4.0, "std": 2.0, "values": [2.0, 4.0, 6.0]}
    assert summary([5.0])["std"] == 0.0


def test_json_structure_for_kv_types_and_drafts(default_model):
    r = bench(default_model.name, "--pp", "32", "--tg", "8", "-r", "2", "--kv-cache", "f16,q8_0",
              "--draft", "none,ngram", "--json")
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["model"] == default_model.name
    assert report["backend"] == "llamacpp"
    assert report["pp"] == 32 and report["tg"] == 8 and report["repetitions"] == 2
    assert isinstance(report["n_threads"], int) and report["n_threads"] >= 1
    variants = [(v["kv_cache_type"], v["draft"]) for v in report["results"]]
    assert variants == [("f16", "none"), ("f16", "ngram"), ("q8_0", "none"), ("q8_0", "ngram")]
    for v in report["results"]:
        assert "error" not in v, v
        for key in ("pp_tps", "tg_tps", "ttft_ms"):
            assert set(v[key]) == {"mean", "std", "values"}
            assert len(v[key]["values"]) == 2 and all(x > 0 for x in v[key]["values"]), (key, v)
        assert 24 <= v["pp_tokens"] <= 40  # about --pp tokens evaluated, none from the cache
        assert all(1 <= n <= 8 for n in v["tg_tokens"])
        assert v["kv_cache_bytes"] > 0 and v["n_ctx"] >= 40
        if v["draft"] == "none":
            assert v["draft_acceptance"] is None and v["draft_proposed"] == 0
    by = {(v["kv_cache_type"], v["draft"]): v for v in report["results"]}
    assert by[("q8_0", "none")]["kv_cache_bytes"] < by[("f16", "none")]["kv_cache_bytes"]


def test_table_output(default_model):
    r = bench(default_model.name, "--pp", "16", "--tg", "4", "-r", "1")
    assert r.exit_code == 0, r.output
    for col in ("pp tok/s", "tg tok/s", "TTFT ms", "KV cache", "f16", "none"):
        assert col in r.stdout


def test_prompts_of_two_salts_share_no_prefix(default_model):
    from localllm.engine import Engine
    from localllm.local import LocalRunner

    with Engine() as engine:
        runner = LocalRunner(engine)
        a = make_prompt(runner, default_model.name, 64, salt=1)
        b = make_prompt(runner, default_model.name, 64, salt=2)
        ta, tb = runner.tokenize(default_model.name, a), runner.tokenize(default_model.name, b)
    assert abs(len(ta) - 64) <= 4 and abs(len(tb) - 64) <= 4
    assert ta[:2] != tb[:2]


def test_bad_inputs_are_one_sentence(default_model):
    for args, needle in ((["--kv-cache", "f16,q5"], "q5"), (["-r", "0"], "--repetitions"),
                         (["--backend", "tpu"], "tpu")):
        r = bench(default_model.name, *args)
        assert r.exit_code == 1, r.output
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("Error:") and needle in lines[0]


def test_a_failing_variant_is_reported_in_its_row(default_model, tmp_path):
    bad = tmp_path / "draft.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    r = bench(default_model.name, "--pp", "16", "--tg", "4", "-r", "1", "--draft", f"none,{bad}", "--json")
    assert r.exit_code == 0, r.output
    results = json.loads(r.stdout)["results"]
    assert "error" not in results[0]
    assert "error" in results[1] and results[1]["error"]
