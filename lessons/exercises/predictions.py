"""Predict the number, then run. Replace each None by your prediction (a number, or an expression),
with a line of reasoning; then `python lessons/check.py --predict lessons/exercises/predictions.py`
measures each one you answered (lessons/predict.py) and prints RIGHT (within 1%) or WRONG. Work on a
copy if you like.

The model of lessons 01's and 05's questions: nanomega.model's GPT-2 form, vocabulary V = 256 (no
padding), context s = 16, L = 2 layers, 4 heads, width h = 32, tied embedding, fp32. Lesson 04's
questions run the minimal track's files (lessons/minimal/dp_naive.py, zero1.py); per parameter, the
model does not matter.
"""

PREDICTIONS = {
    # lesson 01: the loss of the untrained model on random tokens (every token about equally likely)
    "loss-at-init": None,
    # lesson 01: training FLOPs per token (forward + backward) counted by torch's FlopCounterMode,
    # which counts matmuls only: the weight matrices (the tied LM head once) and attention's two s x
    # s products
    "flops-per-token": None,
    # lesson 04: plain data parallelism on N = 2 ranks, fp32 gradients: bytes one rank puts on the
    # wire per parameter per step (ring all-reduce)
    "dp-wire-bytes-per-param": None,
    # lesson 04: ZeRO-1 on N = 2 ranks with AdamW: bytes of optimizer state (m and v, fp32) one rank
    # holds per parameter of the model
    "zero1-state-bytes-per-param": None,
    # lesson 05: one transformer layer's FORWARD under tensor parallelism t = 2, input (b, s, h) =
    # (2, 16, 32) fp32: bytes one rank puts on the wire (ring)
    "tp-forward-wire-bytes": None,
    # lesson 06: the same layer under sequence parallelism (t = 2; each rank holds (2, 8, 32), its
    # half of the sequence), FORWARD AND BACKWARD: bytes one rank puts on the wire. Careful: the
    # backward gathers the MLP's and attention's inputs again (they were not kept whole), and the
    # replicated LayerNorm weights and row-parallel biases saw 1/t of the tokens each
    "sp-layer-wire-bytes": None,
    # lesson 08: 1F1B with p = 4 stages and m = 12 micro-batches, a backward taking twice a forward:
    # the idle share of the whole step (the bubble), as a fraction. Careful: Narayanan et al.'s
    # "bubble time fraction" is idle time over the IDEAL time, not over the step
    "1f1b-bubble": None,
    # lesson 08: the most micro-batches whose activations the FIRST stage holds at once, 1F1B, p =
    # 4, m = 8
    "1f1b-in-flight": None,
    # lesson 08: the same for GPipe (all forwards, then all backwards)
    "gpipe-in-flight": None,
    # lesson 11: full recompute, the GPT above on a (4, 16) batch: the bytes autograd keeps for
    # backward inside one block during the forward. Careful: what the block recomputes is not kept
    "full-recompute-saved-bytes": None,
    # lesson 02: parameters of one Llama block's attention (q, k, v and output projections, no
    # biases) at width h = 64 with 8 query heads and 2 key/value heads. Careful: k and v are as wide
    # as the key/value heads, not as h
    "gqa-attention-params": None,
    # lesson 16: a MoE block at width h = 32, SwiGLU experts of width f = 64 (three h x f matrices
    # each), E = 4 experts, top-2: the parameters of the MLP that one token's output depends on (the
    # router counts: it scores every expert)
    "moe-active-params": None,
    # lesson 03: a ring all-reduce over n = 8 ranks of a 1024-element fp32 tensor: bytes ONE rank
    # sends. Careful: per rank, not summed over the ranks, and both phases
    "ring-bytes-per-rank": None,
    # lesson 07: ring attention over cp = 2, one layer's FORWARD: each rank holds 8 of 16 tokens, 4
    # heads of 8 dims, batch 1, fp32, no grouped-query: bytes one rank sends. Careful: the ring moves
    # keys and values, not queries
    "cp-ring-forward-bytes": None,
    # lesson 00: the GPT above in bf16 with Adam in mixed precision: bytes of training state after
    # one step (weights, gradients, fp32 master copy, Adam's two moments). Careful: the embedding is
    # tied to the LM head, and LayerNorms and biases are parameters too
    "training-state-bytes": None,
    # lesson 09: how many distinct bf16 numbers lie in [1, 1024). Careful: the leading 1 of the
    # significand is not stored, and the spacing doubles at each power of two
    "bf16-values-in-1-1024": None,
    # lesson 13: eager gelu(x + bias) FORWARD only, x (64, 128) and bias (128,) fp32: bytes its aten
    # kernels read and write (lesson 13's ByteCounter). Careful: the add writes x + b out, and gelu
    # reads it back in
    "eager-gelu-forward-bytes": None,
    # lesson 15: dist.layout(dp=4, pp=2, tp=2), 16 ranks: the rank at dp index 3 of rank 5's
    # data-parallel group. Careful: nanomega puts dp outermost and tp fastest (Megatron's order
    # differs: Appendix of lesson 00)
    "dp-peer-of-rank-5": None,
    # lesson 19: a flat buffer of 80 elements split over N = 3 ranks (flat.FlatGroup, as lesson 19's
    # picture): how many elements rank 2 owns
    "reshard-elements-of-rank-2": None,
    # lesson 21: the planner's training state per GPU for a 7B model under ZeRO-3 over dp = 64, bf16
    # weights and gradients and Adam's 12 bytes (formulas.zero_state_bytes), in bytes
    "zero3-bytes-per-gpu": None,
    # lesson 20: the checkpoint interval, in hours, that minimises C/T + T/(2M) with a 30 s save and
    # a job MTBF of 56 h. Careful: C and M in the same unit
    "young-interval-hours": None,
    # lesson 12: causal (block x block) tiles a FlashAttention kernel computes at s = 384, block =
    # 32. Careful: the diagonal tiles are computed (masked inside), only those above are skipped
    "causal-tiles-computed": None,
    # lesson 22: Chinchilla's compute-optimal parameter count N for a budget of 1e21 FLOPs, with
    # C = 6 N D and D = 20 N
    "chinchilla-params": None,
    # lesson 14: torch.profiler's memory view, one FORWARD (no grad) of the GPT above with eager
    # attention on (4, 16): bytes aten::bmm allocates. Careful: per layer the scores are (b, a, s, s)
    # and P V is (b, a, s, hd); hd = h / a
    "profiler-bmm-forward-bytes": None,
    # lesson 10: how many distinct positive finite numbers E4M3 (torch.float8_e4m3fn) holds, its
    # subnormals included. Careful: E4M3fn gives up infinities; only S.1111.111 is NaN, so its top
    # exponent holds normal numbers (IEEE's convention, the top exponent for inf and NaN, is E5M2's)
    "e4m3-positive-finite-values": None,
    # lesson 10: MXFP8 (E4M3, 1 x 32 blocks): the number a block is multiplied by before its cast,
    # when the block's amax is 3.0. Careful: not fmax / amax (the current-scaling rule): MX's scale is
    # a power of two, from floor(log2 amax) and E4M3's largest exponent
    "mx-scale-for-amax-3": None,
    # lesson 17: qwZ at int4 (zeropp.quantize, blocks of 2,048 elements): bytes of one row of 5,000
    # fp32 weights once quantized, codes and scales. Careful: the last block is quantized whole
    # (padded), two codes share a byte, and every block carries its own fp32 scale
    "qwz-int4-row-bytes": None,
    # lesson 18: 1-bit Adam after its warm-up, N = 2 ranks: bytes one rank sends for the compressed
    # mean of a 1,000-element momentum (Axis counts a ring: (N - 1)/N of each buffer). Careful: the
    # signs are padded to a multiple of 8 N, both the all-to-all and the all-gather move them, and
    # every scale is 4 bytes
    "onebit-wire-bytes": None,
}
