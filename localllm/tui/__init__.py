"""The terminal app (Textual): chat with streaming Markdown and persisted history, a model manager
and a hardware view. ``localllm chat`` opens it; :func:`localllm.tui.app.run` is the entry point.

Textual is imported only when the app starts (this package's ``__init__`` imports nothing heavy).
"""
