"""The verdicts of one verify pass: for every window, the drafts the target accepts and its next token.

Work that does not need a request's own generator runs once per pass: one argmax over every row for
the greedy requests (p a point mass: acceptance is an exact prefix match), one `target_probs` per
sampling setting over its sampled requests' rows. Each sampled request keeps its own `accept` call:
their random streams must not interleave. With the kernels (`kernels`, the runtime's sampler) a
sampled request's window never builds p in torch: a plain step's token is drawn in C, one call per
sampling setting (`Kernels.sample_rows`, ~20 us a row against ~90 for target_probs and sample), and a
chain's verdict is `accept`'s rule in C (`Kernels.accept_drafts`, ~130 us for 6 drafts against ~340),
each with the uniforms its own generator would have given the torch path. Trees keep the torch path.
(`accept`, `accept_greedy_ids` and `target_probs` are looked up in this module, so a test can swap in
a wrong rule, with the runtime's sampler unset, and see the batch path catch it.)

Shape legend: n rows of the pass (its windows back to back), w a window, k' drafts, V vocabulary.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Container
from dataclasses import dataclass

import torch

from service.engine.kernels.library import Kernels
from service.engine.sequence import Sequence
from service.engine.spec.drafting import Proposal
from service.engine.spec.sampling import accept, accept_greedy_ids, target_probs
from service.engine.spec.tree_acceptance import Children, accept_tree_greedy, accept_tree_sampled

# (drafts accepted, accepted flags [k'], the target's next token); a tree's flags mark its accepted
# path's nodes (tree_acceptance.py), a chain's its accepted prefix.
Verdict = tuple[int, tuple[bool, ...], int]


@dataclass(frozen=True)
class PassVerdicts:
    verdicts: list[Verdict]  # one per window
    # The sampled windows' acceptance: its seconds and rows (what one more sampled row costs beyond
    # the pass; the adaptive controllers price it).
    sampling_seconds: float
    sampled_rows: int


def accept_pass(seqs: list[Sequence], proposals: list[Proposal], logits: torch.Tensor,
                lengths: list[int], argmax: torch.Tensor | None = None, kernels: Kernels | None = None
                ) -> PassVerdicts:
    """logits [n, V] of the windows `lengths` (each [last committed token, drafts...]) -> verdicts.
    argmax [n]: each row's first maximum where the pass computed it already (else computed here).
    kernels: where given, sampled requests' plain steps and chains are decided in C (`plain_sampled_tokens`,
    `chain_verdict`)."""
    if not any(s.request.sampling.greedy for s in seqs):
        greedy_ids = []
    elif argmax is not None:
        greedy_ids = argmax.tolist()
    else:  # [n]: every row at once; numpy's argmax (first maximum, like torch's) is ~10x cheaper on 16 x 4096
        greedy_ids = logits.numpy().argmax(-1).tolist()
    started = time.perf_counter()
    drawn = {} if kernels is None else plain_sampled_tokens(kernels, seqs, proposals, logits, lengths)
    chains = set() if kernels is None else {i for i, (seq, proposal) in enumerate(zip(seqs, proposals, strict=True))
                                            if not seq.request.sampling.greedy and proposal.drafts
                                            and proposal.tree is None}
    probs = sampled_probs(seqs, logits, lengths, skip=drawn.keys() | chains)
    sampling_seconds = time.perf_counter() - started  # (the greedy verdicts below are not sampling's)
    verdicts, offset, sampled_rows = [], 0, len(drawn)
    for i, (seq, proposal, w, p) in enumerate(zip(seqs, proposals, lengths, probs, strict=True)):
        drafts, q = proposal.drafts, proposal.q
        if i in drawn:
            verdicts.append((0, (), drawn[i]))
        elif i in chains:
            started = time.perf_counter()
            verdicts.append(chain_verdict(kernels, seq, proposal, logits[offset:offset + w]))
            sampling_seconds += time.perf_counter() - started
            sampled_rows += w
        elif proposal.tree is not None:
            started = time.perf_counter()
            path, bonus = (accept_tree_greedy(proposal.tree, greedy_ids[offset:offset + w]) if p is None
                           else accept_tree_sampled(proposal.tree, p, q, Children.TOP if q is None
                                                    else Children.SAMPLED, seq.gen))
            on_path = set(path)
            verdicts.append((len(path), tuple(i in on_path for i in range(len(drafts))), bonus))
            if p is not None:
                sampling_seconds += time.perf_counter() - started
                sampled_rows += w
        elif p is None:
            verdicts.append(accept_greedy_ids(drafts, greedy_ids[offset:offset + w]))
        else:
            started = time.perf_counter()
            n_ok, ok, bonus = accept(torch.tensor(drafts, dtype=torch.long), q if q is not None else p[:0], p, seq.gen)
            verdicts.append((n_ok, tuple(ok.tolist()), int(bonus)))
            sampling_seconds += time.perf_counter() - started
            sampled_rows += w
        offset += w
    return PassVerdicts(verdicts, sampling_seconds, sampled_rows)


def plain_sampled_tokens(kernels: Kernels, seqs: list[Sequence], proposals: list[Proposal], logits: torch.Tensor,
                         lengths: list[int]) -> dict[int, int]:
    """The next token of every sampled sequence with nothing drafted (index in seqs -> token): its one
    row drawn in C, one call per sampling setting, with a uniform from its own generator (the one
    `sample` would have drawn)."""
    offsets = [0, *itertools.accumulate(lengths)]
    drawn: dict[int, int] = {}
    for members in _by_setting(seqs, lambda i: not proposals[i].drafts):
        rows = logits[[offsets[i] for i in members]]  # [m, V] (a copy: contiguous)
        uniforms = torch.cat([torch.rand(1, generator=seqs[i].gen) for i in members])
        tokens = kernels.sample_rows(rows, seqs[members[0]].request.sampling, uniforms)
        for i, token in zip(members, tokens.tolist(), strict=True):
            drawn[i] = token
    return drawn


def chain_verdict(kernels: Kernels, seq: Sequence, proposal: Proposal, logits: torch.Tensor) -> Verdict:
    """A sampled request's verdict on its chain of k drafts (logits [k + 1, V], its window's rows) by
    `accept`'s rule in C, with the uniforms `accept` would draw from its generator: k for the tests,
    then one for the next token."""
    k = len(proposal.drafts)
    uniforms = torch.cat([torch.rand(k, generator=seq.gen), torch.rand(1, generator=seq.gen)])
    n_ok, ok, bonus = kernels.accept_drafts(logits, seq.request.sampling, torch.tensor(proposal.drafts),
                                            proposal.q.float().contiguous(), uniforms)
    return n_ok, tuple(ok.tolist()), bonus


def sampled_probs(seqs: list[Sequence], logits: torch.Tensor, lengths: list[int],
                  skip: Container[int] = ()) -> list[torch.Tensor | None]:
    """Each sampled sequence's target distributions p [w, V] over its window's rows (None for a
    greedy one, and for the indices in skip). The rows of every sequence with the same temperature,
    top-p and top-k go through one `target_probs` call: its operations are row by row, so each row's
    p is bitwise what it is alone, and a pass of 8 sampled requests pays ~230 us for them instead of
    ~390 (each call is a dozen small operations whose fixed cost exceeded their work on one 4,096-token
    row)."""
    offsets = [0, *itertools.accumulate(lengths)]
    probs: list[torch.Tensor | None] = [None] * len(seqs)
    for members in _by_setting(seqs, lambda i: i not in skip):
        rows = torch.cat([logits[offsets[i]:offsets[i + 1]] for i in members])
        p = target_probs(rows, seqs[members[0]].request.sampling)  # [rows, V]
        for i, part in zip(members, p.split([lengths[i] for i in members]), strict=True):
            probs[i] = part
    return probs


def _by_setting(seqs: list[Sequence], take: Callable[[int], bool]) -> list[list[int]]:
    """The indices of the sampled sequences that `take` keeps, grouped by sampling setting (temperature,
    top-p, top-k): the rows one call can decide together."""
    groups: dict[tuple[float, float, int], list[int]] = {}
    for i, seq in enumerate(seqs):
        params = seq.request.sampling
        if not params.greedy and take(i):
            groups.setdefault((params.temperature, params.top_p, params.top_k), []).append(i)
    return list(groups.values())
