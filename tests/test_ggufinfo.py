"""GGUF metadata: real values from the default model; corrupt files refused before any backend sees them."""

from __future__ import annotations

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


@pytest.mark.parametrize("keep", [10, 2_000_000, 60_000_000])
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
