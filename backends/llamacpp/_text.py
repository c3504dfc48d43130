"""The llama.cpp source's text: tokens from text and back (a token's bytes and whether it ends generation, cached),
and the chat template rendered (llama-cpp-python's Jinja2 formatter), mixed into
:class:`~backends.llamacpp.source.LlamaCppSource`."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

from backends.contract.errors import BackendError, UnsupportedError
from backends.contract.source import FALLBACK_CHAT_TEMPLATE

# Special (control) tokens a chat format needs in the generated text to be parsed: written out by piece() where
# the vocabulary has them as one token, hidden like every other control token otherwise (llama.cpp's server keeps
# the same lists as "preserved tokens": common/parsers/gpt-oss.cpp, gemma4.cpp, qwen3-coder.cpp, lfm2.cpp,
# ministral3.cpp).
PRESERVED_MARKERS = (
    "<|channel|>", "<|constrain|>", "<|message|>", "<|start|>", "<|end|>",  # gpt-oss harmony
    "<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>',  # Gemma 4
    "<think>", "</think>", "<tool_call>", "</tool_call>",  # Qwen3 / Qwen3.5, DeepSeek-R1
    "<|tool_call_start|>", "<|tool_call_end|>",  # LFM2
    "[THINK]", "[/THINK]", "[TOOL_CALLS]", "[ARGS]",  # Ministral 3
)


class LlamaText:
    """llama.cpp's tokenizer and chat template behind :meth:`~backends.contract.source.TokenSource.tokenize`,
    ``prompt_tokens``, ``detokenize``, ``piece``, ``is_eog`` and ``render`` (the source reads the vocabulary and its
    facts at load: :meth:`LlamaCppSource._read_tokens`)."""

    if TYPE_CHECKING:
        _vocab: Any
        _template: str | None
        _bos: int
        _bos_text: str
        _eos_text: str
        _add_bos: bool
        _piece_cache: dict[int, bytes]
        _eog_cache: dict[int, bool]
        _preserved: set[int] | None
        _formatters: dict[bool, Any]

    def _tokenize(self, text: str, add_bos: bool, special: bool) -> list[int]:
        import llama_cpp

        data = text.encode("utf-8")
        cap = len(data) + 8
        for _ in range(2):
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, cap, add_bos, special)
            if n >= 0:
                return list(buf[:n])
            cap = -n
        raise BackendError("llama.cpp could not tokenize the text.")

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        return self._tokenize(text, False, special)

    def prompt_tokens(self, text: str) -> list[int]:
        add_bos = self._add_bos and not (self._bos_text and text.startswith(self._bos_text))
        toks = self._tokenize(text, add_bos, True)
        if not toks and self._bos >= 0:
            toks = [self._bos]
        return toks

    def detokenize(self, tokens: list[int]) -> str:
        """Text of ``tokens``; special tokens are written out (``<|im_start|>``), so prompts read back whole."""
        import llama_cpp

        arr = (llama_cpp.llama_token * len(tokens))(*tokens)
        size = max(64, 8 * len(tokens))
        for _ in range(2):  # llama_detokenize returns -needed when the buffer is too small
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_detokenize(self._vocab, arr, len(tokens), buf, size, False, True)
            if n >= 0:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = -n
        return ""

    def piece(self, token: int) -> bytes:
        """The bytes of one token (cached). llama-cpp-python's own helper pads them to 32 bytes with NULs."""
        p = self._piece_cache.get(token)
        if p is None:
            import llama_cpp

            if self._preserved is None:
                self._preserved = self._marker_tokens()
            special = token in self._preserved  # a chat format's control token: its text, not nothing
            size = 32
            while True:
                buf = ctypes.create_string_buffer(size)
                n = llama_cpp.llama_token_to_piece(self._vocab, token, buf, size, 0, special)
                if n >= 0:
                    p = buf.raw[:n]
                    break
                size = -n
            self._piece_cache[token] = p
        return p

    def _marker_tokens(self) -> set[int]:
        """The ids of :data:`PRESERVED_MARKERS` that are single tokens of this vocabulary."""
        out: set[int] = set()
        for marker in PRESERVED_MARKERS:
            toks = self._tokenize(marker, False, True)
            if len(toks) == 1:
                out.add(toks[0])
        return out

    def is_eog(self, token: int) -> bool:
        v = self._eog_cache.get(token)
        if v is None:
            import llama_cpp

            v = self._eog_cache[token] = bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))
        return v

    def _formatter(self, add_generation_prompt: bool) -> Any:
        f = self._formatters.get(add_generation_prompt)
        if f is None:
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            f = Jinja2ChatFormatter(template=self._template or FALLBACK_CHAT_TEMPLATE, eos_token=self._eos_text,
                                    bos_token=self._bos_text, add_generation_prompt=add_generation_prompt)
            self._formatters[add_generation_prompt] = f
        return f

    def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, template_kwargs: dict[str, Any] | None = None) -> str:
        try:
            return str(self._formatter(add_generation_prompt)(messages=messages, tools=tools,
                                                               **(template_kwargs or {})).prompt)
        except UnsupportedError:
            raise
        except Exception as e:  # jinja errors, raise_exception() from the template
            raise UnsupportedError(f"The chat template of this model rejected the messages: {e}.") from None

    def _token_text(self, tok: int) -> str:
        import llama_cpp

        t = llama_cpp.llama_vocab_get_text(self._vocab, tok)
        return t.decode("utf-8", errors="replace") if t else ""
