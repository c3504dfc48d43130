"""``localllm transcribe MODEL FILE``: print what is said in an audio file, using a model with an audio projector.

    $ localllm transcribe ultravox:1b ./memo.wav
    $ localllm transcribe ultravox:1b interview.mp3 --language fr --prompt "Names: Zoë, Anaïs."
    $ localllm transcribe ultravox:1b memo.flac --host http://127.0.0.1:11434

The model is asked, in one user turn holding the clip, to write only the words spoken (as
``POST /v1/audio/transcriptions`` asks it); the transcript goes to stdout, greedy by default. WAV, MP3 and FLAC
are taken, up to ``LOCALLLM_MAX_AUDIO_SECONDS`` (600 s) and ``LOCALLLM_MAX_AUDIO_BYTES`` (20 MiB).
"""

from __future__ import annotations

import sys

import click


@click.command("transcribe", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model")
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--language", default=None, metavar="CODE", help="The language spoken (ISO-639-1: en, fr, ...).")
@click.option("--prompt", default=None, help="Text the transcript follows on from (context, spelling of names).")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="Sampling temperature.")
@click.option("--num-predict", type=int, default=1024, show_default=True, help="Most tokens to write.")
@click.option("--verbose", is_flag=True, help="Print timings and token counts (audio tokens too) to stderr.")
@click.option("--host", default=None, metavar="URL",
              help="Talk to a localllm or Ollama server there instead of in-process.")
def command(model: str, file: str, language: str | None, prompt: str | None, temperature: float, num_predict: int,
            verbose: bool, host: str | None) -> None:
    """Transcribe FILE (WAV, MP3 or FLAC) with MODEL, a model with an audio projector.

    \b
    Examples:
      localllm transcribe ultravox:1b ./memo.wav
      localllm transcribe ultravox:1b talk.mp3 --language en --verbose
    """
    from localllm.audio import read_audio, transcription_prompt
    from localllm.cli.answer import build_settings, ensure_model, print_stats, stream_answer
    from localllm.session import open_session

    clip = read_audio(file)  # one sentence before any load for a file that cannot be read or is refused
    settings = build_settings(temperature=temperature, num_predict=num_predict, verbose=verbose)
    session = open_session(host, keep_alive=settings.keep_alive)
    try:
        name = ensure_model(session.models, model).name
        message = {"role": "user", "content": transcription_prompt(language, prompt), "images": [clip]}
        request = settings.request([message])
        request.think = False
        answer = stream_answer(session.runner, name, request, settings.load, out=sys.stdout, show_thinking=False,
                               keep_alive=settings.keep_alive)
        if answer.text and not answer.text.endswith("\n"):
            sys.stdout.write("\n")
        sys.stdout.flush()
        if verbose and answer.done is not None:
            print_stats(answer.done.stats, sys.stderr)
        if answer.cancelled:
            sys.exit(130)
    finally:
        session.close()
