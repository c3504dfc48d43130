"""Hostile clients (issue 46), each attack against a real server over HTTP: a web page on another site (its
``Origin``, ``Sec-Fetch-Site: cross-site``, a "simple" ``text/plain`` request that needs no CORS preflight), blob
uploads that trickle, stall, run past the limit or die, and a create request naming a file of the server."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time

import httpx
import ollama
import pytest

from tests.server.conftest import start
from tests.support import DEFAULT_MODEL, TEST_HOME, install_copy, private_paths

EVIL = "https://evil.example"
LIMIT = 1 << 20  # the servers here take blobs of up to 1 MiB
STALL = 2.0  # and drop an upload whose body sends nothing for 2 s


@pytest.fixture(scope="module")
def srv(installed_default_model, tmp_path_factory):
    """A server over a private store holding the default model (nothing is loaded: no test here generates)."""
    from localllm.engine import Engine
    from localllm.store import Store

    pp = private_paths(tmp_path_factory.mktemp("hostile-home"))
    install_copy(pp.models, TEST_HOME / "data" / "models")
    s = start(Engine(store=Store(paths=pp), keep_alive=300), max_upload=LIMIT, upload_timeout=STALL)
    yield s
    s.stop()
    s.engine.close()


def names(srv) -> set[str]:
    return {m["name"] for m in httpx.get(f"{srv.url}/api/tags").json()["models"]}


def partials(srv) -> list[str]:
    d = srv.engine.store.paths.downloads
    return sorted(p.name for p in d.glob("*.partial")) if d.is_dir() else []


def port_of(srv) -> int:
    return int(srv.url.rsplit(":", 1)[1])


def raw(srv, head: str, body: bytes = b"") -> socket.socket:
    """A connection that sent ``head`` (the request line and headers, Host added) and ``body``."""
    s = socket.create_connection(("127.0.0.1", port_of(srv)), timeout=15)
    s.sendall(f"{head}\r\nHost: 127.0.0.1:{port_of(srv)}\r\n\r\n".encode() + body)
    return s


def answer(s: socket.socket) -> tuple[int, bytes]:
    """(status, body bytes so far) of the server's answer on ``s`` (waits for the headers)."""
    data = b""
    while b"\r\n\r\n" not in data:
        got = s.recv(65536)
        if not got:
            break
        data += got
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def wait_until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


# ------------------------------------------------------------------------------------- a page on another site


def test_a_page_on_another_site_cannot_copy_a_model(srv):
    """The "simple" request a page may send without a CORS preflight: text/plain, Origin evil.example. It was a
    200 and the copy was made (CORS only hid the answer from the page)."""
    body = json.dumps({"source": DEFAULT_MODEL, "destination": "stolen"})
    r = httpx.post(f"{srv.url}/api/copy", content=body, headers={"Origin": EVIL, "Content-Type": "text/plain"})
    assert r.status_code == 403, r.text
    assert "origin is not allowed" in r.json()["error"] and "LOCALLLM_ORIGINS" in r.json()["error"]
    assert "access-control-allow-origin" not in r.headers
    # a browser that sends no Origin but marks the request as another site's (Sec-Fetch-Site), and a sandboxed page
    r = httpx.post(f"{srv.url}/api/copy", content=body, headers={"Sec-Fetch-Site": "cross-site",
                                                                   "Content-Type": "text/plain"})
    assert r.status_code == 403, r.text
    r = httpx.post(f"{srv.url}/api/copy", content=body, headers={"Origin": "null", "Content-Type": "text/plain"})
    assert r.status_code == 403, r.text
    assert "stolen" not in names(srv)


@pytest.mark.parametrize("method,path,shape", [
    ("POST", "/api/pull", "ollama"), ("POST", "/api/create", "ollama"), ("DELETE", "/api/delete", "ollama"),
    ("POST", "/api/push", "ollama"), ("POST", "/api/blobs/sha256:" + "0" * 64, "ollama"),
    ("POST", "/api/generate", "ollama"), ("POST", "/api/chat", "ollama"), ("POST", "/api/embed", "ollama"),
    ("POST", "/api/rerank", "ollama"), ("POST", "/v1/chat/completions", "openai"), ("POST", "/v1/embeddings", "openai"),
    ("POST", "/v1/rerank", "openai"), ("POST", "/v1/responses", "openai"),
    ("POST", "/v1/audio/transcriptions", "openai"), ("POST", "/v1/messages", "anthropic"),
])
def test_every_route_that_changes_or_costs_refuses_another_sites_page_in_its_apis_shape(srv, method, path, shape):
    if "victim" not in names(srv):
        srv.engine.store.copy(DEFAULT_MODEL, "victim")
    body = ('{"model": "victim", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi", "query": "q", '
            '"documents": ["a"], "input": "hi", "max_tokens": 4, "from": "victim"}')
    r = httpx.request(method, srv.url + path, content=body, headers={"Origin": EVIL, "Content-Type": "text/plain"})
    assert r.status_code == 403, r.text
    assert "victim" in names(srv)
    err = r.json()
    if shape == "ollama":
        assert isinstance(err["error"], str) and "origin is not allowed" in err["error"]
    elif shape == "openai":
        assert "origin is not allowed" in err["error"]["message"]
    else:
        assert err["type"] == "error" and "origin is not allowed" in err["error"]["message"]


def test_the_servers_own_pages_loopback_pages_and_clients_without_origin_still_work(srv):
    """Same-origin (the web UI at /ui/ calls the API from the server's own origin), a page on another loopback
    port, curl (no Origin, a form Content-Type read as JSON, as Ollama does) and the official client."""
    own = f"http://127.0.0.1:{port_of(srv)}"
    r = httpx.post(f"{srv.url}/api/copy", json={"source": DEFAULT_MODEL, "destination": "mine-a"},
                   headers={"Origin": own, "Sec-Fetch-Site": "same-origin"})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{srv.url}/api/copy", json={"source": DEFAULT_MODEL, "destination": "mine-b"},
                   headers={"Origin": "http://localhost:5173", "Sec-Fetch-Site": "same-site"})
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "http://localhost:5173"
    pre = httpx.options(f"{srv.url}/api/copy", headers={"Origin": "http://localhost:5173",
                                                         "Access-Control-Request-Method": "POST",
                                                         "Access-Control-Request-Headers": "content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://localhost:5173"
    r = httpx.post(f"{srv.url}/api/copy", content=json.dumps({"source": DEFAULT_MODEL, "destination": "mine-c"}),
                   headers={"Content-Type": "application/x-www-form-urlencoded"})  # curl -d
    assert r.status_code == 200, r.text
    ollama.Client(host=srv.url).copy(DEFAULT_MODEL, "mine-d")
    assert {"mine-a", "mine-b", "mine-c", "mine-d"} <= names(srv)
    assert httpx.get(f"{srv.url}/api/tags", headers={"Origin": own}).status_code == 200


def test_an_allowed_pages_body_must_be_json(srv):
    """A page's text/plain body is no longer read as JSON (a page's JSON needs a preflight, which CORS answers
    only for the allowed origins): 415 in the API's shape, nothing done."""
    for origin in (f"http://127.0.0.1:{port_of(srv)}", "http://localhost:3000"):
        r = httpx.post(f"{srv.url}/api/copy", content=json.dumps({"source": DEFAULT_MODEL, "destination": "plain"}),
                       headers={"Origin": origin, "Content-Type": "text/plain;charset=UTF-8"})
        assert r.status_code == 415 and "Content-Type: application/json" in r.json()["error"], r.text
    assert "plain" not in names(srv)


def test_origins_added_by_the_setting_are_allowed_and_no_other(srv):
    s = start(srv.engine, origins="https://app.example,https://*.corp.example")
    try:
        for origin, status in (("https://app.example", 200), ("https://team.corp.example", 200), (EVIL, 403),
                               ("https://app.example.evil.example", 403)):
            r = httpx.post(f"{s.url}/api/show", json={"model": DEFAULT_MODEL},
                           headers={"Origin": origin, "Sec-Fetch-Site": "cross-site"})
            assert r.status_code == status, (origin, r.text)
    finally:
        s.stop()


# ------------------------------------------------------------------------------------------------ blob uploads


def test_forty_trickling_uploads_do_not_starve_the_api(srv):
    """40 ``POST /api/blobs`` bodies trickling a byte every half second: ``/api/tags`` still answers at once
    (it got no answer in 10 s while each upload held a thread of the one small default pool)."""
    socks = [raw(srv, f"POST /api/blobs/sha256:{i:064x} HTTP/1.1\r\nContent-Length: 1000", b"G") for i in range(40)]
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.5):
            for s in socks:
                try:
                    s.send(b"G")
                except OSError:
                    pass

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        time.sleep(1.0)
        with httpx.Client(timeout=10) as client:
            for _ in range(3):
                t0 = time.monotonic()
                r = client.get(f"{srv.url}/api/tags")
                took = time.monotonic() - t0
                assert r.status_code == 200 and took < 2.0, took
            assert client.head(f"{srv.url}/api/blobs/sha256:{0:064x}").status_code == 404
            assert client.post(f"{srv.url}/api/show", json={"model": DEFAULT_MODEL}).status_code == 200
    finally:
        stop.set()
        t.join()
        for s in socks:
            s.close()
    assert wait_until(lambda: not partials(srv)), partials(srv)  # the cut uploads left nothing


def test_a_stalled_upload_is_dropped_and_leaves_nothing(srv):
    s = raw(srv, f"POST /api/blobs/sha256:{1:064x} HTTP/1.1\r\nContent-Length: 100000", b"GGUF" * 10)
    try:
        t0 = time.monotonic()
        status, body = answer(s)
        took = time.monotonic() - t0
    finally:
        s.close()
    assert status == 408 and b"stalled" in body, body
    assert STALL - 0.5 < took < STALL + 5, took
    assert wait_until(lambda: not partials(srv)), partials(srv)


def test_an_oversized_upload_is_refused_and_leaves_nothing(srv):
    store = srv.engine.store
    data = os.urandom(LIMIT + 1)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    # announced too large: refused before a byte of the body is read
    s = raw(srv, f"POST /api/blobs/{digest} HTTP/1.1\r\nContent-Length: {len(data)}")
    try:
        status, body = answer(s)
    finally:
        s.close()
    assert status == 413 and b"LOCALLLM_MAX_UPLOAD" in body, body
    # chunked, with no length: refused once it passes the limit
    s = raw(srv, f"POST /api/blobs/{digest} HTTP/1.1\r\nTransfer-Encoding: chunked")
    try:
        for i in range(0, len(data), 1 << 16):
            piece = data[i:i + (1 << 16)]
            s.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        status, body = answer(s)
    finally:
        s.close()
    assert status == 413, body
    assert not store.blob_path(digest).exists()
    assert wait_until(lambda: not partials(srv)), partials(srv)
    # at the limit it is stored
    ok = data[:LIMIT]
    r = httpx.post(f"{srv.url}/api/blobs/sha256:{hashlib.sha256(ok).hexdigest()}", content=ok)
    assert r.status_code == 201, r.text


def test_an_upload_the_disk_cannot_take_is_refused_and_leaves_nothing(srv, monkeypatch):
    """The free space is checked before a byte is written (by Content-Length) and as a chunked body is written:
    a 507, nothing left (the disk here is made "full" by asking the upload to leave more than it has free)."""
    import shutil

    import localllm.store.create as create

    store = srv.engine.store
    monkeypatch.setattr(create, "UPLOAD_RESERVE", shutil.disk_usage(store.paths.models).free + (1 << 40))
    data = b"GGUF" * 1000
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    r = httpx.post(f"{srv.url}/api/blobs/{digest}", content=data)
    assert r.status_code == 507 and "not enough disk space" in r.json()["error"], r.text
    r = httpx.post(f"{srv.url}/api/blobs/{digest}", content=iter([data]))  # chunked: no Content-Length
    assert r.status_code == 507 and "not enough disk space" in r.json()["error"], r.text
    assert not store.blob_path(digest).exists()
    assert wait_until(lambda: not partials(srv)), partials(srv)


def test_an_upload_cut_off_or_left_by_a_killed_server_leaves_nothing(srv):
    downloads = srv.engine.store.paths.downloads
    downloads.mkdir(parents=True, exist_ok=True)
    dead = downloads / f"upload-{'a' * 64}.999999999.1.partial"  # a killed server's (no process 999999999)
    dead.write_bytes(b"GGUF" * 100)
    s = raw(srv, f"POST /api/blobs/sha256:{2:064x} HTTP/1.1\r\nContent-Length: 100000", b"GGUF" * 1000)
    time.sleep(0.5)
    s.close()  # the client dies mid-body
    assert wait_until(lambda: not partials(srv)), partials(srv)
    assert not dead.exists()


# ------------------------------------------------------------------------------------------------ create


def test_create_never_takes_a_server_path(srv, tmp_path):
    """``draft``, ``from``, ``adapters``, ``files``: names or digests only. ``"draft": "/etc/hostname"`` was a 200
    (and its file was opened at load); now every path gets the same sentence, whether the file exists, is a GGUF or
    is missing, so that a caller learns nothing of the server's files."""
    gguf = srv.engine.store.get(DEFAULT_MODEL).path
    paths = ["/etc/hostname", str(gguf), str(tmp_path / "missing.gguf"), "../../etc/passwd", "~/x.gguf"]
    for field in ("draft", "from", "adapters", "files"):
        errors = set()
        for p in paths:
            body: dict[str, object] = {"model": "sneaky", "from": DEFAULT_MODEL, "stream": False}
            body[field] = {"x.gguf": p} if field in ("adapters", "files") else p
            r = httpx.post(f"{srv.url}/api/create", json=body)
            assert r.status_code == 400, (field, p, r.text)
            errors.add(r.json()["error"])
        assert len(errors) == 1, (field, errors)
        assert f"{field} must name a model or an uploaded blob" in errors.pop()
    # Ollama's old Modelfile text is not read by the server (its client parses it and uploads the files)
    r = httpx.post(f"{srv.url}/api/create", json={"model": "sneaky", "modelfile": "FROM /etc/hostname",
                                                 "stream": False})
    assert r.status_code == 400
    assert "sneaky" not in names(srv)
    # a draft that is a name or a drafting mode still makes the model
    for draft in ("ngram", DEFAULT_MODEL):
        r = httpx.post(f"{srv.url}/api/create", json={"model": "drafted", "from": DEFAULT_MODEL, "draft": draft,
                                                     "stream": False})
        assert r.status_code == 200, r.text
