"""localllm: run quantized LLMs locally — pull, run, serve (Ollama + OpenAI APIs), chat in a TUI.

Exception tree (catch at the level you need)::

    LocalLLMError                 anything a user can cause; str(e) is one clear sentence
    ├── InvalidNameError          a model name that is empty, malformed or tries to leave the models dir
    ├── ModelNotFoundError        no such alias / not installed (carries close-match suggestions)
    ├── PullError                 a download failed (network, hash mismatch, full disk)
    │   └── SourceUnavailable     one source could not be reached; the next one is tried
    ├── InvalidModelFileError     a GGUF whose header / tensors do not fit the file
    └── PlanError                 the model cannot be loaded on this machine (numbers in the message)

Backend errors (``backends.contract.errors.BackendError`` and subclasses) are re-raised by the engine as is;
their messages are written for users too.
"""

__version__ = "0.1.0"

from localllm.errors import (  # noqa: E402,F401
    InvalidModelFileError,
    InvalidNameError,
    LocalLLMError,
    ModelNotFoundError,
    PlanError,
    PullError,
    SourceUnavailable,
)
