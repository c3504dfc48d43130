"""The serving core, the same for every engine: one decode loop per loaded model (:mod:`~backends.core.loop`,
:mod:`~backends.core.scheduler`), the KV pool (:mod:`~backends.core.kvpool`), the per-request stream (stops, thinking,
tool calls: :mod:`~backends.core.stream`), speculative decoding (:mod:`~backends.core.drafting`), the prompt cache on
disk (:mod:`~backends.core.prompt_cache`) and pooled outputs (:mod:`~backends.core.pooling`)."""
