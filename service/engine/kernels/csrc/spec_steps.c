/* Greedy speculative steps with a draft head, several in one call, head_greedy_steps: see library.py's
   Kernels.head_greedy_steps. */
#include "head.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* One sequence's greedy steps with a draft head, as the Python step runs each (model_drafting.py,
   model_runner.verify, the greedy verdict, the scheduler's commit), up to `steps` of them:
   - the head's catch-up over ids[draft_valid .. n) (entry p reads the target's feature of p - 1), then
     its chain of k' = min(k, budget - 1) drafts at temperature 0 (head_draft);
   - one target pass over the window [ids[n - 1], drafts] at positions n - 1.., its features written
     for those positions, its routed ids to routed;
   - the verdict: the drafts that match the target's argmax as a prefix (n_ok), then the argmax after
     them; ids gains those n_ok + 1 tokens, the budget loses them, and the head's cache is valid up to
     the old n (its entries of the drafts read its own feature estimates, so they are redone).
   Stops after `steps` steps, after a step that commits `eos`, or before a step whose k' would be < 1.
   Per step s: drafts [s, k] (k' of them), window [s] = k' + 1, accepted [s] = n_ok, matches [s, k] (1
   where draft i equals the target's argmax i), bonus [s], routed [s, L * (k + 1) * m] (the step's
   [L, k' + 1, m] first), step_ns [s, 2] (drafting, then the target pass and verdict). ids must hold n + the budget.
   Returns the steps run (0..steps); -1 when out of memory (nothing run). draft_valid >= 1. */
int64_t head_greedy_steps(const struct head_weights *hw, const struct spec_target *t, int64_t slot,
                          int64_t *ids, int64_t n, int64_t draft_valid, int64_t k, int64_t budget, int64_t eos,
                          int64_t steps, int64_t *drafts, int64_t *window, int64_t *accepted, int64_t *matches,
                          int64_t *bonus, int64_t *routed, int64_t *step_ns, struct kernel_pool *head_pool,
                          struct kernel_pool *target_pool) {
    const int64_t H = t->H, V = t->V, w_max = k + 1;
    float *scratch = malloc((size_t)(w_max * (H + V)) * sizeof(float));
    int64_t *picks = malloc((size_t)(4 * w_max) * sizeof(int64_t));
    if (!scratch || !picks) {
        free(scratch);
        free(picks);
        return -1;
    }
    int64_t *tokens = picks + w_max, *positions = tokens + w_max, *slots = positions + w_max;
    float *features = scratch, *logits = scratch + w_max * H;
    int64_t s = 0;
    for (; s < steps; s++) {
        const int64_t kk = k < budget - 1 ? k : budget - 1;
        if (kk < 1) break;
        const int64_t started = monotonic_ns();
        /* The catch-up's features: the target's of positions draft_valid - 1 .. n - 2, in place. */
        if (head_draft(hw, n - draft_valid, ids + draft_valid, t->features + (slot * t->S + draft_valid - 1) * H,
                       slot, draft_valid, kk, 0.0f, NULL, picks, NULL, head_pool) != 0)
            break;
        const int64_t drafted = monotonic_ns();
        tokens[0] = ids[n - 1];
        for (int64_t i = 0; i < kk; i++) tokens[i + 1] = hw->vocab[picks[i]];
        for (int64_t i = 0; i <= kk; i++) positions[i] = n - 1 + i, slots[i] = slot;
        int64_t row_argmax[w_max];
        /* The step's routed ids [L, k' + 1, m], packed at the start of its [L, k + 1, m] block. */
        if (forward_logits(tokens, kk + 1, H, t->L, t->layers, t->head, t->rope_cos, t->rope_sin, positions, slots,
                           NULL, t->k_cache, t->v_cache, t->layer_floats, t->S, routed + s * t->L * w_max * t->m,
                           target_pool, target_pool, target_pool, NULL, kk + 1, features, logits, row_argmax) != 0)
            break;
        memcpy(t->features + (slot * t->S + n - 1) * H, features, (size_t)((kk + 1) * H) * sizeof(float));
        int64_t ok = 0;
        while (ok < kk && tokens[ok + 1] == row_argmax[ok]) ok++;
        for (int64_t i = 0; i < k; i++) {
            drafts[s * k + i] = i < kk ? tokens[i + 1] : -1;
            matches[s * k + i] = i < kk && tokens[i + 1] == row_argmax[i];
        }
        window[s] = kk + 1;
        accepted[s] = ok;
        bonus[s] = row_argmax[ok];
        draft_valid = n;
        int stop = 0;
        for (int64_t i = 0; i <= ok; i++) {
            ids[n + i] = i < ok ? tokens[i + 1] : row_argmax[ok];
            stop |= ids[n + i] == eos;
        }
        n += ok + 1;
        budget -= ok + 1;
        const int64_t ended = monotonic_ns();
        step_ns[2 * s] = drafted - started;
        step_ns[2 * s + 1] = ended - drafted;
        if (stop) {
            s++;
            break;
        }
    }
    free(scratch);
    free(picks);
    return s;
}
