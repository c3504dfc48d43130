"""Images for the llama.cpp token source: a vision projector (mmproj GGUF) loaded with llama.cpp's ``mtmd``.

:class:`LoadedProjector` (the loaded encoder; the store's record of the file is ``localllm.store.Projector``) is
what :class:`~backends.llamacpp.source.LlamaCppSource` holds when its :class:`LoadSpec` names an ``mmproj``. It
turns a rendered prompt with one :data:`~backends.contract.media.IMAGE_MARKER` per image into token ids
(``mtmd_tokenize``: text chunks and image chunks), where each image chunk becomes as many **negative placeholder
ids** as it takes positions. Each placeholder is derived from the sha256 of the image's bytes and its index, so the
decode loop and the KV pool treat an image like any other prompt tokens: a second question about the same picture
shares the prefix (no evaluation, no encoding), parking and the prompt cache on disk key it by content, and the
context fit counts it.

Encoding is lazy (:meth:`LoadedProjector.encode`): the loop asks for the placeholders of the chunk it is about to
evaluate, and only images not yet encoded go through the vision tower; their embeddings are kept (LRU, by
content hash, ``MAX_CACHED_EMBD_BYTES``), so even an image whose KV cells were evicted is not encoded again.
:meth:`LoadedProjector.fill` writes a run of placeholders' embeddings into a ``llama_batch`` with ``embd`` set:
an embeddings-only decode, since tokens and embeddings cannot share one ``llama_decode`` (see
shared/reference/vision-mtmd.md).

A projector that needs **non-causal** attention over an image (Gemma 3) has each image evaluated whole, in one
embeddings-only decode with causal attention switched off for it (``llama_set_causal_attn``), and then on again
for the step's token decode: the loop gives such an image a step of its own (:attr:`media_whole`, :meth:`span`).

**M-RoPE** (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: :attr:`LoadedProjector.mrope`): an image of ``nx x ny`` tokens takes
``max(nx, ny)`` positions, not one per token. Each of its tokens is evaluated with four positions (time, row,
column, extra: ``(p, p + y, p + x, 0)`` for token ``y * nx + x`` of an image starting at position ``p``, the layout
of mtmd-helper's ``mtmd_helper_decode_image_chunk``), so every cell of an image holds the same sequence position
``p`` and the text after it continues at ``p + max(nx, ny)``. The KV pool still counts cells (one per token); the
position after a list of tokens is :meth:`LoadedProjector.positions`, and a prefix may only be kept whole-image
(:meth:`LoadedProjector.kv_cut`): cells are dropped by position, and an image's cells share one. So an M-RoPE image is
evaluated whole, in one feed (:attr:`media_whole`), and mtmd is told to make images of at most ``max_image_tokens``
tokens (the step's size less one token per slot, so an image always fits beside the streams in flight).

**Audio** (a projector with an audio encoder: Ultravox, Qwen2-Audio / Qwen2.5-Omni, Voxtral, Gemma 3n/4, ...) takes
the same path. A WAV, MP3 or FLAC clip among the media bytes (told apart by its magic bytes, as mtmd's helper does) is
decoded and resampled by mtmd, which cuts it into 30 s chunks (one ``AUDIO`` chunk each, its mel spectrogram
computed at tokenize time); each chunk gets placeholders from (the clip's sha256, the chunk's index), is encoded
lazily and kept like an image's embeddings, and with M-RoPE takes one position per token (``(p+k, p+k, p+k, 0)``,
mtmd-helper's ``set_position_mrope_1d``).

A clip's preprocessing is the costly part (mtmd computes the mel spectrogram of every 30 s chunk when it tokenizes:
~1 s a chunk on a busy 2-core machine, whatever the model), so it is done **off the decode loop**:
:meth:`LoadedProjector.prepare` runs on a helper thread before the request is queued (the loop keeps stepping the other
streams), and keeps each clip's marker replacement (the text mtmd puts around it and its placeholders) by content
hash; a prompt holding clips is then tokenized piece by piece as mtmd itself does (text parts without specials,
BOS/EOS as ``add_special`` says), each clip from that cache. A lock serialises every mtmd call on the context.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from backends.contract.errors import BackendError, ModelLoadError, PoolFullError, UnsupportedError
from backends.contract.media import IMAGE_MARKER, MediaWork, is_audio, is_image_token
from backends.contract.source import Feed

log = logging.getLogger("backends.llamacpp")

MAX_CACHED_EMBD_BYTES = 512 << 20  # image embeddings kept for reuse (a 576-token image of a 4096-wide model: 9 MB)
MAX_IMAGES = 4096  # images whose placeholder ids are remembered (those of prompts being evaluated, and more)
# preprocessed images (mtmd chunks) kept for a later encode: the most recent ones (a real model's is ~10 MB); an
# older one that is needed again is prepared again when its next prompt is tokenized
MAX_PENDING_CHUNKS = 64
MAX_IMAGE_ENDS = 1 << 20  # M-RoPE: images whose position count is remembered (~100 bytes each)


@dataclass
class _Image:
    key: str  # sha256 hex of the image bytes
    ids: list[int]  # the placeholder ids of its positions
    chunk: Any = None  # an owned copy of its mtmd image chunk, until encoded
    embd: Any = None  # (n, n_embd) float32 once encoded
    nx: int = 0
    ny: int = 0
    n_pos: int = 0  # positions it takes: len(ids), or max(nx, ny) with M-RoPE
    audio: bool = False  # an audio chunk (nx = its tokens, ny = 1)


def _placeholder_ids(key: str, n: int, salt: int = 0) -> list[int]:
    """``n`` negative int32 ids for an image (content hash ``key``): a 31-bit hash of (key, salt, index) each."""
    base = hashlib.sha256(f"{key}:{salt}".encode()).digest()
    out = []
    for i in range(n):
        h = hashlib.blake2b(i.to_bytes(4, "little"), key=base[:32], digest_size=4).digest()
        out.append(-1 - (int.from_bytes(h, "little") & 0x7FFFFFFE))
    return out


class LoadedProjector:
    """A loaded mtmd context for one text model (its threads, GPU use and logging as the model's)."""

    def __init__(self, path: str, model: Any, n_embd: int, *, n_threads: int, use_gpu: bool,
                 log_callback: Any = None, native_reason: Callable[..., str | None] = lambda *_: None,
                 max_image_tokens: int = 0):
        """``log_callback``: the llama.cpp log callback the source installed (mtmd's ~2,400 lines a load go where
        llama.cpp's go); ``native_reason``: the source's recent-log lookup, to explain a failed load;
        ``max_image_tokens``: for an M-RoPE text model, the most tokens an image may become (mtmd resizes larger
        ones down; 0: the projector's own limit), so that a whole image fits in one step."""
        import llama_cpp.mtmd_cpp as M

        self._M = M
        if log_callback is not None:
            M.mtmd_helper_log_set(log_callback, ctypes.c_void_p(0))
        p = M.mtmd_context_params_default()
        p.use_gpu = bool(use_gpu)
        p.n_threads = int(n_threads)  # mtmd's default is 4, whatever the model was given
        p.print_timings = False
        p.warmup = True
        if max_image_tokens > 0:
            import llama_cpp

            if llama_cpp.llama_model_rope_type(model) in (llama_cpp.LLAMA_ROPE_TYPE_MROPE,
                                                          llama_cpp.LLAMA_ROPE_TYPE_IMROPE):
                p.image_max_tokens = int(max_image_tokens)
        t = time.perf_counter()
        self._ctx = M.mtmd_init_from_file(path.encode(), model, p)
        if not self._ctx:
            self._ctx = None
            why = native_reason("mismatch", "error", "failed", "unknown", "missing")
            raise ModelLoadError(f"The vision projector {path} could not be loaded beside this model"
                                 f"{f' (llama.cpp: {why})' if why else ''}; it may be for another model.")
        self.load_ms = (time.perf_counter() - t) * 1e3
        try:
            self.vision = bool(M.mtmd_support_vision(self._ctx))
            self.audio = bool(M.mtmd_support_audio(self._ctx))
            if not self.vision and not self.audio:
                raise ModelLoadError(f"{path} has neither a vision nor an audio encoder.")
            self.non_causal = bool(M.mtmd_decode_use_non_causal(self._ctx, None))
            self.mrope = bool(M.mtmd_decode_use_mrope(self._ctx))
        except BaseException:
            self.close()
            raise
        self.path = path
        self.n_embd = n_embd
        self._model = model
        self._lock = threading.RLock()  # every mtmd call (the loop's encodes, a helper thread's preparation)
        self._clips: OrderedDict[str, list[int]] = OrderedDict()  # clip sha256 -> what replaces its marker
        self._images: OrderedDict[str, _Image] = OrderedDict()
        self._by_id: dict[int, tuple[_Image, int]] = {}
        # M-RoPE: the last placeholder of every image seen -> (its tokens, its positions). Kept after the image is
        # forgotten (a few bytes an image, bounded by MAX_IMAGE_ENDS), since an idle sequence may still hold it
        self._ends: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self._embd_bytes = 0
        self.encoded = 0  # images encoded since load
        self.encoded_tokens = 0
        self.encode_ns = 0
        self.audio_encoded = 0  # audio chunks encoded since load
        self.audio_encoded_tokens = 0
        self.audio_encode_ns = 0

    # ------------------------------------------------------------------ prompts

    def problem(self) -> str | None:
        """Why this projector cannot run in the batched loop (one sentence), or None."""
        return None

    def tokenize(self, text: str, images: list[bytes], add_bos: bool) -> list[int]:
        """Token ids of ``text`` (one marker per image or clip), media positions as placeholders."""
        with self._lock:
            if not any(is_audio(m) for m in images):
                return self._tokenize_all(text, images, add_bos)
            return self._tokenize_pieces(text, images, add_bos)

    def prepare(self, media: Sequence[bytes]) -> None:
        """Decode the clips among ``media`` and compute their mel spectrograms now (on the caller's thread), so that
        tokenizing a prompt that holds them later costs no mtmd work. The encoder pass stays lazy (:meth:`encode`,
        from the loop, only where the clip's KV cells are not reused). Errors are left for :meth:`tokenize`."""
        for data in media:
            if is_audio(data):
                with self._lock:
                    if self._ctx is None:
                        return
                    try:
                        self._clip_ids(data)
                    except UnsupportedError:
                        pass

    def _clip_ids(self, data: bytes) -> list[int]:
        """What replaces a clip's marker: the text mtmd puts around it and the placeholders of its chunks (cached by
        the clip's sha256 while every chunk still has its mtmd chunk or its embeddings)."""
        key = hashlib.sha256(data).hexdigest()
        ids = self._clips.get(key)
        if ids is not None:
            ok = True
            for t in ids:
                if t < 0:
                    hit = self._by_id.get(t)
                    if hit is None or (hit[0].chunk is None and hit[0].embd is None):
                        ok = False
                        break
            if ok:
                self._clips.move_to_end(key)
                for t in ids:
                    if t < 0:
                        self._images.move_to_end(self._by_id[t][0].key)
                return ids
        ids = self._tokenize_all(IMAGE_MARKER, [data], False)
        self._clips[key] = ids
        while len(self._clips) > MAX_IMAGES:
            self._clips.popitem(last=False)
        return ids

    def _text_ids(self, text: str) -> list[int]:
        import llama_cpp

        if not text:
            return []
        raw = text.encode("utf-8")
        vocab = llama_cpp.llama_model_get_vocab(self._model)
        n = len(raw) + 8
        arr = (llama_cpp.llama_token * n)()
        got = llama_cpp.llama_tokenize(vocab, raw, len(raw), arr, n, False, True)
        if got < 0:
            n = -got
            arr = (llama_cpp.llama_token * n)()
            got = llama_cpp.llama_tokenize(vocab, raw, len(raw), arr, n, False, True)
        return [int(arr[i]) for i in range(got)]

    def _tokenize_pieces(self, text: str, media: list[bytes], add_bos: bool) -> list[int]:
        """As ``mtmd_tokenize`` builds a prompt (text parts without specials, BOS first and EOS last when
        ``add_bos``), with each clip from :meth:`_clip_ids` and each image tokenized alone."""
        import llama_cpp

        why = self.problem()
        if why:
            raise UnsupportedError(why)
        parts = text.split(IMAGE_MARKER)
        if len(parts) - 1 != len(media):
            raise UnsupportedError(f"The prompt has {len(parts) - 1} media markers for {len(media)} images and "
                                   f"clips; do not write {IMAGE_MARKER} in the text.")
        out: list[int] = []
        for i, data in enumerate(media):
            sound = is_audio(data)
            if sound and not self.audio:
                raise UnsupportedError("This model's projector has no audio encoder, so it cannot take audio.")
            out += self._text_ids(parts[i])
            try:
                out += self._clip_ids(data) if sound else self._tokenize_all(IMAGE_MARKER, [data], False)
            except UnsupportedError as e:
                raise UnsupportedError(str(e).replace(" 1 could not", f" {i + 1} could not")) from None
        out += self._text_ids(parts[-1])
        vocab = llama_cpp.llama_model_get_vocab(self._model)
        if add_bos and llama_cpp.llama_vocab_get_add_bos(vocab):
            out.insert(0, int(llama_cpp.llama_vocab_bos(vocab)))
        if add_bos and llama_cpp.llama_vocab_get_add_eos(vocab):
            out.append(int(llama_cpp.llama_vocab_eos(vocab)))
        return out

    def _tokenize_all(self, text: str, images: list[bytes], add_bos: bool) -> list[int]:
        """One ``mtmd_tokenize`` of the whole prompt."""
        M = self._M
        why = self.problem()
        if why:
            raise UnsupportedError(why)
        n_markers = text.count(IMAGE_MARKER)
        if n_markers != len(images):
            raise UnsupportedError(f"The prompt has {n_markers} image markers for {len(images)} images; do not "
                                   f"write {IMAGE_MARKER} in the text.")
        bitmaps: list[Any] = []
        chunks = None
        try:
            for i, data in enumerate(images):
                sound = is_audio(data)
                if sound and not self.audio:
                    raise UnsupportedError("This model's projector has no audio encoder, so it cannot take audio.")
                if not sound and not self.vision:
                    raise UnsupportedError("This model's projector has no vision encoder, so it cannot take images.")
                buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
                bm = M.mtmd_helper_bitmap_init_from_buf(self._ctx, buf, len(data), False)
                if not bm:
                    raise UnsupportedError(
                        f"Audio clip {i + 1} could not be decoded: it is not a WAV, MP3 or FLAC file, or it is "
                        "truncated." if sound else f"Image {i + 1} could not be decoded: it is not a PNG, JPEG, "
                        "GIF, BMP or WebP image, or it is truncated.")
                M.mtmd_bitmap_set_id(bm, hashlib.sha256(data).hexdigest().encode())
                bitmaps.append(bm)
            raw = text.encode("utf-8")
            inp = M.mtmd_input_text()
            inp.text, inp.text_len, inp.add_special, inp.parse_special = raw, len(raw), add_bos, True
            chunks = M.mtmd_input_chunks_init()
            arr = (M.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            rc = M.mtmd_tokenize(self._ctx, chunks, ctypes.byref(inp), arr, len(bitmaps))
            if rc != 0:
                raise UnsupportedError("An image could not be prepared for this model's projector."
                                       if rc == 2 else "The prompt's images do not match its image markers.")
            out: list[int] = []
            part, last_audio = 0, b""  # the index of an audio chunk within its clip (mtmd cuts a clip per 30 s)
            for j in range(M.mtmd_input_chunks_size(chunks)):
                ch = M.mtmd_input_chunks_get(chunks, j)
                kind = M.mtmd_input_chunk_get_type(ch)
                if kind == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n = ctypes.c_size_t()
                    p = M.mtmd_input_chunk_get_tokens_text(ch, ctypes.byref(n))
                    out.extend(int(p[k]) for k in range(n.value))
                    last_audio = b""
                elif kind == M.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                    out.extend(self._register(ch))
                    last_audio = b""
                elif kind == M.MTMD_INPUT_CHUNK_TYPE_AUDIO:
                    cid = M.mtmd_input_chunk_get_id(ch) or b""
                    part = part + 1 if cid and cid == last_audio else 0
                    last_audio = cid
                    out.extend(self._register(ch, part=part))
                else:
                    raise UnsupportedError("This model's projector made a kind of input localllm does not run.")
            return out
        finally:
            if chunks is not None:
                M.mtmd_input_chunks_free(chunks)
            for bm in bitmaps:
                M.mtmd_bitmap_free(bm)

    def _register(self, ch: Any, part: int | None = None) -> list[int]:
        """The placeholders of an image chunk, or (``part`` given) of the ``part``-th audio chunk of a clip."""
        M = self._M
        sound = part is not None
        n_pos = int(M.mtmd_input_chunk_get_n_pos(ch))
        if sound:
            n = int(M.mtmd_input_chunk_get_n_tokens(ch))
            nx, ny = n, 1
            if n_pos != n:
                raise UnsupportedError("This audio model's positions differ from its tokens in a way localllm does "
                                       "not run yet.")
            if not self.non_causal and M.mtmd_decode_use_non_causal(self._ctx, ch):
                raise UnsupportedError("This audio projector needs non-causal attention, which localllm does not "
                                       "run yet.")
        else:
            img = M.mtmd_input_chunk_get_tokens_image(ch)
            n = int(M.mtmd_image_tokens_get_n_tokens(img))
            nx, ny = int(M.mtmd_image_tokens_get_nx(img)), int(M.mtmd_image_tokens_get_ny(img))
            if n_pos != n and not self.mrope:
                raise UnsupportedError("This vision model's image positions differ from its tokens in a way localllm "
                                       "does not run yet.")
        key = (M.mtmd_input_chunk_get_id(ch) or b"").decode() or hashlib.sha256(str(id(ch)).encode()).hexdigest()
        if sound:
            key += f"#audio{part}"
        e = self._images.get(key)
        if e is None or len(e.ids) != n:
            salt = 0
            ids = _placeholder_ids(key, n)
            while any(i in self._by_id for i in ids):  # another image's id (2^-31 a position): draw again
                salt += 1
                ids = _placeholder_ids(key, n, salt)
            e = _Image(key, ids, nx=nx, ny=ny, n_pos=n_pos, audio=sound)
            if self.mrope and e.nx * e.ny != n:
                raise UnsupportedError("This vision model's image grid does not match its tokens (M-RoPE).")
            self._images[key] = e
            for k, t in enumerate(ids):
                self._by_id[t] = (e, k)
            if self.mrope:
                self._ends[ids[-1]] = (n, n_pos)
                while len(self._ends) > MAX_IMAGE_ENDS:
                    self._ends.popitem(last=False)
        self._images.move_to_end(key)
        if e.embd is None and e.chunk is None:
            e.chunk = M.mtmd_input_chunk_copy(ch)
        self._trim_table()
        return list(e.ids)

    def _trim_table(self) -> None:
        while len(self._images) > MAX_IMAGES:
            _, old = self._images.popitem(last=False)
            self._forget(old)
        pending = [e for e in self._images.values() if e.chunk is not None]
        for e in pending[:max(0, len(pending) - MAX_PENDING_CHUNKS)]:
            self._M.mtmd_input_chunk_free(e.chunk)
            e.chunk = None

    def _forget(self, e: _Image) -> None:
        for t in e.ids:
            if self._by_id.get(t, (None, 0))[0] is e:
                del self._by_id[t]
        if e.chunk is not None:
            self._M.mtmd_input_chunk_free(e.chunk)
            e.chunk = None
        if e.embd is not None:
            self._embd_bytes -= e.embd.nbytes
            e.embd = None

    # ------------------------------------------------------------------ encoding

    def _images_in(self, tokens: Iterable[int]) -> list[_Image]:
        seen: dict[str, _Image] = {}
        for t in tokens:
            if is_image_token(t):
                hit = self._by_id.get(t)
                if hit is None:
                    raise BackendError("An image of this prompt is no longer known to the projector; send it again.")
                seen.setdefault(hit[0].key, hit[0])
        return list(seen.values())

    def encode(self, tokens: Sequence[int]) -> MediaWork:
        """Encode the images with placeholders in ``tokens`` that have no embeddings yet."""
        with self._lock:
            return self._encode(tokens)

    def _encode(self, tokens: Sequence[int]) -> MediaWork:
        M = self._M
        work = MediaWork()
        for e in self._images_in(tokens):
            self._images.move_to_end(e.key)
            if e.embd is not None:
                continue
            if e.chunk is None:
                raise BackendError("An image of this prompt is no longer known to the projector; send it again.")
            t = time.perf_counter_ns()
            rc = M.mtmd_encode_chunk(self._ctx, e.chunk)
            if rc != 0:
                raise BackendError(f"The projector failed to encode {'an audio clip' if e.audio else 'an image'} "
                                   f"(mtmd_encode_chunk returned {rc}).")
            n = len(e.ids)
            ptr = M.mtmd_get_output_embd(self._ctx)
            e.embd = np.ctypeslib.as_array(ptr, shape=(n, self.n_embd)).copy()  # the next encode overwrites it
            dt = time.perf_counter_ns() - t
            M.mtmd_input_chunk_free(e.chunk)
            e.chunk = None
            self._embd_bytes += e.embd.nbytes
            if e.audio:
                work.audio += 1
                work.audio_tokens += n
                work.audio_ns += dt
                self.audio_encoded += 1
                self.audio_encoded_tokens += n
                self.audio_encode_ns += dt
            else:
                work.images += 1
                work.tokens += n
                work.ns += dt
                self.encoded += 1
                self.encoded_tokens += n
                self.encode_ns += dt
            self._evict_embd(keep=e)
        return work

    def _evict_embd(self, keep: _Image) -> None:
        """Drop the least recently used embeddings over the budget (their ids stay known, so a prompt that still
        holds them in the KV pool needs nothing; one that must evaluate them again is told to resend)."""
        for e in list(self._images.values()):
            if self._embd_bytes <= MAX_CACHED_EMBD_BYTES:
                break
            if e is not keep and e.embd is not None:
                self._embd_bytes -= e.embd.nbytes
                e.embd = None

    def span(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` are positions of the first one's image, from that position on."""
        first = self._by_id.get(tokens[0]) if tokens else None
        if first is None:
            return 0
        e, k = first
        n = 0
        for t in tokens:
            hit = self._by_id.get(t)
            if hit is None or hit[0] is not e or hit[1] != k + n:
                break
            n += 1
        return n

    def rows(self, tokens: Sequence[int]) -> Any:
        """The embeddings of a run of placeholders, ``(len(tokens), n_embd)`` float32, contiguous."""
        out = np.empty((len(tokens), self.n_embd), dtype=np.float32)
        for j, t in enumerate(tokens):
            hit = self._by_id.get(t)
            if hit is None or hit[0].embd is None:
                self.encode([t])
                hit = self._by_id.get(t)
            assert hit is not None and hit[0].embd is not None
            out[j] = hit[0].embd[hit[1]]
        return out

    # ------------------------------------------------------------------ M-RoPE positions

    def positions(self, tokens: Sequence[int]) -> int:
        """The sequence position that follows ``tokens`` (a sequence's first tokens): one per text token, and
        ``max(nx, ny)`` per whole M-RoPE image; a trailing part of an image adds nothing (all its cells hold the
        image's first position, which is where the rest of it goes). Without M-RoPE: ``len(tokens)``."""
        n = len(tokens)
        if not self.mrope or not n or min(tokens) >= 0:  # min(): the common case at C speed
            return n
        imgs = [t for t in tokens if t < 0]
        pos = n - len(imgs)
        ends = self._ends
        for t in imgs:
            end = ends.get(t)
            if end is not None:
                pos += end[1]
        return pos

    def kv_cut(self, tokens: Sequence[int], n: int) -> tuple[int, int]:
        """To keep the first ``n`` of a sequence's ``tokens``: (tokens kept, position from which cells go). With
        M-RoPE a cut inside an image moves back to the image's start (its cells share one position)."""
        if not self.mrope:
            return n, n
        if n <= 0 or tokens[n - 1] >= 0 or tokens[n - 1] in self._ends:
            return n, self.positions(tokens[:n])  # after a text token or a whole image
        start = n
        while start > 0 and tokens[start - 1] < 0 and tokens[start - 1] not in self._ends:
            start -= 1
        return start, self.positions(tokens[:start])

    def mrope_positions(self, tokens: Sequence[int], pos: int) -> list[tuple[int, int, int, int]]:
        """The four M-RoPE positions of each of an image's placeholders ``tokens`` when the image starts at
        ``pos``: ``(pos, pos + y, pos + x, 0)`` for token ``y * nx + x`` (mtmd_image_tokens_get_decoder_pos)."""
        out = []
        for t in tokens:
            hit = self._by_id.get(t)
            if hit is None:
                raise BackendError("An image of this prompt is no longer known to the projector; send it again.")
            e, k = hit
            out.append((pos + k, pos + k, pos + k, 0) if e.audio else (pos, pos + k // e.nx, pos + k % e.nx, 0))
        return out

    def audio_count(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` are audio positions."""
        by_id = self._by_id
        n = 0
        for t in tokens:
            if t < 0:
                hit = by_id.get(t)
                if hit is not None and hit[0].audio:
                    n += 1
        return n

    def close(self) -> None:
        if getattr(self, "_ctx", None) is None:
            return
        with getattr(self, "_lock", threading.RLock()):
            for e in list(getattr(self, "_images", {}).values()):
                self._forget(e)
            self._M.mtmd_free(self._ctx)
            self._ctx = None


class LlamaMediaInput:
    """llama.cpp's implementation of the :class:`~backends.contract.source.MediaInput` capability, mixed into
    :class:`~backends.llamacpp.source.LlamaCppSource` (a load has it when a projector is loaded), with the source's
    answers to why media are refused (:meth:`~backends.contract.source.TokenSource.vision_problem`, ``audio_problem``:
    the projector's own reason where one is loaded) and the embeddings-only decode of image positions."""

    if TYPE_CHECKING:
        _proj: LoadedProjector | None
        _add_bos: bool
        _bos_text: str
        _ctx: Any
        _ebatch: Any
        _n_batch: int
        _n_embd: int
        _saved_rows: list[Any]

        def _row_view(self, ptr: Any) -> Any: ...

    @property
    def vision(self) -> bool:
        return self._proj is not None and self._proj.vision and self._proj.problem() is None

    def vision_problem(self) -> str:
        if self._proj is not None:
            return self._proj.problem() or ("This model cannot take images." if self._proj.vision else
                                            "This model's projector has no vision encoder, so it cannot take images.")
        return "This model has no vision projector, so it cannot take images."

    @property
    def audio(self) -> bool:
        return self._proj is not None and self._proj.audio and self._proj.problem() is None

    def audio_problem(self) -> str:
        if self._proj is not None:
            return self._proj.problem() or ("This model cannot take audio." if self._proj.audio else
                                            "This model's projector has no audio encoder, so it cannot take audio.")
        return "This model has no audio projector, so it cannot take audio."

    def prepare_media(self, media: Sequence[bytes]) -> None:
        if self._proj is not None and self._proj.audio:
            self._proj.prepare(media)

    def audio_token_count(self, tokens: Sequence[int]) -> int:
        return self._proj.audio_count(tokens) if self._proj is not None and self._proj.audio else 0

    def prompt_media(self, text: str, images: list[bytes]) -> list[int]:
        if self._proj is None:
            raise UnsupportedError(self.vision_problem())
        add_bos = self._add_bos and not (self._bos_text and text.startswith(self._bos_text))
        return list(self._proj.tokenize(text, images, add_bos))

    def encode_images(self, tokens: Sequence[int]) -> MediaWork:
        if self._proj is None or not any(is_image_token(t) for t in tokens):
            return MediaWork()
        return self._proj.encode(tokens)

    @property
    def media_whole(self) -> bool:
        return self._proj is not None and (self._proj.non_causal or self._proj.mrope)

    def positions(self, tokens: Sequence[int]) -> int:
        return self._proj.positions(tokens) if self._proj is not None else len(tokens)

    def kv_cut(self, tokens: Sequence[int], n: int) -> tuple[int, int]:
        return self._proj.kv_cut(tokens, n) if self._proj is not None else (n, n)

    def media_span(self, tokens: Sequence[int]) -> int:
        return self._proj.span(tokens) if self._proj is not None else 0

    def media_counters(self) -> MediaWork:
        p = self._proj
        if p is None:
            return MediaWork()
        return MediaWork(p.encoded, p.encoded_tokens, p.encode_ns, p.audio_encoded, p.audio_encoded_tokens,
                         p.audio_encode_ns)

    def _evaluate_images(self, feeds: Sequence[Feed]) -> list[list[int]]:
        """One embeddings-only decode for the image feeds; rows of their outputs are saved (negative handles),
        since the token decode of the same step replaces the context's logits."""
        import llama_cpp

        assert self._proj is not None
        if self._ebatch is None:
            self._ebatch = llama_cpp.llama_batch_init(self._n_batch, self._n_embd, 1)
        b = self._ebatch
        n, outs = 0, []
        mrope: list[tuple[int, int, int, int]] | None = [] if self._proj.mrope else None
        for f in feeds:
            k = len(f.tokens)
            if n + k > self._n_batch:
                raise BackendError(f"A step of {n + k} image positions exceeds the batch size {self._n_batch}.")
            rows = self._proj.rows(f.tokens)
            ctypes.memmove(ctypes.addressof(b.embd.contents) + n * self._n_embd * 4, rows.ctypes.data, rows.nbytes)
            if mrope is not None:
                mrope.extend(self._proj.mrope_positions(f.tokens, f.pos))
            mine = []
            for j in range(k):
                i = n + j
                b.pos[i], b.n_seq_id[i], b.seq_id[i][0] = f.pos + j, 1, f.seq
                b.logits[i] = j >= k - f.outputs
                if b.logits[i]:
                    mine.append(i)
            n += k
            outs.append(mine)
        b.n_tokens = n
        non_causal = self._proj.non_causal  # Gemma 3: the image's positions see each other (whole images only)
        pos_type = type(b.pos)
        pos_own = int(ctypes.cast(b.pos, ctypes.c_void_p).value or 0)  # an address (a field read shares the struct)
        if mrope is not None:  # four positions an embedding, section-major: pos[s * n + i] (llama_batch's layout)
            sections = (ctypes.c_int32 * (4 * n))(*(p[s] for s in range(4) for p in mrope))
            b.pos = ctypes.cast(sections, pos_type)
        if non_causal:
            llama_cpp.llama_set_causal_attn(self._ctx, False)
        try:
            rc = llama_cpp.llama_decode(self._ctx, b)
        finally:
            if mrope is not None:
                b.pos = ctypes.cast(pos_own, pos_type)  # llama_batch_free frees the batch's own array
            if non_causal:
                llama_cpp.llama_set_causal_attn(self._ctx, True)
        if rc == 1:
            raise PoolFullError("No room in the KV cache for this step.")
        if rc != 0:
            raise BackendError(f"llama.cpp failed to evaluate the image (llama_decode returned {rc}).")
        handles = []
        for mine in outs:
            hs = []
            for i in mine:
                ptr = llama_cpp.llama_get_logits_ith(self._ctx, i)
                self._saved_rows.append(self._row_view(ptr).copy())
                hs.append(-len(self._saved_rows))
            handles.append(hs)
        return handles
