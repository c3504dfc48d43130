"""localllm/audio.py: what a clip's header says (format, duration) before anything decodes it, and each refusal in
one sentence; the paths a prompt names."""

from __future__ import annotations

import struct

import pytest

from localllm.audio import (
    AudioError,
    ClipInfo,
    check_audio,
    clip_info,
    duration_label,
    extract_paths,
    transcription_prompt,
)
from tests.support_audio import encoded, forged_wav, wav


@pytest.mark.parametrize("fmt", ["WAV", "FLAC", "MP3"])
@pytest.mark.parametrize("seconds", [1.5, 45.0])
def test_the_declared_duration_of_each_format(fmt, seconds):
    data = wav(seconds) if fmt == "WAV" else encoded(fmt, seconds)
    info = clip_info(data)
    assert info is not None and info.format == fmt
    assert info.seconds == pytest.approx(seconds, abs=0.1 if fmt == "MP3" else 1e-3)  # MP3: by frames or bitrate
    assert check_audio(data, "x") is data


def wav_header(seconds: float, carried: int) -> bytes:
    rate, n = 16000, int(seconds * 16000) * 2
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", n) + b"\0" * carried
    return b"RIFF" + struct.pack("<I", min(n + 36, 0xFFFFFFFF)) + body


@pytest.mark.parametrize(("data", "fmt", "says"), [
    (b"", None, "the audio clip is empty"),
    (b"hello, not a clip at all", None, "not a WAV, MP3 or FLAC audio clip"),
    (b"\x89PNG\r\n\x1a\n" + b"\0" * 40, None, "not a WAV, MP3 or FLAC audio clip"),
    (b"OggS\0\x02" + b"\0" * 40, None, "Ogg (Vorbis/Opus) audio is not supported"),
    (b"\0\0\0\x20ftypM4A " + b"\0" * 40, None, "MP4/M4A (AAC) audio is not supported"),
    (wav(1.0)[:1000], None, "the WAV clip is truncated"),
    (wav(1.0)[:30], None, "the WAV clip is truncated"),
    (wav_header(3 * 3600, 64), None, "the clip lasts 10,800 s, more than the 600 s allowed"),
    (wav(1.0), "aac", "the audio format 'aac' is not supported"),
])
def test_refusals_are_one_sentence(data, fmt, says):
    with pytest.raises(AudioError) as e:
        check_audio(data, "clip", fmt)
    assert says in str(e.value) and str(e.value).startswith("clip: ")


def test_a_wav_lasts_its_frames_over_its_sample_rate_whatever_its_byte_rate():
    """The byte rate is a header field a decoder never uses: 6,000 frames at 8 Hz play (and resample to 16 kHz) for
    750 s however large a byte rate the header claims, so the clip is refused, not taken for 0.00001 s."""
    forged = forged_wav(8, 0xFFFFFFF0, 6000)
    assert clip_info(forged) == ClipInfo("WAV", 750.0)
    with pytest.raises(AudioError, match=r"^clip: the clip lasts 750 s, more than the 600 s allowed"):
        check_audio(forged, "clip")
    # an honest clip with a wrong byte rate is measured by its frames all the same
    assert clip_info(forged_wav(16000, 1, 24000)) == ClipInfo("WAV", 1.5)
    # no sample rate, or no frame size: the header is unreadable
    for rate, bits in ((0, 16), (16000, 0)):
        bad = bytearray(forged_wav(16000, 32000, 100))
        struct.pack_into("<I", bad, 24, rate)
        struct.pack_into("<HH", bad, 32, 0 if not bits else 2, bits)
        with pytest.raises(AudioError, match="truncated or its header is unreadable"):
            check_audio(bytes(bad), "clip")


def test_limits_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("LOCALLLM_MAX_AUDIO_SECONDS", "1")
    with pytest.raises(AudioError, match="lasts 2 s, more than the 1 s allowed"):
        check_audio(wav(2.0), "clip")
    monkeypatch.setenv("LOCALLLM_MAX_AUDIO_BYTES", "1000")
    with pytest.raises(AudioError, match="more than the 1,000 allowed"):
        check_audio(wav(0.5), "clip")


def test_paths_labels_and_the_prompt(tmp_path):
    (tmp_path / "memo.wav").write_bytes(wav())
    (tmp_path / "talk.MP3").write_bytes(encoded("MP3"))
    text, found = extract_paths(f"Compare {tmp_path}/memo.wav and {tmp_path}/talk.MP3 and ./gone.flac")
    assert [p.name for p in found] == ["memo.wav", "talk.MP3"] and text == "Compare and and ./gone.flac"
    assert duration_label(wav(1.5)) == "1.5 s" and duration_label(wav(125.0)) == "2:05"
    assert "language: de" in transcription_prompt("de", "Hallo") and "Hallo" in transcription_prompt(None, "Hallo")
