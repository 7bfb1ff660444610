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
    # forward: 2 all-gathers + 2 reduce-scatters of (b, s, h), (t - 1) / t each; backward: the
    # same again plus 2 re-gathers; then the 6 h replicated gradients (4 h LayerNorm, 2 h biases)
    # all-reduced: 10 (t - 1) / t B + 2 (t - 1) / t 24 h (lesson 06's formula)
    "sp-layer-wire-bytes": 10 * (t - 1) / t * 2 * s * h * 4 + 2 * (t - 1) / t * 6 * h * 4,
    "1f1b-bubble": (p - 1) / (12 + p - 1),  # m = 12 here: idle / step
    "1f1b-in-flight": p,  # stage k: p - k
    "gpipe-in-flight": m,
    # q and the output h x h each; k and v h x (n_kv h / n_head) each
    "full-recompute-saved-bytes": 4 * 16 * 32 * 4,  # the block's input (b, s, h), fp32
    "gqa-attention-params": 2 * 64 * 64 + 2 * 64 * (2 * 64 // 8),
    "moe-active-params": 4 * 32 + 2 * 3 * 32 * 64,  # router E h + k experts of 3 h f
    "ring-bytes-per-rank": 2 * (8 - 1) / 8 * 1024 * 4,  # 2 (n - 1) / n x B
    "cp-ring-forward-bytes": (2 - 1) * 2 * (1 * 8 * 4 * 8) * 4,  # (cp - 1) x K and V, fp32
    # N = V h (tied) + s h + L (12 h^2 + 13 h) + 2 h (final LayerNorm); 2 + 2 + 4 + 4 + 4 bytes each
    "training-state-bytes": 16 * (V * h + s * h + L * (12 * h * h + 13 * h) + 2 * h),
    "bf16-values-in-1-1024": 10 * 2**7,  # 7 stored mantissa bits, in each of 10 binades
    # add: reads x (n) and b (h), writes n; gelu: reads n, writes n; n = 64 x 128
    "eager-gelu-forward-bytes": 4 * (4 * 64 * 128 + 128),
    # rank = dp x (pp tp) + pp x tp + tp: rank 5 is (1, 0, 1); the dp stride is pp tp = 4
    "dp-peer-of-rank-5": 3 * 4 + 0 * 2 + 1,
    "reshard-elements-of-rank-2": 80 - 2 * math.ceil(80 / 3),  # the last rank: what is left
    "zero3-bytes-per-gpu": 16 * 7e9 / 64,  # everything sharded: 2 + 2 + 12 bytes over 64
    "young-interval-hours": math.sqrt(2 * 30 / 3600 * 56),  # sqrt(2 C M), C in hours
    "causal-tiles-computed": 12 * 13 // 2,  # T (T + 1) / 2, T = 384 / 32
    "chinchilla-params": math.sqrt(1e21 / 120),  # C = 6 N (20 N)
    "profiler-bmm-forward-bytes": L * 4 * 4 * 4 * (s * s + s * (h // 4)),  # L 4 b a (s^2 + s hd)
    # 8 mantissa codes in each of 15 normal binades (exponent codes 1-15), less the NaN, + 7
    # subnormals
    "e4m3-positive-finite-values": 15 * 8 - 1 + 7,
    # 2^-(floor(log2 3) - 8) = 2^7: amax lands in [256, 512)
    "mx-scale-for-amax-3": 2 ** -(math.floor(math.log2(3.0)) - 8),
    # ceil(5000 / 2048) = 3 blocks of 2,048 codes at half a byte, and 3 fp32 scales
    "qwz-int4-row-bytes": 3 * 2048 // 2 + 3 * 4,
    # n padded to 1,008 (a multiple of 16): the signs' 126 bytes, half of them sent by the all-to-all
    # and half by the all-gather; two scales of 4 bytes, one sent each time
    "onebit-wire-bytes": 2 * (2 - 1) / 2 * 1008 / 8 + 2 * 4 * (2 - 1),
}
