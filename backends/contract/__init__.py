"""The backend contract: what the layers above send a backend and get back.

:mod:`~backends.contract.specs` (what to load, what to generate), :mod:`~backends.contract.events` (what a
generation yields), :mod:`~backends.contract.errors` (what it raises), :mod:`~backends.contract.media` (image and
audio inputs), :mod:`~backends.contract.metrics` (a loaded model's counters) and :mod:`~backends.contract.source`
(the :class:`~backends.contract.source.TokenSource` an engine implements, with its capabilities)."""
