"""Read and validate GGUF metadata (``backends.gguf_header``: the ``gguf`` package's layout, long arrays skipped).

``read_gguf(path)`` returns a :class:`GGUFInfo` or raises :class:`InvalidModelFileError` with one
sentence. A file whose header, tensor offsets or tensor sizes do not fit its length is refused
here, before any backend sees it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from localllm.errors import InvalidModelFileError

GGUF_MAGIC = b"GGUF"

# general.file_type → name (llama_ftype in llama.h)
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
    23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M",
    30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4",
}

# architectures whose state is recurrent (no partial KV rollback → no speculative decoding,
# no prefix reuse beyond an exact match)
MTP_HEAD_ARCH = "gemma4-assistant"  # llama.cpp's architecture of a separate MTP drafter head (Gemma 4)
RECURRENT_ARCHS = {"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"}
HYBRID_ARCHS = {"jamba", "falcon-h1", "granitehybrid", "plamo2", "lfm2", "nemotron_h", "qwen3next",
                "qwen35", "qwen3_5"}


@dataclass
class GGUFInfo:
    path: str
    file_size: int
    architecture: str
    name: str | None
    n_layers: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int
    context_length: int
    vocab_size: int
    file_type: str  # quantization, e.g. "Q4_K_M"
    parameters: int  # parameter count (sum of tensor elements)
    chat_template: str | None
    license: str | None
    sliding_window: int | None = None
    tokenizer_model: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # the GGUF's own pooling head (``<arch>.pooling_type``): "mean", "cls", "last" (an embedding model), "rank" (a
    # reranker); None for a model that generates text
    pooling: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # multi-token-prediction (MTP, "nextn") layers llama.cpp can draft from (``{arch}.nextn_predict_layers``; the
    # last ones of ``block_count``); 0 = none. A Gemma 4 drafter head is its own file (architecture MTP_HEAD_ARCH).
    mtp_layers: int = 0
    swa_layers: int = 0  # layers with a sliding window (``sliding_window`` tokens)
    # layers of the trunk (not the MTP layers, which the target's context never holds) with a recurrent state instead
    # of a KV cache (hybrid, recurrent models)
    recurrent_layers: int = 0
    recurrent_bytes: int = 0  # that state, all recurrent layers, per sequence (F32, as llama.cpp keeps it)
    # a mixture of experts: experts per layer (``{arch}.expert_count``) and used per token; 0 = a dense model. The
    # expert tensors' bytes per layer are ``expert_bytes`` (``extra["tensor_bytes"]["experts"]``).
    n_experts: int = 0
    n_experts_used: int = 0
    n_ff_exp: int = 0  # an expert's feed-forward width (``{arch}.expert_feed_forward_length``)

    @property
    def is_recurrent(self) -> bool:
        return self.architecture in RECURRENT_ARCHS

    @property
    def is_hybrid(self) -> bool:
        return self.architecture in HYBRID_ARCHS

    @property
    def is_mtp_head(self) -> bool:
        """A drafter head for multi-token prediction, not a model to chat with (Gemma 4's ``mtp-*.gguf``)."""
        return self.architecture == MTP_HEAD_ARCH

    @property
    def expert_bytes(self) -> tuple[int, ...]:
        """Bytes of each layer's expert tensors (``blk.N.ffn_{gate,up,down,gate_up}_exps``, the ones llama.cpp's
        ``--cpu-moe`` keeps in RAM), blk.0 first; () for a dense model or an entry read before they were counted.
        """
        tb = (self.extra or {}).get("tensor_bytes")
        experts = tb.get("experts") if isinstance(tb, dict) else None
        return tuple(int(x) for x in experts) if isinstance(experts, list) and any(experts) else ()

    @property
    def parameter_label(self) -> str:
        p = self.parameters
        if p >= 1e9:
            return f"{p / 1e9:.1f}B"
        return f"{p / 1e6:.0f}M"

    @property
    def attention_layers(self) -> int:
        """Layers whose KV cache the target's context holds: the trunk's (``block_count`` less the MTP layers, which
        only an MTP context holds: llama.cpp filters them out of the target's memory) less its recurrent ones."""
        return max(self.n_layers - self.mtp_layers - self.recurrent_layers, 0)

    def kv_bytes_per_token(self, kv_type: str = "f16") -> float:
        """Bytes of K+V cache per context token for all attention layers (a windowed one counted whole)."""
        return self.attention_layers * self.kv_bytes_per_layer_token(kv_type)

    def kv_bytes_per_layer_token(self, kv_type: str = "f16") -> float:
        """Bytes of K+V cache per context token of one attention layer (an MTP layer's too)."""
        per_elem = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}[kv_type]
        return self.n_head_kv * (self.head_dim_k + self.head_dim_v) * per_elem

    def memory_bytes(self, n_cells: int, kv_type: str = "f16", *, slots: int = 1, swa_full: bool = False,
                     n_ubatch: int = 512) -> int:
        """What llama.cpp allocates for the memory of ``n_cells`` context cells (all slots) with ``slots``
        slots (localllm gives llama.cpp two sequence ids a slot): global layers hold every cell; windowed ones
        ``sliding_window`` per sequence id + a batch, padded to 256 (unless ``swa_full``); recurrent layers
        one state per sequence id.

        >>> g = GGUFInfo(path="", file_size=0, architecture="gemma3", name=None, n_layers=6, n_embd=640,
        ...     n_head=4, n_head_kv=1, head_dim_k=256, head_dim_v=256, context_length=32768, vocab_size=262144,
        ...     file_type="Q4_K_M", parameters=0, chat_template=None, license=None, sliding_window=512,
        ...     swa_layers=5)
        >>> g.memory_bytes(32768) // (1 << 20), g.memory_bytes(32768, swa_full=True) // (1 << 20)
        (39, 192)
        """
        per_layer = self.kv_bytes_per_layer_token(kv_type)
        ids = 2 * max(slots, 1)
        swa = 0 if swa_full or not self.sliding_window else min(self.swa_layers, self.attention_layers)
        window = min(n_cells, -(-((self.sliding_window or 0) * ids + n_ubatch) // 256) * 256) if swa else 0
        attn = self.attention_layers - swa
        return int(per_layer * (attn * n_cells + swa * window) + self.recurrent_bytes * ids)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_gguf(path: str | os.PathLike[str], *, digest: str | None = None) -> GGUFInfo:
    """Parse and validate ``path``. Raises :class:`InvalidModelFileError` on anything wrong.

    With ``digest`` (the file's ``sha256:...``, which the store knows) the result is cached under the cache
    dir by content, so a file is read once however many names or paths it has.
    """
    p = Path(path)
    key_file = _cache_file(digest) if digest else None
    if key_file is not None and key_file.is_file():
        try:
            cached = json.loads(key_file.read_text())
            return replace(GGUFInfo(**cached), path=str(p))
        except (OSError, ValueError, TypeError):
            pass
    info = _read_gguf(p)
    if key_file is not None:
        try:
            key_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = key_file.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(info.as_dict()))
            os.replace(tmp, key_file)
        except OSError:
            pass
    return info


def _pooling(value: Any) -> str | None:
    from backends.core.pooling import POOLING_TYPES

    return POOLING_TYPES.get(int(value)) if isinstance(value, int | float) else None


def capabilities_of(info: dict[str, Any]) -> list[str] | None:
    """The capabilities of an embedding or rerank model (``["embedding"]``, ``["rerank"]``: it pools, it does not
    generate), from the GGUF metadata cached at install; None for a model that generates text.

    >>> capabilities_of({"pooling": "rank"}), capabilities_of({"pooling": "mean"}), capabilities_of({})
    (['rerank'], ['embedding'], None)
    """
    pooling = info.get("pooling")
    if not pooling:
        return None
    return ["rerank"] if pooling == "rank" else ["embedding"]


def projector_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A projector GGUF's scalar metadata (``clip.*``, ``general.architecture``): Ollama's ``projector_info``.
    Empty when the header cannot be read (the model still answers)."""
    from backends.gguf_header import read_header

    try:
        fields = read_header(path, tensors=False).fields
    except Exception:  # noqa: BLE001 - an unreadable header says nothing
        return {}
    return {k: v for k, v in fields.items() if isinstance(v, str | int | float | bool)
            and (k.startswith("clip.") or k == "general.architecture")}


def check_gguf_file(p: Path) -> None:
    """Refuse, in one sentence, a path that is not a file or does not start with the GGUF magic."""
    if not p.is_file():
        raise InvalidModelFileError(f"{p} is not a file.")
    with open(p, "rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        raise InvalidModelFileError(f"{p.name} is not a GGUF file (it does not start with the GGUF magic).")


def info_of(data: dict[str, Any], path: str | os.PathLike[str] | None = None, digest: str | None = None) -> GGUFInfo:
    """A :class:`GGUFInfo` from a manifest's ``info``; one written before the memory layout was read (no
    ``swa_layers``) gets it from the file's header (``path``), so the planner counts windows and states."""
    info = GGUFInfo(**data)
    old = ("swa_layers" not in data and (info.sliding_window or info.is_recurrent or info.is_hybrid)
           or "n_experts" not in data  # read before the expert tensors were counted
           # an MTP build with recurrent layers: read before they were counted without the MTP layers (cheap: the
           # header is read once by content)
           or bool(info.mtp_layers and (info.is_recurrent or info.is_hybrid)))
    if old and (path or info.path):
        try:
            fresh = read_gguf(path or info.path, digest=digest)
        except (InvalidModelFileError, OSError):
            return info
        info = replace(info, swa_layers=fresh.swa_layers, recurrent_layers=fresh.recurrent_layers,
                       recurrent_bytes=fresh.recurrent_bytes, n_experts=fresh.n_experts,
                       n_experts_used=fresh.n_experts_used, n_ff_exp=fresh.n_ff_exp,
                       extra={**(info.extra or {}), **fresh.extra})
    return info


def _cache_file(digest: str) -> Path:
    from localllm.config import paths

    # the version names what an entry holds (v3: the memory layout, MTP layers, pooling; v4: expert tensor bytes by
    # layer and by class, the experts' width; v5: recurrent layers of the trunk only, not its MTP layers): an older
    # one is read again
    return paths().cache / "gguf-info" / f"{digest.removeprefix('sha256:')}.v5.json"


def _other_parts(first: Path, count: Any) -> list[tuple[Any, Path]]:
    """The headers of a split GGUF's other parts (``-00002-of-0000N.gguf`` ...), read from beside ``first``;
    [] for a whole file. A missing or unreadable part is refused in one sentence."""
    import re

    from backends.gguf_header import GGUFHeaderError, read_header

    n = int(count) if isinstance(count, int | float) else 1
    m = re.fullmatch(r"(.*)-00001-of-(\d{5})\.gguf", first.name)
    if n <= 1 or m is None:
        return []
    out = []
    for i in range(2, n + 1):
        part = first.with_name(f"{m.group(1)}-{i:05d}-of-{n:05d}.gguf")
        if not part.is_file():
            raise InvalidModelFileError(f"{first.name} is part 1 of {n}; {part.name} is missing beside it.")
        try:
            out.append((read_header(part), part))
        except (GGUFHeaderError, OSError) as e:
            raise InvalidModelFileError(f"{part.name} is corrupt or truncated: {e}.") from None
    return out


def _read_gguf(p: Path) -> GGUFInfo:
    check_gguf_file(p)
    from backends.gguf_header import GGUFHeaderError, read_header

    try:
        header = read_header(p)
    except (GGUFHeaderError, OSError) as e:
        raise InvalidModelFileError(f"{p.name} is corrupt or truncated: {e}.") from None
    size = header.file_size

    n_params = 0
    nextn_layers: set[int] = set()  # blocks that carry MTP ("nextn") tensors
    # weight bytes by where llama.cpp puts them (the planner splits GPU/CPU with this)
    split: dict[str, Any] = {"token_embd": 0, "output": None, "other": 0, "layers": {}, "experts": {}, "classes": {}}
    # a split GGUF (NAME-00001-of-0000N.gguf, llama.cpp loads the rest from beside it): all parts' tensors count
    parts = [(header, p)] + _other_parts(p, header.fields.get("split.count"))
    total = 0
    for part_header, part_path in parts:
        total += part_header.file_size
        for t in part_header.tensors:
            stop = t.offset + t.n_bytes
            if stop > part_header.file_size:
                raise InvalidModelFileError(f"{part_path.name} is truncated: tensor {t.name} ends at byte {stop:,} "
                                            f"but the file has {part_header.file_size:,} bytes.")
    for t in (t for h, _ in parts for t in h.tensors):
        if t.name.startswith("blk.") and t.name.split(".")[1].isdigit():
            i = int(t.name.split(".")[1])
            split["layers"][i] = split["layers"].get(i, 0) + t.n_bytes
            if ".nextn." in t.name:
                nextn_layers.add(i)
            if EXPERTS_RE.search(t.name):
                split["experts"][i] = split["experts"].get(i, 0) + t.n_bytes
        elif t.name == "token_embd.weight":
            split["token_embd"] += t.n_bytes
        elif t.name == "output.weight":
            split["output"] = t.n_bytes  # None = tied to token_embd
        else:
            split["other"] += t.n_bytes
        n_params += t.n_elements
        cls = _tensor_class(t.name)
        split["classes"][cls] = split["classes"].get(cls, 0) + t.n_bytes
    size = total
    if not any(h.tensors for h, _ in parts):
        raise InvalidModelFileError(f"{p.name} holds no tensors.")

    f = header.fields
    arch = f.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise InvalidModelFileError(f"{p.name} has no general.architecture in its metadata.")

    def a(key: str, default: Any = None) -> Any:
        return f.get(f"{arch}.{key}", default)

    n_embd = int(a("embedding_length", 0) or 0)
    n_head = a("attention.head_count", 0) or 0
    n_head_kv = a("attention.head_count_kv", n_head) or n_head
    # per-layer arrays (some archs vary heads by layer): take the max as the conservative figure
    if isinstance(n_head, list):
        n_head = max(n_head) if n_head else 0
    if isinstance(n_head_kv, list):
        n_head_kv = max(n_head_kv) if n_head_kv else 0
    n_head, n_head_kv = int(n_head), int(n_head_kv)
    default_hd = n_embd // n_head if n_head else 0
    head_k = int(a("attention.key_length", default_hd) or default_hd)
    head_v = int(a("attention.value_length", default_hd) or default_hd)
    vocab = a("vocab_size")
    if vocab is None:
        tokens = f.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens is not None else 0
    ftype = f.get("general.file_type")
    sw = a("attention.sliding_window")
    mtp_layers = int(a("nextn_predict_layers", 0) or 0) or len(nextn_layers)
    n_trunk = max(int(a("block_count", 0) or 0) - mtp_layers, 0)
    swa_layers, recurrent_layers, recurrent_bytes = _memory_layout(arch, a, n_trunk, int(n_embd), sw)
    return GGUFInfo(
        path=str(p),
        file_size=size,
        architecture=arch,
        name=f.get("general.name"),
        n_layers=int(a("block_count", 0) or 0),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim_k=head_k,
        head_dim_v=head_v,
        context_length=int(a("context_length", 0) or 0),
        vocab_size=int(vocab),
        file_type=FILE_TYPES.get(int(ftype), f"type {ftype}") if ftype is not None else "unknown",
        parameters=n_params,
        chat_template=f.get("tokenizer.chat_template"),
        license=f.get("general.license"),
        sliding_window=int(sw) if isinstance(sw, int | float) else None,
        tokenizer_model=f.get("tokenizer.ggml.model"),
        bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=f.get("tokenizer.ggml.eos_token_id"),
        pooling=_pooling(a("pooling_type")),
        extra={"tensor_bytes": {**split, "layers": [split["layers"][i] for i in sorted(split["layers"])],
                                "experts": [split["experts"].get(i, 0) for i in sorted(split["layers"])]}},
        mtp_layers=mtp_layers,
        swa_layers=swa_layers,
        recurrent_layers=recurrent_layers,
        recurrent_bytes=recurrent_bytes,
        n_experts=int(a("expert_count", 0) or 0),
        n_experts_used=int(a("expert_used_count", 0) or 0),
        n_ff_exp=int(a("expert_feed_forward_length", 0) or 0),
    )


# llama.cpp's expert tensors (common/common.h LLM_FFN_EXPS_REGEX: what --cpu-moe / --n-cpu-moe keep on the CPU)
EXPERTS_PATTERN = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
EXPERTS_RE = re.compile(EXPERTS_PATTERN)


def _tensor_class(name: str) -> str:
    """``blk.3.ffn_up_exps.weight`` -> ``ffn_up_exps``; ``token_embd.weight`` -> ``token_embd``."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit():
        parts = parts[2:]
    return parts[0] if len(parts) == 1 or parts[-1] not in ("weight", "bias", "scale") else ".".join(parts[:-1])


# sliding-window pattern of architectures that set one in code (llama.cpp's load_swa_pattern defaults): of each n
# layers the first n - 1 are windowed; a GGUF's ``attention.sliding_window_pattern`` (a number or a per-layer
# array) overrides it
SWA_PATTERN = {"gemma2": 2, "gemma3": 6, "gemma3n": 5, "gemma4": 6, "cohere2": 4, "gpt-oss": 2, "llama4": 4,
               "exaone4": 4, "olmo2": 4, "smallthinker": 4}


def _memory_layout(arch: str, a: Any, n_layers: int, n_embd: int, sw: Any) -> tuple[int, int, int]:
    """(windowed layers, recurrent layers, recurrent state bytes per sequence) of the ``n_layers`` trunk layers (the
    MTP layers after them are held by an MTP context only) from the metadata, as llama.cpp's hparams work them out
    (``set_swa_pattern``, ``n_embd_r``/``n_embd_s``); (0, 0, 0) for a plain transformer."""
    swa = 0
    if isinstance(sw, int | float) and sw > 0:
        pat = a("attention.sliding_window_pattern")
        if isinstance(pat, list):
            swa = sum(1 for x in pat[:n_layers] if x)
        else:
            n = int(pat) if isinstance(pat, int | float) else SWA_PATTERN.get(arch, 0)
            swa = sum(1 for il in range(n_layers) if n == 0 or il % n < n - 1) if n or arch in SWA_PATTERN else 0
    rec = 0
    if arch in RECURRENT_ARCHS:
        rec = n_layers
    elif arch in HYBRID_ARCHS:
        interval = a("full_attention_interval")
        layers = a("attention.recurrent_layers")
        heads_kv = a("attention.head_count_kv")
        if isinstance(layers, list):
            rec = sum(1 for x in layers[:n_layers] if x)
        elif isinstance(heads_kv, list):  # (Jamba, Falcon-H1, Granite 4, LFM2, Nemotron-H: 0 KV heads = recurrent)
            rec = sum(1 for x in heads_kv[:n_layers] if not x)
        else:
            n = int(interval) if isinstance(interval, int | float) and interval > 0 else 4
            rec = sum(1 for il in range(n_layers) if (il + 1) % n != 0)
    state = 0
    if rec:
        d_conv, d_state = int(a("ssm.conv_kernel", 0) or 0), int(a("ssm.state_size", 0) or 0)
        d_inner, groups = int(a("ssm.inner_size", 0) or 0), int(a("ssm.group_count", 0) or 0)
        l_cache = int(a("shortconv.l_cache", 0) or 0)
        if l_cache:  # LFM2's short convolutions
            r, s_ = n_embd * (l_cache - 1), 0
        else:
            r, s_ = max(d_conv - 1, 0) * (d_inner + 2 * groups * d_state), d_state * d_inner
        state = 4 * rec * (r + s_)
    return swa, rec, state
