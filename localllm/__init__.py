"""localllm: run quantized LLMs locally — pull, run, serve (Ollama + OpenAI APIs), chat in a TUI.

Exception tree (catch at the level you need; ``tests/test_architecture.py`` checks it against the classes)::

    LocalLLMError                 anything a user can cause; str(e) is one clear sentence
    ├── InvalidNameError          a model name that is empty, malformed or tries to leave the models dir
    ├── ModelNotFoundError        no such alias / not installed (carries close-match suggestions)
    ├── PullError                 a download failed (network, hash mismatch, full disk)
    │   ├── SourceUnavailable     one source could not be reached; the next one is tried
    │   ├── CorruptDownload       a file failed its size or sha256 check, and was removed (localllm.download)
    │   ├── DiskFull              not enough free space, or the disk filled up while writing (localllm.download)
    │   └── PullCancelled         cancelled; the partial download stays for the next pull (localllm.download)
    ├── InvalidModelFileError     a GGUF whose header / tensors do not fit the file
    ├── PlanError                 the model cannot be loaded on this machine (numbers in the message)
    ├── ServerBusyError           more requests wait than LOCALLLM_MAX_QUEUE allows: HTTP 503 (localllm.residency)
    ├── ConversionError           the GGUF cannot become an MLX model (localllm.mlxmodels)
    ├── ModelfileError            a Modelfile that cannot be used; the message names the line (localllm.modelfile)
    ├── ImageError                an image that is refused (localllm.images)
    ├── AudioError                an audio clip that is refused (localllm.audio)
    ├── ToolSchemaError           a tool list that cannot become a forced call (localllm.toolschema)
    ├── UploadTooLarge            an upload over LOCALLLM_MAX_UPLOAD; what it wrote was removed (localllm.store)
    └── RPCError                  a worker list that cannot be used as given (localllm.devices)

    BackendError                  a backend's (backends.contract.errors), re-raised by the engine as is; its
    │                             messages are written for users too
    ├── ModelLoadError            the weights could not be loaded
    ├── UnsupportedError          the model or the build cannot do what was asked (KV type, images, ...)
    ├── ContextOverflowError      the prompt does not fit even after dropping the oldest turns
    ├── InputTooLargeError        embedding / rerank inputs over what one request may take
    ├── RequestCancelled          the work was cancelled by its caller before it was done
    └── PoolFullError             no free KV cells for a step's batch (the decode loop's, never a user's)

The faces take the backend's from :mod:`localllm.api`.
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
