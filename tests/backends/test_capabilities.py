"""What a load can do beyond the core token-source contract, in one typed record (:class:`Capabilities`): the
capability Protocols a source's class implements, or what a load says it has (the llama.cpp source)."""

from __future__ import annotations

from typing import Any

from backends.contract.source import Capabilities, Checkpoints, SequenceStates
from backends.contract.specs import LoadSpec
from backends.core.kvpool import KVPool
from tests.fakes import FakeSource


class WithStates(FakeSource):
    key: str | None = "fake-1"

    def state_key(self) -> str | None:
        return self.key

    def state_save(self, seq: int) -> bytes:
        return bytes(self._seqs.get(seq, []))

    def state_load(self, seq: int, data: bytes) -> bool:
        self._seqs[seq] = list(data)
        return True


class WithCheckpoints(FakeSource):
    def can_cut(self, seq: int, n: int) -> bool:
        return False

    def checkpoint_save(self, seq: int) -> bytes:
        return b""

    def checkpoint_restore(self, src: int, dst: int, n: int, data: bytes) -> bool:
        return False


def test_a_source_has_the_capabilities_its_class_implements():
    assert FakeSource(LoadSpec("x.gguf")).capabilities == Capabilities()  # the core only
    s = WithStates(LoadSpec("x.gguf"))
    assert s.capabilities.states is s and isinstance(s, SequenceStates)
    assert s.capabilities.media is None and s.capabilities.checkpoints is None and s.capabilities.pooling is None
    s.key = None  # the class can save states, this load cannot (MLX with a rotating cache)
    assert s.capabilities.states is None
    c = WithCheckpoints(LoadSpec("x.gguf"))
    assert c.capabilities.checkpoints is c and isinstance(c, Checkpoints)


def test_the_kv_pool_takes_checkpoints_only_where_the_capability_is():
    assert KVPool(FakeSource(LoadSpec("x.gguf"))).checkpointing is None
    assert KVPool(WithCheckpoints(LoadSpec("x.gguf"))).checkpointing is not None


def test_a_llamacpp_load_names_what_it_has(backend_factory: Any):
    m = backend_factory("llamacpp")  # a text model with plain attention: no projector, no checkpoints
    caps = m.call(lambda s: s.capabilities)
    assert caps.media is None and caps.checkpoints is None
    assert caps.states is not None and caps.pooling is not None
    assert m.slot_states() == []  # nothing running


def test_tokenizing_images_on_a_load_without_media_is_one_sentence():
    import pytest

    from backends.contract.errors import UnsupportedError
    from backends.registry import load

    with load(FakeSource, LoadSpec("x.gguf")) as m:
        assert m.tokenize("ab") == m.tokenize("ab", images=[])
        with pytest.raises(UnsupportedError, match="^This model has no vision projector, so it cannot take images.$"):
            m.tokenize("<__media__>", images=[b"\x89PNG"])


def test_the_token_source_docstring_names_every_member_and_media_refusals_live_on_the_source_only():
    """``TokenSource``'s docstring said "a handful of questions" over 28 members: it names each now (so a new one
    makes this fail until it is described), and why media are refused is asked of the source alone (it sat on
    both ``TokenSource`` and ``MediaInput``)."""
    import re

    from backends.contract.source import MediaInput, TokenSource

    members = {n for n in dir(TokenSource) if not n.startswith("_")} | {"spec"}
    named = set(re.findall(r":(?:attr|meth):`(\w+)`", TokenSource.__doc__ or ""))
    assert members - named == set()
    assert len(TokenSource.__abstractmethods__) == 14  # "fourteen abstract members", as the docstring says
    assert {"vision_problem", "audio_problem"} & set(vars(MediaInput)) == set()
