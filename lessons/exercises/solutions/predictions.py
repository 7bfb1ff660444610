"""Solution of the predictions (lessons/exercises/predictions.py), each with its formula."""

import math

V, s, L, h, t, p, m = 256, 16, 2, 32, 2, 4, 8
PREDICTIONS = {
    "loss-at-init": math.log(V),  # uniform over V tokens: -ln(1/V)
    # 6 flops per weight per token (2 forward, 4 backward) on the L 12 h^2 block weights and the V h
    # head, plus attention's q k^T and (scores) v: 2 x 2 s h forward per layer, x 3 with backward
    "flops-per-token": 6 * (L * 12 * h * h + V * h) + 12 * L * h * s,
    "dp-wire-bytes-per-param": 2 * (2 - 1) / 2 * 4,  # ring all-reduce: 2 (N - 1) / N of 4 bytes
    "zero1-state-bytes-per-param": 8 / 2,  # m and v: 8 bytes per parameter, split over N = 2
    # 2 all-reduces (attention, MLP) of (b, s, h)
    "tp-forward-wire-bytes": 2 * (2 * (t - 1) / t) * 2 * s * h * 4,
    "1f1b-bubble": (p - 1) / (12 + p - 1),  # m = 12 here: idle / step
    "1f1b-in-flight": p,  # stage k: p - k
    "gpipe-in-flight": m,
    # q and the output h x h each; k and v h x (n_kv h / n_head) each
    "full-recompute-saved-bytes": 4 * 16 * 32 * 4,  # the block's input (b, s, h), fp32
    "gqa-attention-params": 2 * 64 * 64 + 2 * 64 * (2 * 64 // 8),
    "moe-active-params": 4 * 32 + 2 * 3 * 32 * 64,  # router E h + k experts of 3 h f
    "ring-bytes-per-rank": 2 * (8 - 1) / 8 * 1024 * 4,  # 2 (n - 1) / n x B
    "cp-ring-forward-bytes": (2 - 1) * 2 * (1 * 8 * 4 * 8) * 4,  # (cp - 1) x K and V, fp32
}
