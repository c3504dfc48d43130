"""GGUF metadata: real values from the default model, the same as llama.cpp reads, read fast and once per
content; corrupt files refused before any backend sees them."""

from __future__ import annotations

import os
import time

import pytest

from localllm.errors import InvalidModelFileError
from localllm.ggufinfo import read_gguf


def test_reads_default_model_metadata(default_model_path):
    info = read_gguf(default_model_path)
    assert info.architecture == "llama"
    assert info.n_layers == 30
    assert info.n_head_kv == 3 and info.head_dim_k == 64
    assert info.vocab_size == 49152
    assert info.context_length == 8192
    assert info.file_type == "Q4_1"
    assert 130e6 < info.parameters < 140e6 and info.parameter_label == "135M"
    assert "im_start" in (info.chat_template or "")
    # K+V, 30 layers x 3 heads x 64 dims, f16 = 2 bytes
    assert info.kv_bytes_per_token("f16") == 30 * 3 * 128 * 2
    assert info.kv_bytes_per_token("q8_0") < info.kv_bytes_per_token("f16") / 1.8


# 1 MB: inside the token strings (skipped, not parsed); 1.775 MB: inside the tensor table
@pytest.mark.parametrize("keep", [10, 1_000_000, 1_775_000, 2_000_000, 60_000_000])
def test_truncated_file_is_refused(default_model_path, tmp_path, keep):
    bad = tmp_path / "cut.gguf"
    with open(default_model_path, "rb") as src:
        bad.write_bytes(src.read(keep))
    with pytest.raises(InvalidModelFileError) as e:
        read_gguf(bad)
    assert "cut.gguf" in str(e.value) and "\n" not in str(e.value)


def test_not_a_gguf_is_refused(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(InvalidModelFileError, match="not a GGUF"):
        read_gguf(bad)
    with pytest.raises(InvalidModelFileError, match="not a file"):
        read_gguf(tmp_path / "missing.gguf")


def test_header_is_what_llama_cpp_reads(default_model_path):
    """The fast header reader agrees with ggml's C reader (through llama.cpp): every scalar key and value,
    the parameter count and tensor bytes, and the vocabulary it skipped and reads on demand."""
    import ctypes

    import llama_cpp

    from backends.gguf_header import LazyArray, read_header

    h = read_header(default_model_path)
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(str(default_model_path).encode(),
                                                 llama_cpp.llama_model_default_params())
    assert model
    try:
        buf = ctypes.create_string_buffer(1 << 16)
        theirs = {}
        for i in range(llama_cpp.llama_model_meta_count(model)):
            llama_cpp.llama_model_meta_key_by_index(model, i, buf, len(buf))
            key = buf.value.decode()
            llama_cpp.llama_model_meta_val_str_by_index(model, i, buf, len(buf))
            theirs[key] = buf.value.decode()
        ours = {k: v for k, v in h.fields.items() if not isinstance(v, list | LazyArray)}  # llama.cpp skips arrays
        assert set(ours) == set(theirs) and len(ours) > 25
        for key, v in ours.items():
            if isinstance(v, bool):
                assert theirs[key] == str(v).lower(), key
            elif isinstance(v, float):
                assert float(theirs[key]) == pytest.approx(v, rel=1e-5), key
            else:
                assert theirs[key] == str(v), key
        assert sum(t.n_elements for t in h.tensors) == llama_cpp.llama_model_n_params(model)
        assert sum(t.n_bytes for t in h.tensors) == llama_cpp.llama_model_size(model)
        vocab = llama_cpp.llama_model_get_vocab(model)
        tokens = h.fields["tokenizer.ggml.tokens"]
        assert isinstance(tokens, LazyArray) and len(tokens) == llama_cpp.llama_vocab_n_tokens(vocab) == 49152
        assert tokens.read() == [llama_cpp.llama_vocab_get_text(vocab, i).decode() for i in range(len(tokens))]
        types = h.fields["tokenizer.ggml.token_type"].read()  # numbers: one numpy read
        control = [i for i in range(len(types)) if llama_cpp.llama_vocab_is_control(vocab, i)]
        assert len(types) == len(tokens) and control == [i for i, t in enumerate(types.tolist()) if t == 3] != []
    finally:
        llama_cpp.llama_model_free(model)


def test_metadata_reads_in_well_under_a_second(default_model_path):
    """The vocabulary is skipped, not parsed (``gguf.GGUFReader`` took 3.5-5 s for this header)."""
    import backends.gguf_header  # noqa: F401  (numpy and gguf imported: the read alone is timed)

    t = time.perf_counter()
    read_gguf(default_model_path)
    assert time.perf_counter() - t < 1.0


def test_metadata_is_read_once_per_content_whatever_the_path(home, default_model_path, tmp_path, monkeypatch):
    """Two paths to the same bytes: the second's metadata comes from the cache keyed by content digest
    (with its own path in it), and a second look at either reads nothing."""
    import localllm.ggufinfo as gi
    from localllm.store import Store

    paths = [tmp_path / "a.gguf", tmp_path / "b.gguf"]
    for p in paths:
        os.link(default_model_path, p)
    reads = []
    real = gi._read_gguf
    monkeypatch.setattr(gi, "_read_gguf", lambda p: reads.append(p) or real(p))
    a, b = (Store().get(str(p)) for p in paths)
    assert Store().get(str(paths[0])).info == a.info
    assert reads == [paths[0]]
    assert a.weights_digest == b.weights_digest
    assert b.info["path"] == str(paths[1]) and b.info == {**a.info, "path": str(paths[1])}


def test_expert_tensors_are_counted_per_layer_and_the_rest_by_class(moe_model, default_model_path):
    """A mixture of experts: each layer's ``ffn_*_exps`` bytes (what llama.cpp's ``--cpu-moe`` keeps in RAM) apart
    from its attention and router, read from the tensor table; a dense model has none."""
    import gguf

    info = read_gguf(moe_model)
    assert (info.n_experts, info.n_experts_used) == (4, 2)
    reader = gguf.GGUFReader(str(moe_model))
    want = [sum(int(t.n_bytes) for t in reader.tensors if t.name.startswith(f"blk.{i}.") and "_exps" in t.name)
            for i in range(info.n_layers)]
    assert list(info.expert_bytes) == want and all(want)
    tb = info.extra["tensor_bytes"]
    assert all(0 < e < layer for e, layer in zip(info.expert_bytes, tb["layers"], strict=True))
    classes = tb["classes"]
    assert sum(classes.values()) == sum(int(t.n_bytes) for t in reader.tensors)
    assert classes["ffn_up_exps"] + classes["ffn_gate_exps"] + classes["ffn_down_exps"] == sum(want)
    assert classes["attn_q"] and classes["ffn_gate_inp"] and classes["token_embd"]
    dense = read_gguf(default_model_path)
    assert dense.expert_bytes == () and dense.n_experts == 0 and dense.extra["tensor_bytes"]["classes"]["attn_q"]
