"""``POST /v1/audio/transcriptions``: OpenAI's speech-to-text endpoint, answered by prompting an audio model.

A multipart form, as OpenAI's SDK sends it (``client.audio.transcriptions.create(model=..., file=...)``):

* ``file`` (required): a WAV, MP3 or FLAC clip (checked as every clip is: :mod:`localllm.audio`);
* ``model`` (required): an installed model with an audio projector;
* ``prompt``: text the transcript follows on from (a previous segment, the spelling of names);
* ``language``: ISO-639-1 code of the speech (``en``, ``fr``, ...), said to the model;
* ``response_format``: ``json`` (default, ``{"text", "usage"}``), ``text`` (the transcript as text/plain) or
  ``verbose_json`` (``task``, ``language``, ``duration``, ``text``, one segment over the whole clip with its
  ``temperature`` and Whisper's ``compression_ratio`` of its text); ``srt`` and ``vtt`` are refused (no timestamps:
  an LLM's transcript has none). Whisper's ``avg_logprob``, ``no_speech_prob`` and ``tokens`` are left out of the
  segment: nothing here measures them, and a constant would read as "certain speech";
* ``temperature``: 0 by default (greedy, as a transcript wants).

The model is asked, in one user turn holding the clip, to write what is said and nothing else. Errors leave in
OpenAI's shape (the ``/v1`` translator's).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from localllm import audio as core
from localllm.api import GenerateRequest
from localllm.server import generation as g
from localllm.server.audio import sent_audio
from localllm.server.errors import bad_request
from localllm.server.openai_routes import error_body
from localllm.server.options import api_options
from localllm.server.translator import Translator

router = APIRouter(prefix="/v1/audio")
API = Translator("openai-audio", router, error_body, prefix="/v1/audio")

FORMATS = ("json", "text", "verbose_json")
MAX_TRANSCRIPT_TOKENS = 1024  # a transcript is bounded by its clip's words; a random model would run on


def _field(form: Any, name: str) -> str | None:
    v = form.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise bad_request(f"{name} must be a text field", param=name)
    return v.strip() or None


@router.post("/transcriptions")
async def transcriptions(request: Request) -> Response:
    ctype = request.headers.get("content-type", "")
    if not ctype.startswith("multipart/form-data"):
        raise bad_request("the request must be multipart/form-data with a file and a model", param="file")
    try:
        form = await request.form()
    except Exception as e:  # noqa: BLE001 - a malformed body is the client's
        raise bad_request(f"the multipart body could not be read ({type(e).__name__})", param="file") from None
    upload = form.get("file")
    if upload is None or isinstance(upload, str):
        raise bad_request("file is required: the audio clip to transcribe (WAV, MP3 or FLAC)", param="file")
    model = _field(form, "model")
    if not model:
        raise bad_request("model is required", param="model")
    fmt = _field(form, "response_format") or "json"
    if fmt not in FORMATS:
        raise bad_request(f"response_format {fmt[:20]!r} is not supported; use json, text or verbose_json",
                          param="response_format")
    temperature = 0.0
    if (t := _field(form, "temperature")) is not None:
        try:
            temperature = float(t)
        except ValueError:
            raise bad_request("temperature must be a number", param="temperature") from None
        if not 0.0 <= temperature <= 2.0:
            raise bad_request("temperature must be between 0 and 2", param="temperature")
    language, prompt = _field(form, "language"), _field(form, "prompt")
    limit = core.max_bytes()
    data = await upload.read(limit + 1)
    if len(data) > limit:
        raise bad_request(f"file: the audio clip is more than the {limit:,} bytes allowed "
                          "(LOCALLLM_MAX_AUDIO_BYTES)", param="file")
    name = (upload.filename or "").rsplit(".", 1)
    declared = name[1].lower() if len(name) == 2 and name[1].lower() in core.AUDIO_FORMATS else None
    clip = sent_audio(bytes(data), "file", declared)
    sampling, options = api_options(None, {"temperature": 0.0}, max_tokens=MAX_TRANSCRIPT_TOKENS,
                                    temperature=temperature)
    messages = [{"role": "user", "content": core.transcription_prompt(language, prompt), "images": [clip]}]
    call = g.Call(model, GenerateRequest(messages=messages, sampling=sampling, think=False), options, images=True,
                  relax_thinking=True)
    run = await g.begin(request, call)
    result = await run.collect()
    text = result.content.strip()
    if fmt == "text":
        return PlainTextResponse(text + "\n")
    if fmt == "verbose_json":
        info = core.clip_info(clip)
        return JSONResponse(_verbose(text, language, info.seconds if info is not None else 0.0, temperature))
    st = result.done.stats
    return JSONResponse({"text": text, "usage": {
        "type": "tokens", "input_tokens": int(st.prompt_eval_count), "output_tokens": int(st.eval_count),
        "total_tokens": int(st.prompt_eval_count + st.eval_count),
        "input_token_details": {"audio_tokens": int(st.audio_tokens),
                                "text_tokens": int(st.prompt_eval_count - st.audio_tokens)}}})


def _verbose(text: str, language: str | None, seconds: float, temperature: float) -> dict[str, Any]:
    """verbose_json: one segment over the whole clip, with only what is known of it (see the module's docstring)."""
    import zlib

    raw = text.encode()
    ratio = round(len(raw) / len(zlib.compress(raw)), 3) if raw else 0.0  # Whisper's: bytes / zlib-compressed bytes
    return {"task": "transcribe", "language": language or "", "duration": round(seconds, 3), "text": text,
            "segments": [{"id": 0, "seek": 0, "start": 0.0, "end": round(seconds, 3), "text": text,
                          "temperature": temperature, "compression_ratio": ratio}]}
