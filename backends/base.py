"""The backend contract's names in one place, for a transition: they live in modules by concern now.

* :mod:`backends.errors` — :class:`BackendError` and its tree;
* :mod:`backends.specs` — :class:`LoadSpec` (with :class:`Tuning`, :class:`LoraAdapter`), :class:`DraftSpec`,
  :class:`Sampling`, :class:`GenerateRequest`;
* :mod:`backends.events` — :class:`Stats`, :class:`TextChunk`, :class:`ToolCalls`, :class:`Done`;
* :mod:`backends.media` — :data:`IMAGE_MARKER`, :func:`is_image_token`, :func:`is_audio`, :class:`MediaWork`;
* :mod:`backends.source` — :class:`TokenSource` (the core), its capabilities and :class:`ModelInfo`;
* :mod:`backends.stream` — the context policy (:func:`fit_messages`, :func:`answer_reserve`, ...) beside the
  per-request stream that applies it.

Import from those; this module only re-exports them.
"""

from __future__ import annotations

from backends.descriptor import KV_CACHE_TYPES, KVCacheType
from backends.errors import (
    BackendError,
    ContextOverflowError,
    InputTooLargeError,
    ModelLoadError,
    PoolFullError,
    RequestCancelled,
    UnsupportedError,
)
from backends.events import Done, Event, FinishReason, Stats, TextChunk, TokenLogprob, ToolCalls
from backends.media import AUDIO_MAGIC, IMAGE_MARKER, MediaWork, audio_format, is_audio, is_image_token
from backends.source import (
    FALLBACK_CHAT_TEMPLATE,
    Capabilities,
    Checkpoints,
    Feed,
    MediaInput,
    ModelInfo,
    Pooling,
    Sampler,
    SequenceStates,
    TokenSource,
)
from backends.specs import (
    DraftSpec,
    GenerateRequest,
    LoadSpec,
    LoraAdapter,
    Sampling,
    ThinkValue,
    ToolCallFormat,
    Tuning,
)
from backends.stream import (
    answer_reserve,
    check_fits,
    check_logit_bias,
    fit_messages,
    message_images,
    message_text,
    text_messages,
)

__all__ = [
    "AUDIO_MAGIC", "FALLBACK_CHAT_TEMPLATE", "IMAGE_MARKER", "KV_CACHE_TYPES", "BackendError", "Capabilities",
    "Checkpoints", "ContextOverflowError", "Done", "DraftSpec", "Event", "Feed", "FinishReason", "GenerateRequest",
    "InputTooLargeError", "RequestCancelled",
    "KVCacheType", "LoadSpec", "LoraAdapter", "MediaInput", "MediaWork", "ModelInfo", "ModelLoadError",
    "Pooling", "PoolFullError", "Sampler", "Sampling", "SequenceStates", "Stats", "TextChunk", "ThinkValue",
    "TokenLogprob", "TokenSource", "ToolCallFormat", "ToolCalls", "Tuning", "UnsupportedError", "answer_reserve",
    "audio_format",
    "check_fits", "check_logit_bias", "fit_messages", "is_audio", "is_image_token", "message_images",
    "message_text", "text_messages",
]
