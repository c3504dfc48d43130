"""The llama.cpp engine (llama-cpp-python's low-level API): :class:`~backends.llamacpp.source.LlamaCppSource` and
what only llama.cpp has — its log, its samplers, its sequence states, vision through mtmd, MTP drafting, ggml's
device registry and RPC, tensor placement and the quantizer. Imported lazily: ``llama_cpp`` is heavy."""
