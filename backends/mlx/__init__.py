"""The MLX engine (Apple Silicon): :class:`~backends.mlx.source.MLXSource` over mlx-lm, its samplers, sequence
states, JSON constraint and tokenizer, and the GGUF-to-MLX converter (:mod:`~backends.mlx.convert`)."""
