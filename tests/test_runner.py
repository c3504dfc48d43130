"""One engine interface the faces see (issue 45): :class:`localllm.api.Runner` (and :class:`~localllm.api.Models`,
:class:`~localllm.api.Advisor`), implemented in-process (:mod:`localllm.local`) and remotely
(:class:`localllm.client.Client`). Each implementation has every member of its protocol, with the same parameters
(names, kinds, defaults), and the engine takes every parameter of the runner's calls, so that none of them drifts
from the protocol (mypy checks the types: ``_implements`` in both modules)."""

from __future__ import annotations

import inspect

import pytest

from localllm.api import Advisor, Models, Runner
from localllm.client import Client
from localllm.engine import Engine
from localllm.local import LocalAdvisor, LocalModels, LocalRunner


def members(protocol: type) -> list[str]:
    return sorted(n for n in vars(protocol) if not n.startswith("_"))


def parameters(fn: object) -> list[tuple[str, object, object]]:
    """(name, kind, default) of each parameter but ``self``."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()  # type: ignore[arg-type]
            if p.name != "self"]


@pytest.mark.parametrize(("protocol", "impl"), [
    (Runner, LocalRunner), (Runner, Client), (Models, LocalModels), (Models, Client), (Advisor, LocalAdvisor),
], ids=lambda c: c.__name__)
def test_each_implementation_has_every_member_of_its_protocol_with_its_parameters(protocol, impl):
    assert members(protocol), protocol
    for name in members(protocol):
        assert hasattr(impl, name), f"{impl.__name__} has no {name} of {protocol.__name__}"
        want = vars(protocol)[name]
        if isinstance(want, property):
            continue  # label, remote: a class attribute or a property
        assert parameters(getattr(impl, name)) == parameters(want), f"{impl.__name__}.{name}"
        assert inspect.iscoroutinefunction(getattr(impl, name)) == inspect.iscoroutinefunction(want), name


def test_the_engine_takes_every_parameter_of_the_runners_calls():
    """LocalRunner forwards each call to the engine's method of the same name: the engine takes what the runner
    does (and may take more: ``installed=``, ``cancel=`` for the server)."""
    for name in members(Runner):
        if isinstance(vars(Runner)[name], property):
            continue
        engine = {p[0]: p for p in parameters(getattr(Engine, name))}
        for p in parameters(vars(Runner)[name]):
            assert engine.get(p[0]) == p, f"Engine.{name} takes {p[0]!r} as Runner.{name} does"
