"""A BERT embedding model and a BERT reranker the suite can make offline (random weights, ~400 KB each, < 1 s).

No real embedding or reranking model is reachable from the build machines, so the test models are *made* with the
``gguf`` package, after shared/reference/models-2026.md ("Making a tiny BERT embedding model and a BERT reranker"):
arch ``bert``, width 64, 2 blocks, 2 heads, context 512, a WordPiece vocabulary of the words below (word-start
pieces ``"\\u2581word"``, the converter's form), **mean pooling** (``pooling_type`` 1) for the embedder and **rank
pooling** (4) with a one-label classifier head for the reranker. llama-server from the same sdist serves both
(``--embedding --pooling mean``, ``--reranking``); their vectors and scores mean nothing, so tests compare with
llama.cpp's own numbers on the same files, never with expected values.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ("the a an of to and in is was on at for with by it as be this that from or are were has have had not but "
         "cat cats dog dogs sat mat sitting bird fish tree house car road sky sea river city town paris france "
         "capital country language model models retrieval search query document documents answer question rank "
         "ranking score embed embedding vector vectors local fast slow small large red blue green black white "
         "one two three four five apple orange banana bread water coffee tea book books read reading write "
         "hello world goodbye morning night day sun moon star rain snow wind hot cold").split()
SUFFIXES = ["s", "ing", "ed", "er", "ly"]  # ``##`` pieces, stored without the ``##``
N_EMBD, N_FF, N_BLOCKS, N_HEAD, N_CTX = 64, 128, 2, 2, 512
VERSION = 2  # in the cached file's name: bump when the recipe changes


def vocabulary() -> list[str]:
    pieces = SPECIAL + ["\u2581" + w for w in WORDS] + SUFFIXES + list("abcdefghijklmnopqrstuvwxyz.,?!")
    return list(dict.fromkeys(pieces))  # each piece once (llama.cpp asserts it)


def make_bert(path: Path, *, rerank: bool = False, seed: int = 0, n_embd: int = N_EMBD, n_ff: int = N_FF,
              n_blocks: int = N_BLOCKS, n_head: int = N_HEAD, rerank_template: str | None = None,
              f16: bool = False, n_ctx: int = N_CTX) -> Path:
    """Write (once, atomically) a random BERT GGUF to ``path``: an embedder (mean pooling) or, with ``rerank``, a
    reranker (rank pooling, ``cls`` + ``cls.output`` head: one score). The sizes default to the tests' tiny model;
    the benchmark makes an all-MiniLM-L6-sized one (384 wide, 6 blocks, 12 heads, feed-forward 1536).
    ``rerank_template`` is written as ``tokenizer.chat_template.rerank`` (``{query}``, ``{document}``): how
    Qwen3-Reranker's GGUF carries its prompt, which llama-server then uses instead of ``[CLS] q [SEP] d``.
    Weights are F32 unless ``f16``: llama.cpp's F16 kernels round differently for different batch sizes (up to
    ~1e-3 of a score), so only F32 weights let two servers that batch differently agree to float precision."""
    if path.is_file():
        return path
    import gguf
    import numpy as np

    rng = np.random.default_rng(seed + (1000 if rerank else 0))
    tokens = vocabulary()
    d, ff = n_embd, n_ff

    wtype = np.float16 if f16 else np.float32

    def rnd(out: int, inp: int, dtype: type | None = None) -> np.ndarray:  # numpy (out, in) = ggml ne [in, out]
        dtype = dtype or wtype
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(dtype)

    def vec(n: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(n) * scale).astype(np.float32)

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), "bert")
    w.add_name("test-bert-reranker" if rerank else "test-bert-embedder")
    w.add_context_length(n_ctx)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ff)
    w.add_block_count(n_blocks)
    w.add_head_count(n_head)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    w.add_pooling_type(gguf.PoolingType.RANK if rerank else gguf.PoolingType.MEAN)
    if rerank:
        w.add_classifier_output_labels(["LABEL_0"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("bert")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIAL) + [1] * (len(tokens) - len(SPECIAL)))
    w.add_token_type_count(2)  # required by llama.cpp's BERT loader
    w.add_bos_token_id(2)  # llama.cpp uses BOS as [CLS]
    w.add_sep_token_id(3)  # written as tokenizer.ggml.seperator_token_id
    w.add_pad_token_id(0)
    w.add_unk_token_id(1)
    w.add_mask_token_id(4)
    if rerank_template is not None:
        w.add_string("tokenizer.chat_template.rerank", rerank_template)
    t: dict[str, np.ndarray] = {
        "token_embd.weight": rnd(len(tokens), d),
        "token_types.weight": rnd(2, d, np.float32),  # F32: an F16 one aborts at warm-up
        "position_embd.weight": rnd(n_ctx, d, np.float32),
        "token_embd_norm.weight": np.ones(d, np.float32), "token_embd_norm.bias": vec(d),
    }
    for i in range(n_blocks):
        b = f"blk.{i}."
        for n in ("attn_q", "attn_k", "attn_v", "attn_output"):
            t[b + n + ".weight"], t[b + n + ".bias"] = rnd(d, d), vec(d)
        t[b + "attn_output_norm.weight"], t[b + "attn_output_norm.bias"] = np.ones(d, np.float32), vec(d)
        t[b + "ffn_up.weight"], t[b + "ffn_up.bias"] = rnd(ff, d), vec(ff)
        t[b + "ffn_down.weight"], t[b + "ffn_down.bias"] = rnd(d, ff), vec(d)
        t[b + "layer_output_norm.weight"], t[b + "layer_output_norm.bias"] = np.ones(d, np.float32), vec(d)
    if rerank:
        t["cls.weight"], t["cls.bias"] = rnd(d, d, np.float32), vec(d)
        t["cls.output.weight"], t["cls.output.bias"] = rnd(1, d, np.float32), vec(1)
    for name, arr in t.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


def embedder_path(cache: Path) -> Path:
    return make_bert(cache / "embed" / f"bert-embedder-v{VERSION}.gguf")


def reranker_path(cache: Path) -> Path:
    return make_bert(cache / "embed" / f"bert-reranker-v{VERSION}.gguf", rerank=True)


RERANK_TEMPLATE = "[CLS] query : {query} [SEP] document : {document} [SEP] answer yes or no [SEP]"


def templated_reranker_path(cache: Path) -> Path:
    """The reranker with a rerank template in its GGUF (the prompt around query and document, Qwen3-Reranker's way)."""
    return make_bert(cache / "embed" / f"bert-reranker-template-v{VERSION}.gguf", rerank=True,
                     rerank_template=RERANK_TEMPLATE)


EMBEDDER, RERANKER = "test-embed:tiny", "test-rerank:tiny"


def install_embed_models(home: Path, embedder: Path, reranker: Path) -> Any:
    """A :class:`~localllm.store.Store` under ``home`` with the made embedder and reranker pulled through the store's
    own pull path (a local stand-in for their PyPI mirrors; wheels cached in the test cache) as :data:`EMBEDDER` and
    :data:`RERANKER`, and the default model installed beside them. The catalog says the embedder is
    Matryoshka-trained down to 16 dimensions (its ``matryoshka`` sizes), so requests may shorten its vectors."""
    import hashlib

    from localllm.catalog import Catalog
    from localllm.config import paths
    from localllm.store import Store
    from tests.support import TEST_CACHE, MirrorServer, Route, build_wheel, install_copy, mirror_toml, private_paths

    mirror = MirrorServer()
    toml = ""
    for name, gguf, extra in ((EMBEDDER, embedder, 'pooling = "mean"\ndimensions = 64\nmatryoshka = [64, 32, 16]\n'),
                              (RERANKER, reranker, 'pooling = "rank"\n')):
        member = f"made_{gguf.stem.replace('-', '_')}/model.gguf"
        wheel = TEST_CACHE / "local-mirror" / f"{gguf.stem}.whl"
        if not wheel.is_file():
            build_wheel(gguf, wheel, member, compress=False)
        data = wheel.read_bytes()
        route = f"/{gguf.stem}.whl"
        mirror.routes[route] = Route(data)
        with open(gguf, "rb") as f:
            sha = hashlib.file_digest(f, "sha256").hexdigest()
        entry = mirror_toml(mirror.url + route, data, name=name, final_sha=sha, size=gguf.stat().st_size,
                            member=member, quant="F32")
        toml += entry.replace('default_quant = "F32"', extra + 'default_quant = "F32"', 1)
    pp = private_paths(home)
    install_copy(pp.models, paths().models)
    store = Store(paths=pp, catalog=Catalog.from_toml(toml))
    try:
        store.pull(EMBEDDER)
        store.pull(RERANKER)
    finally:
        mirror.close()
    return store


def llama_server_binary() -> Path | None:
    """llama.cpp's own ``llama-server``, built from the same sdist by ``benchmarks/llama_tools.py`` (``.ci/run``
    builds it before the suite); None when it is not built (this never starts a build: minutes of two cores)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("llama_tools", Path(__file__).parent.parent / "benchmarks"
                                                  / "llama_tools.py")
    assert spec is not None and spec.loader is not None
    tools = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tools)
    path = Path(tools.home()) / "build" / "bin" / "llama-server"
    return path if path.is_file() and os.access(path, os.X_OK) else None


class LlamaServer:
    """``llama-server -m MODEL ARGS`` on a free loopback port (``url``), ready (``/health`` answers 200) when
    entered, stopped on exit; its output goes to ``log``."""

    def __init__(self, binary: Path, model: Path, *args: str, log: Path | None = None, threads: int = 2):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                    "-t", str(threads), "--no-webui", *args]
        self.log = log or Path(os.environ.get("TMPDIR", "/tmp")) / f"llama-server-{self.port}.log"
        self.proc: Any = None

    def __enter__(self) -> LlamaServer:
        import subprocess
        import time

        import httpx

        self._out = open(self.log, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: "
                                   f"{self.log.read_text(errors='replace')[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.__exit__()
        raise RuntimeError(f"llama-server did not become ready in 120 s (log: {self.log})")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except Exception:  # noqa: BLE001 - it did not stop: kill it
                self.proc.kill()
                self.proc.wait()
        self._out.close()
