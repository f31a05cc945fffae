"""The pairwise overlap of a window's expert sets: whether one stray position or the whole window
made its union wide.

For a window of w positions, each position routes to a set S_i of experts per layer; the union
|S_1 ∪ ... ∪ S_w| says how many experts the verify pass ran. The pairwise intersections |S_i ∩ S_j|
(i < j) say how they got there: a high mean with one low minimum is one divergent position (a draft
from another branch); a low mean is a window whose positions all went their own way. A window of
one position has no pairs: both figures are then its own set's size. numpy, for the embedded
engine's records and the what-if replay; SGLang's are computed on the device by the plugin
(service/sglang_plugin/statistics.py) with the same definition.
"""

from __future__ import annotations

import numpy as np


def pairwise_overlap(routed: np.ndarray, num_experts: int) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """routed ids [L, w, m] (-1 = none) -> per layer (mean, smallest) |S_i ∩ S_j| over pairs i < j."""
    layers, w, _ = routed.shape
    sets = np.zeros((layers, w, num_experts + 1), dtype=np.float32)  # [L, w, E+1]; column E swallows -1
    np.put_along_axis(sets, np.where(routed < 0, num_experts, routed), 1.0, axis=2)
    sets = sets[..., :num_experts]
    overlap = sets @ sets.transpose(0, 2, 1)  # [L, w, w]
    if w == 1:
        own = overlap[:, 0, 0]
        return tuple(float(x) for x in own), tuple(int(x) for x in own)
    upper = np.triu_indices(w, 1)
    pairs = overlap[:, upper[0], upper[1]]  # [L, w(w-1)/2]
    return tuple(float(x) for x in pairs.mean(1)), tuple(int(x) for x in pairs.min(1))
