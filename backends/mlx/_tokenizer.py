"""An MLX model's tokenizer files rebuilt from a GGUF's ``tokenizer.ggml.*`` fields with the ``tokenizers``
library (no transformers): byte-level BPE (``gpt2``: Llama 3, Qwen, SmolLM, Phi-4) with llama.cpp's
pre-tokenizer regexes (its ``llama-vocab.cpp``), and SentencePiece (``llama``: Gemma, Llama 2, Mistral, Phi-3)
with merges ranked by the vocabulary's scores and byte fallback. Part of :mod:`backends.mlx.convert`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from backends.contract.errors import UnsupportedError

if TYPE_CHECKING:
    from backends.mlx._gguf import GGUFFile

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# llama.cpp's tokenizer.ggml.pre → (regexes applied in turn, ignore_merges) as in its llama-vocab.cpp
_PRE: dict[str, tuple[tuple[str, ...], bool]] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"), ((_LLAMA3,), True)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), ((_QWEN2,), False)),
    **dict.fromkeys(("gpt-4o", "llama4"), ((_GPT4O,), True)),
    "tekken": ((_TEKKEN,), True),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
                    ((r"\p{N}", _GPT2), False)),
    **dict.fromkeys(("gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "roberta-bpe", "trillion"), ((_GPT2,), False)),
    "default": ((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+"), False),
}
SUPPORTED_PRE = tuple(sorted(_PRE))
TOKENIZER_MODELS = ("gpt2", "llama")  # byte-level BPE, SentencePiece BPE

# Control tokens that end a turn besides the declared EOS (llama.cpp's "end of generation" set, FIM excluded).
_EOG_TEXTS = {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "</s>"}


def check_tokenizer(g: GGUFFile) -> str:
    model = g.get("tokenizer.ggml.model")
    if model not in TOKENIZER_MODELS:
        raise UnsupportedError(
            f"The MLX converter rebuilds BPE ('gpt2') and SentencePiece ('llama') vocabularies, and this GGUF's "
            f"tokenizer is {model!r}."
        )
    if model == "gpt2":
        pre = str(g.get("tokenizer.ggml.pre") or "default")
        if pre not in _PRE:
            raise UnsupportedError(
                f"The GGUF's pre-tokenizer {pre!r} is not supported by the MLX converter "
                f"(supported: {', '.join(SUPPORTED_PRE)})."
            )
        if not g.has("tokenizer.ggml.merges"):
            raise UnsupportedError("This BPE GGUF has no merges (tokenizer.ggml.merges), so MLX cannot tokenize it.")
    elif "tokenizer.ggml.scores" not in g.fields:
        raise UnsupportedError("This SentencePiece GGUF has no token scores, so MLX cannot tokenize it.")
    return str(model)


def eos_ids(g: GGUFFile, tokens: list[str], types: list[int]) -> list[int]:
    ids: list[int] = []
    for key in ("eos", "eot", "eom"):
        v = g.get(f"tokenizer.ggml.{key}_token_id")
        if v is not None and int(v) not in ids:
            ids.append(int(v))
    for i, (tok, typ) in enumerate(zip(tokens, types, strict=False)):
        if typ == 3 and tok in _EOG_TEXTS and i not in ids:
            ids.append(i)
    return ids


def token_types(g: GGUFFile, n: int) -> list[int]:
    t = g.get("tokenizer.ggml.token_type")
    return [int(x) for x in t] if t is not None else [1] * n


def _bpe_tokenizer(g: GGUFFile, tokens: list[str], types: list[int]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = str(g.get("tokenizer.ggml.pre") or "default")
    regexes, ignore_merges = _PRE[pre]
    merges = [tuple(m.split(" ", 1)) for m in g.get("tokenizer.ggml.merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                              ignore_merges=ignore_merges))
    if pre == "smollm":  # measured identical to llama.cpp on 56k tokens (reference/mlx-from-gguf.md)
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    elif regexes == (_GPT2,):
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    return tk


def _spm_merges(tokens: list[str], types: list[int], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE as merges: every split of a normal piece into two pieces of the vocabulary, ranked by
    the merged piece's score (highest first), as llama.cpp's SPM tokenizer merges the best-scoring bigram."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[float, int, int, str, str]] = []
    for piece, typ, score in zip(tokens, types, scores, strict=False):
        if typ != 1 or len(piece) < 2:
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is not None and ri is not None:
                found.append((-score, li, ri, left, right))
    found.sort()
    return [(left, right) for _, _, _, left, right in found]


def _spm_tokenizer(g: GGUFFile, tokens: list[str], types: list[int]) -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = [float(s) for s in g.get("tokenizer.ggml.scores")]
    unk_id = g.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    vocab = {t: i for i, t in enumerate(tokens)}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=_spm_merges(tokens, types, scores), unk_token=unk,
                              fuse_unk=True, byte_fallback=True))
    add_prefix = bool(g.get("tokenizer.ggml.add_space_prefix", True))
    steps: list[normalizers.Normalizer] = [normalizers.Replace(" ", "▁")]
    if add_prefix:
        steps.insert(0, normalizers.Prepend("▁"))
    tk.normalizer = normalizers.Sequence(steps)
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tk.decoder = decoders.Sequence(dec)
    return tk


def write_tokenizer(g: GGUFFile, out: Path, cfg: dict[str, Any]) -> list[int]:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json (and chat_template.jinja);
    return the end-of-generation ids. No transformers import."""
    from tokenizers import AddedToken, processors

    tokens: list[str] = [str(t) for t in g.get("tokenizer.ggml.tokens")]
    types = token_types(g, len(tokens))
    model = g.get("tokenizer.ggml.model")
    tk = _bpe_tokenizer(g, tokens, types) if model == "gpt2" else _spm_tokenizer(g, tokens, types)
    special = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types, strict=False)
               if ty in (2, 3)]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types, strict=False) if ty == 4]
    tk.add_special_tokens(special)
    if user:
        tk.add_tokens(user)

    def tok(key: str) -> str | None:
        v = g.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(v)] if v is not None and 0 <= int(v) < len(tokens) else None

    bos, eos, unk, pad = tok("bos"), tok("eos"), tok("unknown"), tok("padding")
    add_bos = bool(g.get("tokenizer.ggml.add_bos_token", model == "llama"))
    if add_bos and bos is not None:
        tk.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))])
    elif model == "gpt2":
        tk.post_processor = processors.ByteLevel(trim_offsets=False)
    tk.save(str(out / "tokenizer.json"))
    template = g.get("tokenizer.chat_template")
    tcfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg["max_position_embeddings"],
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": pad,
    }
    if template:
        tcfg["chat_template"] = template
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2, ensure_ascii=False), encoding="utf-8")
    named = (("bos_token", bos), ("eos_token", eos), ("unk_token", unk), ("pad_token", pad))
    (out / "special_tokens_map.json").write_text(json.dumps({k: v for k, v in named if v}, indent=2),
                                                 encoding="utf-8")
    return eos_ids(g, tokens, types)
