"""Drafts for speculative decoding: what proposes tokens, behind one interface, and how a load sets it up.

A :class:`Drafter` proposes up to ``k`` tokens that may follow a sequence's history; the decode loop
(:mod:`backends.core.loop`) verifies them in the target's batch, and the
:class:`~backends.core._speculative.SpecController` decides how many to ask for (0: decode plainly). Three drafters:
:class:`NgramDrafter` (prompt lookup), :class:`ModelDrafter` (a second, smaller model with the same vocabulary) and
:class:`~backends.llamacpp.mtp.MtpDrafter` (the target's own multi-token-prediction layers, which read the target's
hidden states: :meth:`Drafter.observe`). :func:`setup_draft` makes the drafter and the controller a
:class:`~backends.contract.specs.DraftSpec` asks for, refusing what cannot work in one sentence; a :class:`Speculation`
holds them for a load and decides, each step, which controller judges it and which slots draft.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from backends.contract.errors import BackendError, UnsupportedError
from backends.contract.source import Feed, TokenSource
from backends.contract.specs import DraftSpec, LoadSpec, Sampling
from backends.core._speculative import SpecController
from backends.core.kvseq import common_prefix

if TYPE_CHECKING:
    from backends.core.slot import Slot


class Drafter(Protocol):
    """Proposes tokens for the target to verify. Runs on the decode loop's thread."""

    name: str
    catchup_ns: int  # what the last :meth:`propose` spent catching up on tokens it had not seen (0: none)
    multi_seq: bool  # drafts for several sequences of one step (:meth:`propose_many`); else one sequence only

    def propose(self, history: list[int], k: int, max_catchup: int | None = None, seq: int = 0) -> list[int]:
        """Up to ``k`` tokens that may follow ``history`` (the target sequence ``seq``'s tokens and its last sampled
        one); ``max_catchup``: evaluate at most that many unseen tokens first (None: all)."""
        ...

    def propose_many(self, asks: Sequence[tuple[int, list[int], int]],
                     max_catchup: int | None = None) -> list[list[int]]:
        """:meth:`propose` for several ``(seq, history, k)`` of one step."""
        ...

    def observe(self, feeds: Sequence[Feed], held: Sequence[list[int]]) -> None:
        """After every evaluation of the target: its ``feeds`` (one batch, in order) and each feed's sequence's
        tokens now (a drafter that reads the target's hidden states takes them here)."""
        ...

    def watch(self, on: bool) -> None:
        """Whether :meth:`observe` will be called from the next evaluation on; while it is not (drafting paused,
        no probe near), a drafter that reads hidden states stops the target from producing them. What it missed
        meanwhile is a gap it drafts across."""
        ...

    def close(self) -> None: ...


class _Stateless:
    """The parts of :class:`Drafter` a drafter that ignores the target's evaluations shares."""

    catchup_ns = 0
    multi_seq = False

    def propose(self, history: list[int], k: int, max_catchup: int | None = None, seq: int = 0) -> list[int]:
        raise NotImplementedError

    def propose_many(self, asks: Sequence[tuple[int, list[int], int]],
                     max_catchup: int | None = None) -> list[list[int]]:
        return [self.propose(h, k, max_catchup, seq) for seq, h, k in asks]

    def observe(self, feeds: Sequence[Feed], held: Sequence[list[int]]) -> None:
        pass

    def watch(self, on: bool) -> None:
        pass


class NgramDrafter(_Stateless):
    """Prompt lookup: the tokens that followed the last occurrence of the current n-gram."""

    name = "ngram"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.catchup_ns = 0

    def propose(self, history: list[int], k: int, max_catchup: int | None = None, seq: int = 0) -> list[int]:
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(history) <= n:
                continue
            tail = history[-n:]
            for i in range(len(history) - n - 1, -1, -1):
                if history[i : i + n] == tail:
                    return history[i + n : i + n + k]
        return []

    def close(self) -> None:
        pass


class ModelDrafter(_Stateless):
    """A second, smaller model proposes tokens greedily; its one sequence follows the target's history
    (the common prefix is kept, only new tokens are evaluated).

    ``max_catchup`` bounds that catch-up: with more unseen tokens pending (the prompt, or a stretch decoded
    plainly while drafting was off), only the last ``max_catchup`` are evaluated and the older ones skipped.
    The draft's context then has a hole, which costs it some foresight but keeps a probe cheap; the holes
    are remembered (where, in the draft's own positions, and how many target tokens were skipped), so later
    calls map the target's sequence onto the draft's cache; a history that differs before a hole drops it.
    ``catchup_ns`` tells the controller what the last call spent catching up."""

    def __init__(self, source: TokenSource, p_min: float = 0.0):
        self.source = source
        self.name = source.spec.model_path
        self.tokens: list[int] = []  # what the draft's sequence holds (the target's history minus the holes)
        self.p_min = p_min
        self.catchup_ns = self.catchup_tokens = 0
        self._holes: list[tuple[int, int]] = []
        self._greedy = source.sampler(Sampling(temperature=0, repeat_penalty=1.0), None)
        try:  # the first evaluation of a context allocates its buffers: at load, not in the first probe
            source.evaluate([Feed(0, source.prompt_tokens("")[:1] or [0], 0, 1)])
            source.seq_rm(0)
        except Exception:  # noqa: BLE001 - a warm-up only
            pass

    def _eval(self, toks: list[int], outputs: int) -> list[int]:
        rows: list[int] = []
        step = self.source.n_batch
        for i in range(0, len(toks), step):
            chunk = toks[i : i + step]
            last = i + step >= len(toks)
            rows = self.source.evaluate([Feed(0, chunk, len(self.tokens), outputs if last else 0)])[0]
            self.tokens.extend(chunk)
        return rows

    def _view(self, history: list[int]) -> list[int]:
        for at, skipped in self._holes:
            if len(history) <= at:
                break
            history = history[:at] + history[at + skipped :]
        return history

    def propose(self, history: list[int], k: int, max_catchup: int | None = None, seq: int = 0) -> list[int]:
        self.catchup_ns = self.catchup_tokens = 0
        view = self._view(history)
        k = min(k, self.source.n_ctx - len(view) - 1)
        if k <= 0 or not view:
            return []
        keep = common_prefix(self.tokens, view)
        if any(at >= keep for at, _ in self._holes):  # the history changed before a hole: forget it
            self._holes = [h for h in self._holes if h[0] < keep]
            view = self._view(history)
        if keep >= len(view):
            keep = len(view) - 1  # evaluate the last token again for fresh logits
        if not self.source.seq_rm(0, keep):
            self.source.seq_rm(0)
            keep, self._holes, view = 0, [], list(history)
        del self.tokens[keep:]
        new = view[keep:]
        if max_catchup is not None and len(new) > max(int(max_catchup), 2):
            skip = len(new) - int(max_catchup)
            self._holes.append((len(self.tokens), skip))
            new = new[skip:]
        t0 = time.perf_counter_ns()
        rows = self._eval(new, 1)
        if len(new) > 2:  # more than a normal step's one or two tokens: catching up
            self.catchup_ns, self.catchup_tokens = time.perf_counter_ns() - t0, len(new)
        out: list[int] = []
        while True:
            if self.p_min > 0 and not self._confident(rows[-1]):
                break
            tok = self._greedy.sample(rows[-1])
            out.append(tok)
            if len(out) >= k:
                break
            rows = self._eval([tok], 1)
        return out

    def _confident(self, row: int) -> bool:
        import numpy as np

        x = np.asarray(self.source.logits(row), dtype=np.float64)
        return bool(1.0 / np.exp(x - x.max()).sum() >= self.p_min)

    def close(self) -> None:
        self._greedy.close()
        self.source.close()


def vocab_problem(target: TokenSource, draft: TokenSource) -> str | None:
    """Why ``draft`` cannot draft for ``target`` (one sentence), or None when every token id means the same
    bytes to both (sizes may differ by padding: up to 128 ids)."""
    nt, nd = target.info.n_vocab, draft.info.n_vocab
    if abs(nt - nd) > 128:
        return (f"The draft model's vocabulary ({nd} tokens) differs from the model's ({nt}); "
                "a draft must share the tokenizer.")
    for i in range(min(nt, nd)):
        if target.piece(i) != draft.piece(i):
            return (f"The draft model tokenizes differently from the model (token {i} differs); "
                    "a draft must share the tokenizer.")
    return None


def open_with_draft(source_class: type[TokenSource],
                    spec: LoadSpec) -> tuple[TokenSource, LoadSpec, Speculation | None]:
    """``source_class(spec)`` with the draft ``spec.draft`` asks for: (the source, the spec it was made from, the
    speculation; None: plain decoding). A default draft (``auto``) that cannot run leaves plain decoding and its
    reason in ``info.draft_off`` (an MTP load that fails is made again without its MTP layers); a draft asked for
    raises in one sentence, the source closed."""
    try:
        src = source_class(spec)
    except BackendError as e:
        if spec.draft is None or spec.draft.kind != "mtp":
            raise
        if not spec.draft.auto:  # a GGUF that names MTP layers without carrying them, or a build without them
            raise UnsupportedError(f"The model could not be loaded with its MTP layers ({e}); use --draft none.") \
                from None
        spec = replace(spec, draft=None)
        src = source_class(spec)
        src.info.draft_off = f"its MTP layers could not be loaded: {e}"
    if spec.draft is None:
        return src, spec, None
    try:
        return src, spec, Speculation(*setup_draft(src, spec.draft, source_class, spec))
    except Exception as e:  # noqa: BLE001 - whatever stops a default draft leaves plain decoding
        mtp = spec.draft.kind == "mtp"
        if spec.draft.auto:  # a default draft that cannot run: plain decoding, and why (the spec: what runs)
            src.info.draft_off = str(e) if isinstance(e, BackendError) else \
                f"the {'MTP drafter' if mtp else 'draft'} could not start: {e}"
            return src, replace(spec, draft=None), None
        src.close()
        if mtp and not isinstance(e, BackendError):  # an MTP drafter asked for: one sentence, not a traceback
            raise UnsupportedError(f"The MTP drafter could not start ({e}); use --draft none.") from None
        raise
    except BaseException:
        src.close()
        raise


def setup_draft(src: TokenSource, d: DraftSpec, source_class: type[TokenSource],
                spec: LoadSpec) -> tuple[Drafter, SpecController]:
    """The drafter and controller that ``d`` asks for beside the loaded target ``src`` (a draft model is
    loaded with ``source_class``, like the target from ``spec``); records the draft in ``src.info``."""
    if not src.can_rewind():
        raise UnsupportedError(
            f"Speculative decoding is not available for this {src.info.architecture} model: its cache "
            "(recurrent/hybrid memory or a sliding window) is not trimmable, so rejected draft tokens cannot be "
            "rolled back; use --draft none.")
    drafter: Drafter
    if d.kind == "mtp":
        from backends.llamacpp.mtp import mtp_drafter

        drafter = mtp_drafter(src)
        src.info.draft = "mtp"
    elif d.kind == "ngram":
        drafter = NgramDrafter()
        src.info.draft = "ngram"
    elif d.kind == "model":
        if not d.path:
            raise UnsupportedError("A draft model needs a path to its file.")
        # a draft on the CPU beside a target on the CPU: the target's flash-attention setting (off where planned so:
        # the draft decodes as deep in the conversation, one token at a time)
        fa = spec.flash_attn if d.n_gpu_layers == 0 and spec.n_gpu_layers == 0 else None
        dspec = LoadSpec(model_path=d.path, n_ctx=src.n_ctx, slots=1, n_gpu_layers=d.n_gpu_layers,
                         n_threads=spec.n_threads, n_batch=spec.n_batch, verbose=spec.verbose,
                         use_mmap=spec.use_mmap, devices=list(d.devices), flash_attn=fa)
        try:
            dsrc = source_class(dspec)
        except BackendError as e:
            raise type(e)(f"The draft model could not be loaded: {e}") from None
        problem = vocab_problem(src, dsrc)
        if problem is None and not dsrc.can_rewind():
            problem = ("The draft model's cache (recurrent/hybrid or sliding window) cannot roll back "
                       "rejected tokens.")
        if problem:
            dsrc.close()
            raise UnsupportedError(problem)
        drafter = ModelDrafter(dsrc, p_min=spec.tuning.draft_p_min)
        src.info.draft = d.path
        src.info.size_bytes += dsrc.info.size_bytes
        alloc = src.info.allocations  # the load's allocations count the draft model's too (as MTP's context's)
        for dev, kinds in dsrc.info.allocations.items():
            for kind, n in kinds.items():
                alloc.setdefault(dev, {})[kind] = alloc.get(dev, {}).get(kind, 0) + n
    else:
        raise UnsupportedError(f"Unknown draft kind {d.kind!r}; use a model, ngram or mtp.")
    # draft_always: draft every step whatever the timings say (tests of exactness)
    controller = SpecController(max(1, d.num_draft), margin=0.0 if spec.tuning.draft_always else 0.97)
    return drafter, controller


__all__ = ["Drafter", "ModelDrafter", "NgramDrafter", "setup_draft", "vocab_problem"]


@dataclass
class Speculation:
    """A load's drafter and its adaptive controller, plus one controller per stream count for steps where several
    sequences draft at once (what a drafted token costs and gains depends on the batch around it)."""

    drafter: Drafter
    controller: SpecController
    wide: dict[int, SpecController] = field(default_factory=dict)  # by how many sequences draft in the step
    lead: int = 32  # tokens before a probe from which the drafter observes the target again (its catch-up)
    watching: bool = True  # the drafter observes the target's evaluations (see :meth:`watch`)
    # resting: (the paused controller, decoding, active, tokens left): steps skip the policy and the controller's
    # timing until that many tokens have passed with the same streams (:meth:`step`, :meth:`record`)
    _rest: tuple[SpecController, int, int, float] | None = None

    def policy(self, decoding: list[Slot], active: int) -> tuple[SpecController | None, list[Slot]]:
        """The controller that judges this step (None: none does) and the slots that may draft in it, of
        ``decoding`` (the slots decoding now) among ``active`` running requests.

        One sequence decoding alone: the load's controller. Several, all decoding (no prompt in flight) with a
        drafter that serves several sequences (MTP): the controller for that many streams. Drafting is off for a
        request with a format (grammar), with tools (a call's lazy grammar may start at any token) or media (image
        placeholders in its history: nothing can propose or evaluate those as tokens)."""
        if not decoding:
            return None, []
        ok = [r for r in decoding if not r.stream.request.format and not r.stream.request.tools
              and not r.stream.stats.image_tokens
              and not r.stream.stats.audio_tokens]
        if active == 1 and len(decoding) == 1:
            return self.controller, ok
        if not self.drafter.multi_seq or len(ok) != len(decoding) or len(decoding) != active:
            return None, []
        wide = self.wide.get(len(ok))
        if wide is None:
            wide = self.wide[len(ok)] = self.controller.sibling()
        return wide, ok

    def propose(self, ctl: SpecController | None, slots: list[Slot], n_ctx: int) -> dict[int, list[int]]:
        """Drafts for ``slots`` (by ``id`` of the slot), as many as ``ctl`` asks for this step and each slot's
        room (its ``max_tokens``, the context of ``n_ctx`` tokens) allows."""
        assert ctl is not None
        n = ctl.n_draft()
        if n <= 0:
            return {}
        asks: list[tuple[int, list[int], int]] = []
        owners: list[Slot] = []
        for r in slots:
            assert r.seq is not None and r.last is not None
            room = min(r.stream.max_new - len(r.stream.generated) - 1, n_ctx - len(r.seq.tokens) - 2)
            if min(n, room) > 0:
                asks.append((r.seq.id, [*r.seq.tokens, r.last], min(n, room)))
                owners.append(r)
        if not asks:
            return {}
        got = self.drafter.propose_many(asks, max_catchup=ctl.max_catchup())
        return {id(r): [int(t) for t in g[:k]] for r, (_, _, k), g in zip(owners, asks, got, strict=True)}

    def step(self, decoding: list[Slot], active: int, n_ctx: int) -> tuple[SpecController | None, dict[int, list[int]]]:
        """Before a step: the controller that judges it (:meth:`policy`) and the drafts to verify (:meth:`propose`,
        by ``id`` of the slot); the drafter watches or not (:meth:`watch`). While that controller rests (paused, no
        probe within :attr:`lead` tokens) and the streams are the same, only the tokens are counted."""
        rest = self._rest
        if rest is not None and rest[1] == len(decoding) and rest[2] == active:
            return rest[0], {}
        self._rest = None
        ctl, slots = self.policy(decoding, active)
        proposed = self.propose(ctl, slots, n_ctx) if slots else {}
        self.watch(ctl)
        if ctl is not None and not ctl.drafting and decoding:
            idle = ctl.idle_tokens() - self.lead
            if idle >= 1:
                self._rest = (ctl, len(decoding), active, idle)
        return ctl, proposed

    def record(self, ctl: SpecController, *, proposed: int, accepted: int, emitted: int, ns: int, overhead_ns: int,
               streams: int, rejected: int) -> None:
        """After a decode step judged by ``ctl``: :meth:`SpecController.record`, or only the tokens while resting."""
        rest = self._rest
        if rest is not None and rest[0] is ctl and not proposed:
            ctl.rest(emitted / streams, ns)
            left = rest[3] - emitted / streams
            self._rest = (ctl, rest[1], rest[2], left) if left >= 1 else None
            return
        ctl.record(proposed=proposed, accepted=accepted, emitted=emitted, ns=ns, overhead_ns=overhead_ns,
                   streams=streams, rejected=rejected)

    def watch(self, ctl: SpecController | None) -> None:
        """Before a step's evaluation, judged by ``ctl`` (None: no controller judges it, e.g. a prompt in flight;
        the load's controller stands for it): the drafter observes the evaluations while that controller drafts
        or is within :attr:`lead` tokens of a probe, and not otherwise, so that a paused drafter costs nothing
        (an MTP drafter's hidden rows are not even produced)."""
        want = (ctl or self.controller).idle_tokens() <= self.lead
        if want != self.watching:
            self.drafter.watch(want)
            self.watching = want

    def observe(self, feeds: Sequence[Feed], held: Sequence[list[int]]) -> None:
        """After the evaluation of ``feeds``: :meth:`Drafter.observe` while watching."""
        if self.watching:
            self.drafter.observe(feeds, held)
