"""Speculative decoding for one request, in plain torch: the place to learn the algorithm.

The engine (service/engine/scheduler.py) runs the same algorithm for many requests at once, with
KV caches, chunked prefill and adaptive draft lengths; tests/engine/spec/test_reference_step.py
checks that it computes what this file computes. Each step:

1. the drafter proposes up to k tokens d1..dk, each drawn from a distribution q_i it reports;
2. the target scores the window [last token, d1..dk] in ONE pass: k + 1 next-token
   distributions, p_1..p_k for the drafts' positions and p_{k+1} for the position after them;
3. greedy: accept the longest prefix of drafts equal to the target's argmax, then take the
   target's own argmax after it. Sampled: accept d_i with probability min(1, p_i(d_i) / q_i(d_i));
   at the first rejection draw the replacement from norm(max(0, p_i - q_i)); if all k survive,
   draw a bonus token from p_{k+1}. Either way the committed tokens follow p exactly, whatever q
   is (Leviathan et al. 2023; Chen et al. 2023): drafting changes the speed, never the output's law;
4. commit; stop at max_new_tokens or after EOS.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from service.engine.spec.sampling import target_probs
from service.types import SamplingParams

# tokens [n] -> logits [n, V]; row i scores the token that follows tokens[:i + 1].
Target = Callable[[list[int]], torch.Tensor]
# (tokens so far, k, generator) -> (up to k drafts, q [drafts, V]: the distribution each was drawn from).
Drafter = Callable[[list[int], int, torch.Generator], tuple[list[int], torch.Tensor]]


@dataclass
class Output:
    tokens: list[int] = field(default_factory=list)
    steps: list[tuple[int, int, int]] = field(default_factory=list)  # per step: (drafted, accepted, committed)


def generate(target: Target, drafter: Drafter, prompt: list[int], draft_length: int, sampling: SamplingParams,
             max_new_tokens: int, eos_id: int | None, generator: torch.Generator) -> Output:
    out, tokens = Output(), list(prompt)
    while len(out.tokens) < max_new_tokens and eos_id not in out.tokens:
        # The target adds one token of its own every step: drafting past the budget would be wasted.
        k = min(draft_length, max_new_tokens - len(out.tokens) - 1)
        drafts, q = drafter(tokens, k, generator) if k > 0 else ([], None)
        # Rows len(tokens)-1 .. end are the window [last token, drafts...]. Without a KV cache the target
        # recomputes the whole sequence; the engine's pass computes only these k + 1 rows.
        window_logits = target(tokens + drafts)[len(tokens) - 1:]  # [k + 1, V]
        if sampling.greedy:
            accepted, next_token = verify_greedy(drafts, window_logits)
        else:
            accepted, next_token = verify_sampled(drafts, q, target_probs(window_logits, sampling), generator)
        committed = drafts[:accepted] + [next_token]
        if eos_id in committed:  # EOS ends the output (and is kept in it); later tokens are dropped
            committed = committed[:committed.index(eos_id) + 1]
        tokens += committed
        out.tokens += committed
        out.steps.append((len(drafts), accepted, len(committed)))
    return out


def verify_greedy(drafts: list[int], window_logits: torch.Tensor) -> tuple[int, int]:
    """-> (drafts accepted, the target's token after them). A greedy target's choice is its argmax,
    so a draft survives only if the target would have picked it itself."""
    choices = window_logits.argmax(-1).tolist()  # [k + 1]
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == choices[accepted]:
        accepted += 1
    return accepted, choices[accepted]


def verify_sampled(drafts: list[int], q: torch.Tensor, p: torch.Tensor,
                   generator: torch.Generator) -> tuple[int, int]:
    """drafts [k], q [k, V], p [k + 1, V] -> (drafts accepted, the next token: residual draw or bonus)."""
    for i, token in enumerate(drafts):
        # u < p/q happens with probability min(1, p/q): where the drafter over-proposes a token, it is
        # thinned down to the target's rate; where it under-proposes, it is always kept.
        if torch.rand((), generator=generator) < p[i, token] / q[i, token]:
            continue
        # Rejected: draw from the mass p has and q lacked, which is exactly what acceptance left
        # missing. A rejection implies q(token) > p(token), so this residual is never all zero.
        return i, draw(torch.clamp(p[i] - q[i], min=0), generator)
    return len(drafts), draw(p[len(drafts)], generator)  # every draft kept: the pass gives a bonus token


def draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One token with probability proportional to weights [V] (not necessarily normalised)."""
    return int(torch.multinomial(weights, 1, generator=generator))


# ------------------------------------------------------------------------------------- drafters
def ngram_drafter(vocab: int, min_n: int = 2, max_n: int = 4) -> Drafter:
    """Prompt lookup: find the latest earlier occurrence of the longest suffix (max_n down to min_n
    tokens) and propose what followed it. Deterministic, so q is a point mass on each draft."""
    def propose(tokens: list[int], k: int, generator: torch.Generator) -> tuple[list[int], torch.Tensor]:
        for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
            suffix = tokens[-n:]
            # Latest start first; a match must be followed by a token, so the suffix never matches itself.
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == suffix:
                    drafts = tokens[start + n:start + n + k]
                    return drafts, point_masses(drafts, vocab)
        return [], point_masses([], vocab)
    return propose


def model_drafter(draft_model: Target, temperature: float) -> Drafter:
    """A small language model drafting k tokens one after another: argmax at temperature 0 (q a
    point mass), else a draw from softmax(logits / temperature) (q that softmax)."""
    def propose(tokens: list[int], k: int, generator: torch.Generator) -> tuple[list[int], torch.Tensor]:
        drafts, qs = [], []
        for _ in range(k):
            logits = draft_model(tokens + drafts)[-1]  # [V]
            if temperature == 0:
                drafts.append(int(logits.argmax()))
                qs.append(point_masses(drafts[-1:], logits.shape[-1])[0])
            else:
                qs.append((logits / temperature).softmax(-1))
                drafts.append(draw(qs[-1], generator))
        return drafts, torch.stack(qs)
    return propose


def point_masses(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tokens, dtype=torch.long), vocab).float()  # [len, V]


def transformers_model(directory) -> Target:
    """A model directory run by transformers in float32: an implementation independent of the engine's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()

    def logits(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([tokens])).logits[0]
    return logits
