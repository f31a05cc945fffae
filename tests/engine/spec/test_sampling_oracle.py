"""`target_probs` (temperature, then top-k, then top-p) against an independent oracle: transformers'
own logits warpers, on the same logits, for many (temperature, top_k, top_p) combinations.

Tie semantics, where the two differ on purpose: transformers' top-k keeps every token tied with the
k-th; its top-p keeps only the tied tokens that happen to sort first (vocabulary order decides).
Ours keeps every token tied at the top-p boundary too, so equal probabilities are treated alike and
the result never depends on token ids. The tests pin that down: our support at a tie is the union of
transformers' supports over every order of the tied tokens, and `target_probs` commutes with any
permutation of the vocabulary (the order-dependent rule is kept below as a negative control).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from service.engine.model.ragged import KVCache
from service.engine.model.weights import DEFAULT_TARGET_DIR, load_for_inference
from service.engine.spec.sampling import target_probs
from service.types import SamplingParams
from tests.support.engine_helpers import heldout_prompts, transformers_target_probs

transformers = pytest.importorskip("transformers")

V = 4096
TEMPERATURES = (0.25, 0.7, 1.6)
TOP_KS = (0, 1, 10, V + 5)
TOP_PS = (0.05, 0.5, 0.9, 0.99, 1.0)


def mass_before(probs: torch.Tensor) -> torch.Tensor:
    """[n, V] -> for each token, the mass of the tokens strictly likelier than it (float64)."""
    sorted_p, order = probs.double().sort(-1, descending=True)
    exclusive = sorted_p.cumsum(-1) - sorted_p  # mass before each sorted position
    starts = torch.ones_like(sorted_p, dtype=torch.bool)
    starts[:, 1:] = sorted_p[:, 1:] != sorted_p[:, :-1]  # first member of each group of equal values
    # Every member of a tie gets the mass before its group's first member (exclusive never decreases).
    per_group = exclusive.masked_fill(~starts, float("-inf")).cummax(-1).values
    return torch.empty_like(per_group).scatter_(-1, order, per_group)


@pytest.fixture(scope="module")
def logits() -> torch.Tensor:
    """Real next-token logits of the shipped target at every position of three prompts, plus
    seeded random logits at several scales (flat to peaked): [n, V]."""
    model = load_for_inference(DEFAULT_TARGET_DIR)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(DEFAULT_TARGET_DIR / "tokenizer.json"))
    rows = []
    with torch.inference_mode():
        for prompt in heldout_prompts(3):
            ids = torch.tensor(tokenizer.encode(prompt).ids[-24:])
            rows.append(model.forward(ids, 0, KVCache(model.cfg, 32)).logits)
    gen = torch.Generator().manual_seed(0)
    rows += [torch.randn(8, V, generator=gen) * scale for scale in (0.5, 2.0, 6.0)]
    return torch.cat(rows)


@pytest.mark.parametrize("top_k", TOP_KS)
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_target_probs_equal_transformers_warpers(logits, temperature, top_k):
    # Mass strictly before each token once temperature and top-k are applied: what top-p cuts on.
    before = mass_before(transformers_target_probs(logits, SamplingParams(temperature=temperature, top_k=top_k)))
    for top_p in TOP_PS:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        ours, theirs = target_probs(logits, params), transformers_target_probs(logits, params)
        context = f"temperature={temperature} top_k={top_k} top_p={top_p}"
        # transformers compares 1 - (ascending cumsum) with 1 - top_p, we compare the mass before a
        # token with top_p: the two may round differently only for a token whose mass before is
        # top_p to float32 precision. Anywhere else the supports must be identical.
        differ = (ours > 0) != (theirs > 0)
        on_edge = (before - top_p).abs() < 1e-5 if top_p < 1 else torch.zeros_like(differ)
        assert not (differ & ~on_edge).any(), context
        rows = differ.any(-1)
        assert rows.float().mean() < 0.05, f"{context}: {int(rows.sum())} rows differ at the boundary"
        torch.testing.assert_close(ours[~rows], theirs[~rows], atol=1e-6, rtol=1e-4, msg=context)


@pytest.mark.parametrize("top_p", (0.05, 0.3, 0.5, 0.9, 0.99))
def test_top_p_keeps_exactly_the_tokens_whose_likelier_mass_is_below_top_p(logits, top_p):
    """The rule itself, from its definition, on every row (boundary rows included)."""
    params = SamplingParams(temperature=0.8, top_p=top_p)
    before = mass_before(logits.div(0.8).softmax(-1))
    kept = target_probs(logits, params) > 0
    clear = (before - top_p).abs() > 1e-6  # float32 softmax vs float64 sums: leave the last ulps
    assert torch.equal(kept[clear], (before < top_p)[clear])
    assert kept.sum(-1).min() >= 1


def tied_logits() -> torch.Tensor:
    """Rows whose top-p boundary (0.5) falls inside a group of tied tokens at several vocab positions."""
    base = torch.full((V,), -30.0)
    rows = []
    for positions in ([3, 4, 5], [0, 17, 4095], [100, 7, 50, 2]):
        row = base.clone()
        row[1000] = 1.0  # the likeliest token: ~45% of the mass
        row[positions] = 0.0  # a tie, each ~17%: the boundary cuts through it
        rows.append(row)
    return torch.stack(rows)


def test_ties_at_the_top_p_boundary_are_all_kept_where_transformers_keeps_some(monkeypatch):
    ties = tied_logits()
    params = SamplingParams(temperature=1.0, top_p=0.5)
    ours = target_probs(ties, params)
    for row, ours_row in zip(ties, ours, strict=True):
        tied = (row == 0).nonzero().view(-1).tolist()
        assert set((ours_row > 0).nonzero().view(-1).tolist()) == {1000, *tied}
        assert torch.allclose(ours_row[tied], ours_row[tied[0]].expand(len(tied)))  # equal, as their logits
        # transformers keeps a subset of the tie that depends on where the tied tokens sit; the
        # union over every order of the tied ids (relabel them, run, map back) is the whole tie.
        union: set[int] = set()
        kept_sizes = set()
        for order in itertools.permutations(range(len(tied))):
            perm = torch.arange(V)
            perm[tied] = torch.tensor(tied)[list(order)]
            theirs = transformers_target_probs(row[perm].unsqueeze(0), params)[0]
            kept = {int(perm[i]) for i in (theirs > 0).nonzero().view(-1)}
            assert 1000 in kept and kept <= {1000, *tied}
            kept_sizes.add(len(kept))
            union |= kept
        assert union == {1000, *tied}
        assert max(kept_sizes) < len(tied) + 1, "transformers kept the whole tie: the documented difference is gone"


def sort_based_top_p(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Negative control: the order-dependent rule (drop by position in a sort, ties split arbitrarily)."""
    probs = (logits / params.temperature).softmax(-1)
    sorted_p, order = probs.sort(-1, descending=True)
    drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
    probs = probs.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), 0.0)
    return probs / probs.sum(-1, keepdim=True)


def commutes_with_vocab_permutations(probs_fn, logits: torch.Tensor, params: SamplingParams, tries: int = 20) -> bool:
    gen = torch.Generator().manual_seed(1)
    reference = probs_fn(logits, params)
    for _ in range(tries):
        perm = torch.randperm(logits.shape[-1], generator=gen)
        permuted = probs_fn(logits[:, perm], params)
        # Same support exactly; the values to rounding (softmax sums in another order).
        if not torch.equal(permuted > 0, reference[:, perm] > 0):
            return False
        torch.testing.assert_close(permuted, reference[:, perm])
    return True


@pytest.mark.parametrize("top_k", (0, 5))
def test_target_probs_commute_with_any_permutation_of_the_vocabulary(top_k):
    """Integer logits in a small range: many exact ties, several at every boundary."""
    gen = torch.Generator().manual_seed(2)
    ties = torch.randint(-3, 3, (64, 40), generator=gen).float()
    for top_p in (0.2, 0.5, 0.8):
        params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
        assert commutes_with_vocab_permutations(target_probs, ties, params), params
    # Negative control: the rule that splits ties by sort position fails the same check.
    assert not commutes_with_vocab_permutations(sort_based_top_p, ties, SamplingParams(temperature=1.0, top_p=0.5))


def test_target_probs_equal_transformers_generate_processed_scores():
    """transformers' generate() applies its own warper pipeline (order and defaults included);
    `output_logits` are its raw logits and `output_scores` what it sampled from."""
    directory = DEFAULT_TARGET_DIR
    oracle = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    ids = tokenizer(heldout_prompts(1)[0][-200:], return_tensors="pt")["input_ids"]
    for temperature, top_k, top_p in ((0.7, 0, 0.9), (1.3, 20, 1.0), (0.9, 50, 0.8), (1.0, 3, 0.5)):
        torch.manual_seed(0)
        out = oracle.generate(ids, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p,
                              max_new_tokens=6, output_scores=True, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=oracle.config.eos_token_id)
        raw, processed = torch.cat(out.logits), torch.cat(out.scores)  # [steps, V] each
        ours = target_probs(raw, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
        theirs = processed.softmax(-1)
        assert torch.equal(ours > 0, theirs > 0), (temperature, top_k, top_p)
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-4)
