"""``probe --model NAME`` before a pull: a catalog model that is not installed is planned from the catalog's facts
(download size, trained context, experts), marked as an estimate as ``list --catalog`` marks it."""

from __future__ import annotations

import subprocess
import sys


def test_probe_plans_a_catalog_model_before_its_pull(home):
    r = subprocess.run([sys.executable, "-m", "localllm", "probe", "--model", "gpt-oss:20b"], capture_output=True,
                       text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    line = r.stdout.split("Plan for gpt-oss:20b", 1)[1].strip().splitlines()[0]
    assert line.startswith("Not installed; an estimate from the catalog (≈")
    assert "12 GB MXFP4, ≈ " in line and "131,072-token trained context" in line
    assert "mixture of experts 21b-a3.6b, 4 of 32 experts a token" in line
    assert line.endswith("`localllm pull gpt-oss:20b` gives the exact plan.")
    r = subprocess.run([sys.executable, "-m", "localllm", "probe", "--model", "nosuch:1b"], capture_output=True,
                       text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert "The plan needs its GGUF metadata." in r.stdout
