"""Several machines through llama.cpp's RPC backend, for real: two ``localllm worker`` processes on loopback
take the default model's layers (issue 22).

Everything that adds a worker runs in a subprocess: ggml keeps an added worker for the life of the process,
so a worker added in the test process would take the layers of every later test there. The workers serve
this machine's CPU over a socket, so the path is the one a GPU user runs (device buffers, layers split across
devices, memory reported per device), measured against the same model on the local CPU.

Needs a llama.cpp build with RPC (``.ci/run`` builds one; README "Install options").
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import DEFAULT_MODEL, TEST_HOME, install_copy

pytestmark = pytest.mark.usefixtures("installed_default_model")

PROMPT = "Name three colors."


def _rpc_build() -> bool:
    from localllm.devices import rpc_supported

    return rpc_supported()


needs_rpc = pytest.mark.skipif(not _rpc_build(), reason="this llama.cpp build has no RPC backend "
                               "(CMAKE_ARGS=-DGGML_RPC=on, README 'Install options')")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, LOCALLLM_HOME=str(home), PYTHONUNBUFFERED="1", LOCALLLM_PROMPT_CACHE_SIZE="0",
               PYTHONFAULTHANDLER="1")
    for k in ("LOCALLLM_BACKEND", "LOCALLLM_RPC", "LOCALLLM_DEVICE_MEMORY"):
        env.pop(k, None)
    env.update(extra)
    return env


@pytest.fixture
def rpc_home(tmp_path) -> Path:
    install_copy(tmp_path / "data" / "models", TEST_HOME / "data" / "models")
    return tmp_path


def _start_worker(home: Path, port: int) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-m", "localllm", "worker", "--port", str(port), "--threads", "1"],
                         env=_env(home), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # ready when it answers the protocol's hello
        try:
            from backends.llamacpp.devices import hello

            hello(f"127.0.0.1:{port}", timeout=2)
            return p
        except OSError:
            if p.poll() is not None:
                raise AssertionError(f"worker exited {p.returncode}: {p.stderr.read() if p.stderr else ''}") from None
            time.sleep(0.2)
    p.kill()
    raise AssertionError("worker did not answer within 60 s")


def _worker_capped(home: Path, room: int) -> tuple[subprocess.Popen[str], int]:
    """An RPC worker that may map ``room`` bytes more than it holds now (its address space capped), while it
    still reports its RAM free: llama.cpp's allocations past that fail on it, as on a GPU another process filled."""
    import resource

    worker = _start_worker(home, port := _free_port())
    vm = next(int(line.split()[1]) for line in Path(f"/proc/{worker.pid}/status").read_text().splitlines()
              if line.startswith("VmSize:")) * 1024
    resource.prlimit(worker.pid, resource.RLIMIT_AS, (vm + room, vm + room))
    return worker, port


@pytest.fixture
def workers(rpc_home) -> Iterator[str]:
    """Two workers on loopback; yields "127.0.0.1:P1,127.0.0.1:P2"."""
    ports = [_free_port(), _free_port()]
    procs = [_start_worker(rpc_home, p) for p in ports]
    try:
        yield ",".join(f"127.0.0.1:{p}" for p in ports)
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


# one load + a greedy answer in a subprocess: the tokens, the plan's per-device estimate, llama.cpp's allocation
_GEN = textwrap.dedent("""
    import json, os, sys
    from localllm import devices
    rpc = os.environ.get("RPC_UNDER_TEST")
    added = devices.use_workers(rpc, say=lambda line: print(line, file=sys.stderr)) if rpc else []
    from localllm.api import GenerateRequest, Sampling
    from localllm.engine import Engine
    from localllm.loader import LoadOptions
    e = Engine()
    ngl = os.environ.get("NGL")
    opts = LoadOptions(num_ctx=512, num_parallel=1, num_gpu=int(ngl) if ngl else None)
    rm = e.load(%r, opts)
    lm, plan = rm.model, rm.plan
    req = GenerateRequest(messages=[{"role": "user", "content": %r}],
                          sampling=Sampling(temperature=0, max_tokens=32, seed=1))
    from localllm.api import TextChunk
    text = "".join(ev.text for ev in lm.generate(req) if isinstance(ev, TextChunk))
    print(json.dumps({"text": text, "ngl": lm.info.n_gpu_layers, "alloc": lm.info.allocations,
                      "vram": lm.info.vram_bytes, "added": [w.endpoint for w in added],
                      "plan": [{"name": d.name, "layers": d.layers, "output": d.output, "total": d.total,
                                "kv": d.kv_cache, "usable": d.usable_bytes} for d in plan.devices],
                      "reasons": plan.reasons}))
    e.close()
    os._exit(0)
""") % (DEFAULT_MODEL, PROMPT)


def _generate(home: Path, rpc: str | None = None, **env: str) -> dict:
    extra = dict(env)
    if rpc:
        extra["RPC_UNDER_TEST"] = rpc
    r = subprocess.run([sys.executable, "-c", _GEN], env=_env(home, **extra), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1]) | {"stderr": r.stderr}


@pytest.fixture
def cpu_answer(rpc_home) -> dict:
    out = _generate(rpc_home)
    assert out["ngl"] == 0 and out["text"], out
    return out


@needs_rpc
def test_two_workers_take_the_whole_model_and_answer_as_the_cpu_does(rpc_home, workers, cpu_answer):
    out = _generate(rpc_home, workers)
    assert len(out["added"]) == 2
    assert out["ngl"] == 31  # 30 layers and the output layer
    alloc = out["alloc"]
    remote = {k: v for k, v in alloc.items() if k.startswith("RPC")}
    assert len(remote) == 2 and all(v.get("weights", 0) > 20 * 2**20 for v in remote.values()), alloc
    # the CPU keeps only the token embeddings (llama.cpp keeps the input layer on the host)
    assert alloc["CPU"]["weights"] < sum(v["weights"] for v in remote.values())
    assert out["vram"] == sum(sum(v.values()) for v in remote.values())
    # greedy on the same weights: the same 32-token answer
    assert out["text"] == cpu_answer["text"]
    # the planner's estimate of each device within 3 % of what llama.cpp allocated there (README)
    for d in out["plan"]:
        got = sum(alloc[d["name"]].values())
        print(f"RPC estimate {d['name']}: {d['total']} planned, {got} allocated ({d['total'] / got - 1:+.2%})")
        assert abs(d["total"] / got - 1) <= 0.03, (d, alloc[d["name"]])
    assert sum(d["layers"] for d in out["plan"]) == 30 and out["plan"][-1]["output"]


@needs_rpc
def test_a_device_cap_splits_the_model_between_the_workers_and_the_cpu(rpc_home, workers, cpu_answer):
    out = _generate(rpc_home, workers, LOCALLLM_DEVICE_MEMORY="RPC0=40MiB,RPC1=140MiB")
    names = [d["name"] for d in out["plan"]]
    assert names == ["RPC0", "RPC1"]
    assert 0 < out["ngl"] < 31, out["reasons"]  # partly offloaded: what does not fit stays on the CPU
    for d in out["plan"]:
        assert d["total"] <= d["usable"]
        assert d["layers"] > 0
        got = out["alloc"][d["name"]]
        assert abs(got["kv"] - d["kv"]) < 16 << 10, (d, got)  # llama.cpp put the planned layers there
        assert sum(got.values()) <= d["usable"] * 1.1, (d, got)
    assert out["alloc"]["CPU"]["weights"] > 50 * 2**20  # the rest of the layers
    assert out["text"] == cpu_answer["text"]


@needs_rpc
def test_a_worker_that_does_not_answer_is_skipped_with_one_line(rpc_home):
    dead = f"127.0.0.1:{_free_port()}"
    r = subprocess.run([sys.executable, "-m", "localllm", "run", DEFAULT_MODEL, "--rpc", dead, "--temperature", "0",
                        "--num-predict", "8", "--num-ctx", "512", "Hi"], env=_env(rpc_home), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()  # answered on the CPU
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [f"RPC worker {dead} skipped: does not answer ([Errno 111] Connection refused)"], r.stderr


@pytest.mark.parametrize("value, sentence", [
    ("127.0.0.1", "RPC worker '127.0.0.1' is not HOST:PORT (for example 127.0.0.1:50052)."),
    ("host:99999", "RPC worker 'host:99999' is not HOST:PORT (for example 127.0.0.1:50052)."),
])
def test_a_malformed_rpc_endpoint_is_one_sentence(rpc_home, value, sentence):
    r = subprocess.run([sys.executable, "-m", "localllm", "run", DEFAULT_MODEL, "--rpc", value, "Hi"],
                       env=_env(rpc_home), capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip() == f"Error: {sentence}"


def test_an_unknown_device_lists_the_devices_there_are(rpc_home):
    r = subprocess.run([sys.executable, "-m", "localllm", "run", DEFAULT_MODEL, "--device", "CUDA7", "Hi"],
                       env=_env(rpc_home), capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip() == "Error: No llama.cpp device CUDA7 here (devices: CPU)."


def test_a_worker_beyond_loopback_needs_an_explicit_flag(rpc_home):
    r = subprocess.run([sys.executable, "-m", "localllm", "worker", "--host", "0.0.0.0"], env=_env(rpc_home),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "has no authentication; add --allow-network" in r.stderr


@needs_rpc
def test_a_worker_on_a_port_in_use_is_one_sentence(rpc_home):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "localllm", "worker", "--port", str(port)], env=_env(rpc_home),
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.strip().startswith(f"Error: Cannot listen on 127.0.0.1:{port}:")


def _serve(home: Path, workers: str) -> tuple[subprocess.Popen[str], str, dict[str, str]]:
    """``localllm serve --rpc workers`` on a free port, once it answers: (process, its URL, its environment)."""
    import httpx

    port = _free_port()
    env = _env(home, LOCALLLM_HOST=f"127.0.0.1:{port}")
    srv = subprocess.Popen([sys.executable, "-m", "localllm", "serve", "--rpc", workers], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.2)
    return srv, url, env


@needs_rpc
def test_serve_with_workers_batches_and_reports_each_device_over_http(rpc_home, workers, cpu_answer):
    import concurrent.futures

    import httpx
    import ollama

    srv, url, env = _serve(rpc_home, workers)
    try:
        client = ollama.Client(host=url)
        opts = {"temperature": 0, "num_predict": 32, "num_ctx": 512, "seed": 1}

        def ask(_: int) -> str:
            r = client.chat(model=DEFAULT_MODEL, messages=[{"role": "user", "content": PROMPT}], options=opts)
            return r.message.content or ""

        with concurrent.futures.ThreadPoolExecutor(3) as pool:  # three requests decode together on the workers
            answers = list(pool.map(ask, range(3)))
        # a batch changes the kernels' summation order, so a batched greedy answer may take another path (on the
        # CPU too); each is a whole answer, and the model answers alone as the CPU does after the batch
        assert all(len(a) > 10 for a in answers), answers
        assert ask(0) == cpu_answer["text"]
        ps = httpx.get(f"{url}/api/ps", timeout=10).json()["models"][0]
        devs = {d["name"]: d for d in ps["devices"]}
        assert set(devs) == {"RPC0", "RPC1"}, ps
        for d in devs.values():  # 4 slots, a KV stream of 512 cells each: the estimate covers the allocation, by
            # at most 10 % (README; its compute buffer is fitted to one unified pool, a stream-split batch's is smaller)
            print(f"RPC estimate at 4 × 512 cells {d}: {d['estimate'] / d['size'] - 1:+.2%}")
            assert d["size"] > 0 and 0 <= d["estimate"] / d["size"] - 1 <= 0.10, d
        assert ps["size_vram"] == sum(d["size"] for d in devs.values())
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        for name, d in devs.items():  # Prometheus' text format: label order and float spelling are its own
            got = re.search(rf'^localllm_device_memory_bytes{{device="{name}",model="{re.escape(DEFAULT_MODEL)}"}} '
                            r"(\S+)$", metrics, re.M)
            assert got and float(got.group(1)) == d["size"], metrics[-2000:]
            assert f'localllm_device_memory_estimate_bytes{{device="{name}",model="{DEFAULT_MODEL}"}}' in metrics
        r = subprocess.run([sys.executable, "-m", "localllm", "ps"], env=env, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0 and f"{DEFAULT_MODEL} on RPC0 (127.0.0.1:" in r.stdout, r.stdout + r.stderr
    finally:
        srv.terminate()
        try:
            srv.wait(30)
        except subprocess.TimeoutExpired:
            srv.kill()
    err = srv.stderr.read() if srv.stderr else ""
    assert "RPC worker 127.0.0.1:" in err and "Traceback" not in err, err


@needs_rpc
def test_a_worker_killed_mid_answer_fails_that_request_and_the_server_stays_up(rpc_home, cpu_answer):
    import httpx
    import ollama

    ports = [_free_port(), _free_port()]
    procs = [_start_worker(rpc_home, p) for p in ports]
    srv, url, _ = _serve(rpc_home, ",".join(f"127.0.0.1:{p}" for p in ports))
    try:
        client = ollama.Client(host=url, timeout=40)
        # a raw count goes on for hundreds of tokens: the worker dies in the middle of it
        stream = client.generate(model=DEFAULT_MODEL, prompt="1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", raw=True,
                                 options={"temperature": 0, "num_predict": 400, "num_ctx": 512}, stream=True)
        got = []
        try:
            with pytest.raises(ollama.ResponseError) as e:
                for chunk in stream:
                    got.append(chunk.response)
                    if len(got) == 3:
                        procs[1].kill()  # the worker holding the last layers and the output layer
        except BaseException:
            code = srv.poll()
            srv.kill()
            log = srv.stderr.read() if srv.stderr else ""
            raise AssertionError(f"server exit status {code}; its log:\n{log[-4000:]}") from None
        assert len(got) >= 3
        assert f"RPC worker 127.0.0.1:{ports[1]} stopped answering while this model used it" in str(e.value)
        # the server is up, and the next request loads the model again without the dead worker
        r = client.chat(model=DEFAULT_MODEL, messages=[{"role": "user", "content": PROMPT}],
                        options={"temperature": 0, "num_predict": 32, "num_ctx": 512, "seed": 1})
        assert r.message.content == cpu_answer["text"]
        ps = httpx.get(f"{url}/api/ps", timeout=10).json()["models"]
        assert [d["name"] for d in ps[0]["devices"]] == ["RPC0"], ps
    finally:
        srv.terminate()
        try:
            srv.wait(30)
        except subprocess.TimeoutExpired:
            srv.kill()
        for p in procs:
            p.kill()
    assert srv.returncode is not None


@needs_rpc
def test_a_worker_out_of_memory_at_load_falls_back_to_fewer_layers_then_the_cpu(rpc_home, cpu_answer):
    # the worker may map 40 MiB more than it holds now: less than the output layer's compute buffer
    # (~97 MiB), so every offload fails on it, while it reports 24 GiB free
    worker, port = _worker_capped(rpc_home, 40 << 20)
    try:
        r = subprocess.run([sys.executable, "-m", "localllm", "run", DEFAULT_MODEL, "--rpc", f"127.0.0.1:{port}",
                            "--temperature", "0", "--seed", "1", "--num-predict", "32", "--num-ctx", "512", PROMPT],
                           env=_env(rpc_home, LOCALLLM_NUM_PARALLEL="1"), capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == cpu_answer["text"].strip()
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert lines == [f"{DEFAULT_MODEL}: out of device memory at load with 31 layers offloaded; loading with 15 "
                         "layers offloaded",
                         f"{DEFAULT_MODEL}: out of device memory at load with 15 layers offloaded; loading on the "
                         "CPU only"], r.stderr
        assert worker.poll() is None  # the worker lives on
    finally:
        worker.kill()
        worker.wait(10)


@needs_rpc
def test_probe_lists_the_workers_devices_and_plans_over_them(rpc_home, workers):
    r = subprocess.run([sys.executable, "-m", "localllm", "probe", "--rpc", workers, "--json"], env=_env(rpc_home),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    remote = [d for d in out["devices"] if d["remote"]]
    assert [(d["name"], d["endpoint"]) for d in remote] == [("RPC0", workers.split(",")[0]),
                                                            ("RPC1", workers.split(",")[1])]
    assert all(d["total_bytes"] > 0 and d["type"] == "gpu" for d in remote)
    assert out["rpc"] is True
    assert out["plan"]["device"] == "gpu" and [d["name"] for d in out["plan"]["devices"]] == ["RPC0", "RPC1"]
    text = subprocess.run([sys.executable, "-m", "localllm", "probe", "--rpc", workers], env=_env(rpc_home),
                          capture_output=True, text=True, timeout=120).stdout
    assert workers.split(",")[0] in text and "llama.cpp on RPC0 + RPC1" in text, text
    assert re.search(r"- RPC0 \(127\.0\.0\.1:\d+\): 16 layers, \d+ MiB of [\d.]+ GiB usable", text), text


@needs_rpc
def test_tensor_split_places_the_layers_as_asked_and_a_wrong_count_is_one_sentence(rpc_home, workers):
    script = _GEN.replace("opts = LoadOptions(num_ctx=512, num_parallel=1,",
                          "opts = LoadOptions(num_ctx=512, num_parallel=1, tensor_split=(3.0, 1.0),")
    assert script != _GEN
    r = subprocess.run([sys.executable, "-c", script], env=_env(rpc_home, RPC_UNDER_TEST=workers),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    layers = {d["name"]: d["layers"] + d["output"] for d in out["plan"]}
    assert layers == {"RPC0": 24, "RPC1": 7}, layers  # llama.cpp: layer i goes first while i / 31 < 3/4
    kv = {d["name"]: d["kv"] for d in out["plan"]}
    for name, want in kv.items():  # llama.cpp put them there
        assert abs(out["alloc"][name]["kv"] - want) < 16 << 10, (name, out["alloc"])
    bad = subprocess.run([sys.executable, "-m", "localllm", "run", DEFAULT_MODEL, "--rpc", workers,
                          "--tensor-split", "1,1,1", "Hi"], env=_env(rpc_home), capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 1
    assert bad.stderr.strip() == ("Error: --tensor-split has 3 values for 2 devices (RPC0, RPC1): give one each.")


@needs_rpc
def test_the_prompt_cache_on_disk_saves_and_restores_a_prefix_held_on_the_workers(rpc_home, workers):
    system = " ".join(f"Rule {i}: answer briefly and politely about topic number {i}." for i in range(60))
    args = [sys.executable, "-m", "localllm", "run", DEFAULT_MODEL, "--rpc", workers, "--system", system,
            "--temperature", "0", "--seed", "1", "--num-predict", "8", "--num-ctx", "2048", "--verbose"]
    env = _env(rpc_home, LOCALLLM_PROMPT_CACHE_SIZE="1GiB", LOCALLLM_NUM_PARALLEL="1")
    first = subprocess.run([*args, "What is topic 3?"], env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    # a new process: the KV cells of the long system prompt, saved from the workers' devices, come back there
    second = subprocess.run([*args, "What is topic 7?"], env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    m = re.search(r"prompt cache: +(\d+) token\(s\) reused \((\d+) restored from disk\)", second.stderr)
    assert m and int(m.group(2)) >= 512, second.stderr
    assert second.stdout.strip()
