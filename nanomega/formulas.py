"""The closed forms behind the planner: one small pure function per quantity that the modules count.

Parameters held, bytes sent and activations kept follow from the shapes alone, so they can be
predicted for a run no machine here can do and compared with the byte counters of a tiny run that it
can. These are the single home of each formula: train.py's MFU (model_flops_per_token) and the
recompute lesson call them too.

Formulas (Psi = parameters one rank holds, d/t/p = dp/tp/pp sizes, m = micro-batches per step,
          B = bytes each):
    state      (B_param + B_grad + B_optim) Psi; ZeRO stage 1 divides the optimizer term by d,
               2 also the gradients, 3 also the parameters (ZeRO paper, fp16 + Adam: 2 + 2 + 12;
               Megatron, bf16 params and fp32 grads: 18 -> 6 + 12/d with the distributed optimizer)
    dp bytes   ring all-reduce 2(d-1)/d Psi B; reduce-scatter and all-gather (d-1)/d each;
               ZeRO-3 3(d-1)/d (1.5x); hybrid sharding (d = S R: shard S inside a host, R
               across): ZeRO's over S inside, one all-reduce 2(R-1)/R Psi B / S across;
               ZeRO++ (zeropp_comm_bytes): qwZ's gather of blockwise int8/int4 codes + fp32 scales,
               hpZ's backward gather inside (S-1)/S, qgZ's two all-to-alls of quantized blocks
    tp bytes   per layer and micro-batch, in units of (t-1)/t b*s*h elements: TP 8 (2 all-reduces
               forward, 2 backward); TP+SP 10 (2 all-gathers + 2 reduce-scatters forward, their
               conjugates backward, and the 2 all-gathers that re-gather the stored shards for the
               weight gradients: lesson 06 measures it); full recompute adds the forward's 4 again.
               Llama's q_proj and kv_proj gather their input apart: 3 column-parallel inputs instead
               of 2, TP 10, TP+SP 13
    activation per layer and micro-batch (Korthikanti et al. 2022): sbh(34 + 5as/h);
               TP sbh(10 + 24/t + 5as/(ht)); TP+SP sbh(34 + 5as/h)/t; selective recompute drops the
               5as/h term; full recompute keeps 2sbh.
               Llama (no dropout, FlashAttention-style core), 2-byte:
               sbh(8 + (4 + 6 n_kv/a + 6f/h)/t) with TP, all of it /t with SP
               (llama_activation_bytes_per_layer, checked against autograd's saved tensors)
    bubble     (p-1) / (v m + p-1) of the step is idle (v = interleaved model chunks per stage);
               Narayanan et al. quote it against the ideal time instead: (p-1) / (v m), the step's
               extra time
    FLOPs      6N + 12 L h s per token (PaLM, nanoGPT: QK^T and AV counted without causal halving);
               MoE: N the active parameters (k of E experts, the router, the shared experts);
               MLA: N its projections, the core 6 L s a (d_n + d_r + d_v) (mla.py)
    KV cache   per token: L 2 n_kv d_h elements; MLA L (d_c + d_r)
    MoE a2a    per MoE layer and micro-batch a rank sends 2 (R_out + R_in) h B bytes (dispatch and
               combine, forward and backward; R_out rows to other ranks' experts, R_in rows it
               computed for others) + (ep-1) E/ep 8 bytes of counts;
               balanced routing: R_out = R_in = T k (ep-1)/ep
    MoE x cp   per MoE layer and micro-batch forward one all-reduce over cp of the (b, E) fp32
               assignment counts (moe.balance_loss): 4 b E tensor bytes, 2(cp-1)/cp of it on the wire
    collective alpha-beta: ring all-reduce 2(n-1)(alpha + B beta / n);
               binary tree 2 log2(n)(alpha + B beta)
    sizing     compute-optimal N = sqrt(C / 6k), D = k N, k ~ 20 tokens per parameter (Chinchilla)
Lesson: lessons/21-planning-a-run.md
"""

import math


# ---- parameters ----------------------------------------------------------------------------------
def layer_params(h, t=1):
    """One Block on one TP rank: qkv, fc weights and their biases split by t (column
    parallel); projection weights split (row parallel), their biases and both LayerNorms
    replicated. t=1: 12h^2 + 13h."""
    return (12 * h * h + 7 * h) // t + 6 * h


def llama_layer_params(h, f, a, n_kv, t=1):
    """One Llama block on one TP rank (modern.py): q and o 2h^2, k and v 2h^2 n_kv/a (GQA), gate, up
    and down 3hf, all split by t; the two RMSNorm scales 2h replicated. When t does not divide n_kv
    the k/v weight is held whole on every rank (tp.GroupKeyValue). t=1, a = n_kv, f = 8h/3: GPT-2's
    12h^2 again, less its biases."""
    kv = 2 * h * (h // a) * n_kv
    return (2 * h * h + 3 * h * f) // t + (kv // t if n_kv % t == 0 else kv) + 2 * h


def mla_attention_params(h, a, q_lora, kv_lora, nope, rope, v, t=1):
    """Multi-head latent attention on one TP rank (mla.py): the up-projections W_qb (or W_q when
    q_lora = 0), W_kvb and the output W_o split by heads; W_qa, W_kva and the two latent norms
    whole on every rank."""
    q_out = a * (nope + rope)
    q = q_lora * q_out // t + h * q_lora + q_lora if q_lora else h * q_out // t
    return q + (kv_lora * a * (nope + v) + a * v * h) // t + h * (kv_lora + rope) + kv_lora


def mla_layer_delta(cfg, t=1):
    """What MLA changes in a Llama layer's parameters on one TP rank (cfg: a GPTConfig): its
    attention's count less multi-head attention's; 0 without MLA."""
    if not cfg.kv_lora_rank:
        return 0
    h, a = cfg.n_embd, cfg.n_head
    mha = llama_layer_params(h, 0, a, a, t) - 2 * h  # q, k, v, o (MLA has no n_kv_head)
    return mla_attention_params(h, a, cfg.q_lora_rank, cfg.kv_lora_rank, *cfg.mla_dims, t) - mha


def mtp_params(cfg, t=1):
    """Multi-token prediction's D modules on one TP rank (mtp.py; a GPTConfig): each one Llama
    layer (MLA's if the model's is), the 2h -> h projection and three RMSNorm scales (the
    embedding's, the hidden state's, the final); the embedding and the head are the model's."""
    h = cfg.n_embd
    layer = llama_layer_params(h, cfg.ffn, cfg.n_head, cfg.kv_heads, t) + mla_layer_delta(cfg, t)
    return cfg.mtp_num_layers * (layer + 2 * h * h + 3 * h)


def kv_cache_bytes_per_token(cfg, elem_bytes=2):
    """Inference KV-cache bytes per token over all layers: a key and a value per key/value head, 2
    n_kv d_h a layer; MLA only its latent and shared rotary key, d_c + d_r (DeepSeek-V2, arXiv
    2405.04434 Table 1: (d_c + d_r) l = 4.5 d_h l at d_c = 4 d_h, d_r = d_h / 2)."""
    if cfg.kv_lora_rank:
        per_layer = cfg.kv_lora_rank + cfg.mla_dims[1]
    else:
        per_layer = 2 * cfg.kv_heads * (cfg.n_embd // cfg.n_head)
    return cfg.n_layer * per_layer * elem_bytes


# ---- memory --------------------------------------------------------------------------------------
def moe_layer_params(h, f, a, n_kv, n_experts, top_k, shared=0, t=1, gate=False):
    """(total, active per token) parameters of one MoE Llama block on one TP rank: attention and
    norms as llama_layer_params, E experts of 3hf (split by t), the (E, h) router (replicated),
    shared experts 3hf each (gate: Qwen2-MoE's (1, h) gate, replicated); a token uses k routed
    experts."""
    base = llama_layer_params(h, 0, a, n_kv, t) + (n_experts + gate) * h
    base += moe_expert_params(h, f, shared, t)
    return base + moe_expert_params(h, f, n_experts, t), base + moe_expert_params(h, f, top_k, t)


def moe_expert_params(h, f, n_experts, t=1):
    """n_experts SwiGLU experts of width f on one TP rank: gate, up and down 3hf
    each, split by t."""
    return n_experts * 3 * h * f // t


def moe_all_to_all_bytes(rows_out, rows_in, h, elem_bytes, ep, experts_per_rank):
    """Bytes one rank sends in all-to-alls for one MoE layer and micro-batch, forward and
    backward (ep.py)."""
    if ep == 1:
        return 0
    return 2 * (rows_out + rows_in) * h * elem_bytes + (ep - 1) * experts_per_rank * 8


def moe_cp_balance_bytes(b, n_experts, moe_layers, forwards, cp):
    """Tensor bytes one rank all-reduces over cp for the balance loss's assignment counts: one fp32
    (b, E) tensor per MoE layer and forward (micro-batches, x 2 under full recompute)."""
    return 0 if cp == 1 else forwards * moe_layers * b * n_experts * 4


def moe_balanced_rows(tokens, top_k, ep):
    """Rows a rank sends to other ranks' experts when routing is uniform: T k (ep-1)/ep."""
    return tokens * top_k * (ep - 1) / ep


def zero_state_bytes(n_params, stage, dp, param_bytes=2, grad_bytes=2, optim_bytes=12):
    """(parameter, gradient, optimizer) bytes on one DP rank. Stage 1 shards the optimizer state, 2
    also the gradients, 3 also the parameters; a shard is ceil(n/dp) elements (flat buffer padded to
    a multiple of dp)."""
    shard = math.ceil(n_params / dp)
    p, g, o = (shard if stage >= k else n_params for k in (3, 2, 1))
    return p * param_bytes, g * grad_bytes, o * optim_bytes


def activation_bytes_per_layer(s, b, h, a, t=1, sp=False, recompute="none", act=2, mask=1, probs=2):
    """Bytes one layer saves for backward for one micro-batch (dropout > 0), by Korthikanti et al.'s
    count (2022, Table 2), with the bytes per element as arguments:
    act   activations (2 in bf16): 16 tensors' worth of sbh -- 4 replicated by TP unless SP shards
          them (the 2 LayerNorm inputs, the inputs of qkv and fc), 12 split by TP (q, k, v, the
          projection's input, the 4h GeLU input and fc2 input)
    mask  each of the 2 + 1 dropout masks (1 as a CUDA bool mask; CPU torch keeps a mask in `act`
          bytes); the 2 sbh ones are replicated like the block inputs
    probs the softmax output (2 with Megatron's fused softmax; model.causal_softmax keeps it in
    fp32: 4) The attention core adds (probs + mask + act) a s^2 b, split by TP: the softmax
    output, its mask, its dropped output. With the paper's (2, 1, 2): sbh(10 + 24/t + 5as/(ht)),
    SP sbh(34 + 5as/h)/t."""
    sbh = s * b * h
    if recompute == "full":
        return act * sbh  # only the layer input (the paper's Table 2 counts it unsharded)

    replicated = 4 * act + 2 * mask  # in units of sbh: 10 with the paper's bytes
    split = 12 * act  # 24
    attn = 0 if recompute == "selective" else (probs + mask + act) * a * s / h  # 5as/h
    if sp:
        return sbh * (replicated + split + attn) / t
    return sbh * (replicated + split / t + attn / t)


def llama_activation_bytes_per_layer(
    s,
    b,
    h,
    a,
    n_kv,
    f,
    t=1,
    sp=False,
    recompute="none",
    attention="sdpa",
    act=2,
    norm=2,
    swiglu=3,
    scores=2,
    mask=0,
):
    """Bytes one Llama block (model.py, arch="llama": no dropout) saves for backward for one
    micro-batch, per TP rank: Korthikanti's count redone for RMSNorm, rotary, grouped-query
    attention and SwiGLU, tensor by tensor as autograd keeps them (tests/test_plan.py holds it equal
    to recompute.saved_bytes_per_layer, eager and sdpa, fp32 and bf16). Per rank: q width h/t, k and
    v width kv = (h/a) max(1, n_kv/t) each (tp.py splits the key/value heads, or gives each rank its
    one group when t > n_kv), MLP width f/t. replicated (SP shards them): each RMSNorm keeps `norm`
    bytes per element besides its output, which is the
          input the next matmuls keep (act): 2 (norm + act) sbh; and its fp32 1/rms per row: 2 x 4
          sb. norm: a fused kernel keeps its input (act, the default); modern.rms_norm keeps the
          fp32 input and the normalized x before the scale (4 + act)
    attention, split by TP: q and the core's output (the o projection's input) h/t each; k after
          rotary and the kv_proj output that v is a view of, 3 kv (t > n_kv: also the 2 (h/a) h rows
          of the whole k/v weight that tp.GroupKeyValue copies out for its group's matmul). "sdpa"
          (FlashAttention) adds its fp32 log-sum-exp, 4 b (a/t) s, and never stores the scores.
          "eager" keeps k and v as QK^T and AV read them, (b a/t, s, h/a) copies (repeated to the
          query heads when grouped, made contiguous from the strided kv_proj view otherwise): 2 h/t
          instead of 3 kv (one head per rank: views, 3 kv); and `scores` bytes per (b, a/t, s, s)
          element (2: Megatron's fused softmax; model.causal_softmax keeps its fp32 output and, in
          16 bits, the cast AV reads: 4 + act) and `mask` per (s, s) causal mask element
          (model.causal_softmax's bool mask: 1; a fused kernel masks in place: 0)
    MLP, split by TP: `swiglu` tensors of width f/t: the gate|up output (2), silu(gate) and the
          product that the down projection keeps: 4 for modern.swiglu; 3 when a fused kernel
          recomputes silu in backward (Megatron's bias_swiglu, the default)
    selective recompute keeps the core's inputs and output (the sdpa count less its log-sum-exp);
    full keeps the block input, act sbh (sbh/t with SP: the residual stream is sharded). The rotary
    cos/sin tables are one storage shared by every layer, not counted here. With the defaults and
    TP: sbh(8 + (4 + 6 n_kv/a + 6f/h)/t) + 8sb + 4abs/t; with SP all of it /t."""
    sbh, sb = s * b * h, s * b
    rows = t if sp else 1  # SP shards the sequence of what TP replicates
    if recompute == "full":
        return act * sbh / rows

    q, kv = h / t, (h // a) * max(1, n_kv // t)
    replicated = (2 * (norm + act) * sbh + 2 * 4 * sb) / rows

    core = act * sb * (2 * q + 3 * kv)  # q, output; k and the kv_proj output (v)
    # k/v held whole: the rank's group of rows is sliced out (a copy) and kept by its matmul
    if n_kv % t:
        core += act * 2 * (h // a) * h
    if recompute == "none" and attention == "sdpa":
        core += 4 * b * (a // t) * s  # the log-sum-exp per query row and head
    elif recompute == "none":
        # eager: the (b a/t, s, h/a) copies of k and v the matmuls keep, and the scores
        core += (
            act * sb * (2 * q - 3 * kv if a // t > 1 else 0)
            + scores * b * (a // t) * s * s
            + mask * s * s
        )

    return replicated + core + swiglu * act * sb * f / t


def inflight_microbatches(p, m, schedule="1f1b", v=1):
    """Micro-batches whose activations stage 0 holds at its peak, in units of one stage's L/p
    layers: GPipe all m, 1F1B p (its warm-up), interleaved p + (p-1)/v, i.e. Korthikanti's L(1 +
    (p-1)/(pv)) layers; ZB-H1 p, ZB-H2 2p - 1 (Qi et al. 2024, Table 1), ZB-V 2p half-size chunks,
    i.e. p (its fullest rank: min(2p, 2m, m + p) chunks, tests/test_zb_v.py); DualPipeV 2p + 1 chunks
    (its m >= 2p; DeepSeek's DualPipe repository, PP + 1 with PP = 2p stages)."""
    if p == 1:
        return 1  # plain gradient accumulation: one micro-batch at a time
    return {
        "gpipe": m,
        "1f1b": min(p, m),
        "interleaved": p + (p - 1) / v,
        "zb-h1": min(p, m),
        "zb-h2": min(2 * p - 1, m),
        "zb-v": min(2 * p, 2 * m, m + p) / 2,
        "dualpipev": (2 * p + 1) / 2,
    }[schedule]


def rank_inflight(p, rank, m, schedule="1f1b", v=1):
    """Micro-batches whose activations pipeline rank `rank` holds at its peak (units of one stage's
    layers): the planner's per-stage rows. The loop schedules' warm-up shrinks down the pipeline
    (1F1B min(p - rank, m)); ZB-H1 and ZB-H2 hold their peak on every rank (the W's lag makes up
    the shorter warm-up); on the V a rank holds both ends of the pipeline: ZB-V min(2p, 2m,
    m + 1 + rank) chunks, DualPipeV 2p + 1 (tests/test_zero_bubble.py: the simulator's peaks)."""
    if p == 1 or schedule in ("zb-h1", "zb-h2", "dualpipev"):
        return inflight_microbatches(p, m, schedule, v)
    if schedule == "zb-v":
        return min(2 * p, 2 * m, m + 1 + rank) / 2
    return inflight_microbatches(p - rank, m, schedule, v)


def offload_seconds(n, grad_bytes, param_bytes, pcie_bw, host_bw, adam_bytes=28):
    """ZeRO-Offload's step on one GPU with n optimizer elements in host memory (offload.py):
    gradients down and weights up over PCIe, n (g + p) bytes, and the CPU Adam's one pass through
    host memory, n x 28 bytes (cpu_adam.py), + p bytes when the model is not fp32 (the pass also
    writes the weights rounded for the upload). offload.py pipelines them group by group, so the
    slower of the two sets the time."""
    host = adam_bytes + (param_bytes if param_bytes < 4 else 0)
    return max(n * (grad_bytes + param_bytes) / pcie_bw, n * host / host_bw)


# ---- communication (bytes one rank sends per step; a ring receives as much as it sends) ----------
def dp_comm_bytes(n_params, stage, dp, dtype_bytes, param_bytes=None, micro_batches=1):
    """Stage 0: all-reduce the gradients once. 1: reduce-scatter them, all-gather the updated
    parameters. 2: as 1, but the reduce-scatter runs every micro-batch (no full gradient is kept to
    accumulate into). 3: also all-gather the parameters for forward and again for backward of every
    micro-batch. dtype_bytes: gradient elements on the wire; param_bytes: parameter elements
    (default the same)."""
    param_bytes = dtype_bytes if param_bytes is None else param_bytes
    f = (dp - 1) / dp * n_params
    if stage == 0:
        return 2 * f * dtype_bytes
    grads = f * dtype_bytes * (micro_batches if stage >= 2 else 1)
    return grads + f * param_bytes * (2 * micro_batches if stage == 3 else 1)


def hybrid_comm_bytes(n_params, stage, shard, replicate, dtype_bytes, param_bytes=None, m=1):
    """Hybrid sharding (HSDP, ZeRO-1/2/3 over S = shard ranks inside a host, R = replicate copies
    across hosts): (inside, across) bytes one rank sends per step. Inside: ZeRO's over S
    (dp_comm_bytes); across: one all-reduce of the reduced gradient slice, 2 (R-1)/R Psi/S, once
    per step whatever the stage and the micro-batches m. Plain ZeRO over S R ranks would send
    dp_comm_bytes(n, stage, S R, ...) through the slowest link."""
    inside = dp_comm_bytes(n_params, stage, shard, dtype_bytes, param_bytes, m)
    return inside, 2 * (replicate - 1) / replicate * n_params / shard * dtype_bytes


def quant_block(k, block=2048):
    """The block length of a blockwise quantizer for rows of k elements: `block`, or k itself when
    shorter (made even: int4 packs pairs). zeropp.quantize's rule."""
    return min(block, k + k % 2)


def quantized_bytes(k, bits, block=2048):
    """Bytes of one row of k elements quantized in blocks: whole blocks of `bits`-bit codes and
    one fp32 scale per block."""
    b = quant_block(k, block)
    blocks = -(-k // b)
    return blocks * b * bits // 8 + 4 * blocks


def zeropp_comm_bytes(sizes, shard, replicate, param_bytes, qwz=0, hpz=False, qgz=0, m=1, **kw):
    """ZeRO-3 with ZeRO++ over N = S R ranks (S per host, R hosts): (inside, across) bytes one rank
    sends per step, each unit's group of P padded elements (sizes: every trainable group's P; c =
    P / N) gathered twice and its fp32 gradient reduced once per micro-batch (m). An axis spanning
    hosts counts as across (the slow link paces its ring). kw: block (the quantizer's).
        forward gather   (N-1)/N P B_param    qwZ: (N-1) quantized_bytes(c, qwz)
        backward gather  as the forward       hpZ: (S-1)/S P B_param, inside
        reduce-scatter   (N-1)/N P 4          qgZ: (S-1) quantized_bytes(R c, qgz) inside,
                                                   (R-1) quantized_bytes(c, qgz) across"""
    n = shard * replicate
    inside = across = 0.0
    for P in sizes:
        c, f = P // n, (n - 1) / n
        gather = (n - 1) * quantized_bytes(c, qwz, **kw) if qwz else f * P * param_bytes
        across += m * gather
        if hpz:
            inside += m * (shard - 1) / shard * P * param_bytes
        else:
            across += m * gather
        if qgz:
            inside += m * (shard - 1) * quantized_bytes(replicate * c, qgz, **kw)
            across += m * (replicate - 1) * quantized_bytes(c, qgz, **kw)
        else:
            across += m * f * P * 4
    return inside, across


def tp_comm_bytes_per_layer(
    b, s, h, t, dtype_bytes=2, sequence_parallel=False, recompute="none", inputs=2
):
    """Per layer and micro-batch: attention and MLP each end in an all-reduce of (b, s, h) in
    forward, and each column-parallel layer's input gradient is all-reduced in backward: GPT-2
    (inputs = 2: qkv, fc) 8 (t-1)/t bsh. SP replaces each by a reduce-scatter plus an all-gather
    (the same bytes) and re-gathers each stored (b, s/t, h) input shard in backward for the weight
    gradient: 10 (t-1)/t bsh, as lesson 06 measures (the replicated gradients it also all-reduces,
    6h floats, are left out). Llama (inputs = 3): q_proj and kv_proj each gather (or all-reduce the
    gradient of) the same input: 10, SP 13. Full recompute reruns the forward's collectives: 4
    (t-1)/t bsh more (SP: inputs + 2)."""
    ring = (t - 1) / t * b * s * h * dtype_bytes
    # gather each input, scatter each output; backward: their conjugates + the re-gathers
    if sequence_parallel:
        forward, backward = (inputs + 2) * ring, (2 * inputs + 2) * ring
    else:  # all-reduce each output forward, each input's gradient backward
        forward, backward = 4 * ring, 2 * inputs * ring
    return forward + backward + (forward if recompute == "full" else 0)


def cp_comm_bytes_per_layer(method, c, b, s, hd, heads, kv_heads, dtype_bytes=2, grad_bytes=4):
    """(forward, backward) bytes one rank puts on the wire in one layer's attention under context
    parallelism over c ranks (cp.py), s the whole sequence, heads/kv_heads this rank's (after tp).
    B_kv = b (s/c) n_kv hd:
    ring       K and V sent c-1 times forward; backward K/V again and their gradients c times (home
    included)
    allgather  all-gather of K and V ((c-1)/c of c shards); backward the gather again + a
    reduce-scatter of dK/dV
    ulysses    all-to-all (c-1)/c of q, k, v and the output forward; the conjugates backward
    K, V, q and the output travel in dtype_bytes (the model's); dK/dV of ring and allgather in
    grad_bytes (fp32: cp.py accumulates them in fp32 whatever the model dtype: a bf16 partial sum
    would round at every hop)."""
    if c == 1:
        return 0, 0

    kv = 2 * b * (s // c) * kv_heads * hd  # K and V of this rank's tokens, elements
    if method == "ring":
        return (c - 1) * kv * dtype_bytes, (c - 1) * kv * dtype_bytes + c * kv * grad_bytes
    if method == "allgather":
        return (c - 1) * kv * dtype_bytes, (c - 1) * kv * (dtype_bytes + grad_bytes)

    # ulysses: q, k, v and the output through all-to-all, (c-1)/c of each
    q = b * (s // c) * heads * hd
    moved = (c - 1) * (2 * q + kv) * dtype_bytes // c
    return moved, moved


def pp_comm_bytes(b, s, h, t, dtype_bytes, micro_batches, v=1):
    """Activation forward, its gradient backward, per micro-batch and model chunk; each TP rank
    sends its 1/t slice (SP shards it anyway; without SP, Megatron's scatter/gather optimisation,
    Narayanan et al. 2021)."""
    return 2 * v * micro_batches * b * s * h * dtype_bytes / t


# ---- time ----------------------------------------------------------------------------------------
def collective_seconds(op, n, nbytes, alpha, beta, algo="ring"):
    """The alpha-beta model of one collective over n ranks, nbytes per rank: alpha seconds per
    message step (latency), beta seconds per byte on a link (1 / bandwidth). ring: all_reduce =
    reduce-scatter + all-gather, 2(n-1) steps of nbytes/n each; all_gather / reduce_scatter (n-1)
    steps of nbytes/n. tree (binary, not pipelined): all_reduce = reduce then broadcast, 2 log2(n)
    steps of the whole nbytes -- fewer steps, more bytes: the tree wins for small messages, the ring
    for large ones. NCCL pipelines its (double binary) trees, which brings their bandwidth term
    close to the ring's; this is the textbook version (lesson 03)."""
    if n == 1:
        return 0.0
    if algo == "tree":
        steps = math.ceil(math.log2(n)) * (2 if op == "all_reduce" else 1)
        return steps * (alpha + nbytes * beta)
    steps = (2 if op == "all_reduce" else 1) * (n - 1)
    return steps * (alpha + nbytes / n * beta)


def pipeline_bubble(p, m, v=1):
    """Idle fraction of the step: each stage waits p-1 slots out of v*m + p-1 (a slot = one
    micro-batch's forward + backward of one chunk; interleaving shrinks the slots by v).
    Time = ideal * (1 + (p-1)/(v m)). The zero-bubble schedules' ramps are a fraction of a slot at
    T_F = T_B = T_W: v = RAMP_SLOTS[schedule] gives their bubble."""
    return (p - 1) / (v * m + p - 1)


ZB_H1_SLOTS = 3  # ZB-H1's ramp: (T_F + T_B - T_W) / (T_F + T_B + T_W) = 1/3 slot at equal times
# slots per ramp step of the split schedules at T_F = T_B = T_W, the step synchronized (default):
# ZB-H1 (p-1)(T_F + T_B - T_W) (Qi et al. 2024, Table 1); ZB-H2 (p-1) max(T_F, T_F + T_B - 2 T_W)
# (ours: its ranks start T_F apart, the paper's (p-1)(T_F + T_B - 2 T_W) is each rank's own span);
# ZB-V (p-1) chunk ops of a sixth of a slot (ours, m >= 2p - 1: tests/test_zb_v.py); DualPipeV
# (PP/2 - 1)(F&B + B - 3W), PP = 2p, B a chunk's full backward (the DualPipe repository's table):
# with nothing overlapped (F&B = F + B + W, what the planner prices) 2(p-1) chunk ops, a third of a slot
RAMP_SLOTS = {"zb-h1": ZB_H1_SLOTS, "zb-h2": 3, "zb-v": 6, "dualpipev": 3}


def ramp_slots(schedule, v=1, post_validated=False):
    """pipeline_bubble's v for a schedule: RAMP_SLOTS's, or v. ZB-H2 with the step post-validated
    (--post-validate, post_validate.py): the paper's (p-1)(T_F + T_B - 2 T_W), zero at equal times
    (tests/test_post_validate.py: the simulator's chained steps)."""
    if schedule == "zb-h2" and post_validated:
        return float("inf")
    return RAMP_SLOTS.get(schedule, v)


def flops_per_token(n_params, n_layer, h, s, recompute="none", head_params=0):
    """6N (forward 2N, backward 4N) + 12*L*h*s for QK^T and AV, counted without causal halving
    (PaLM, nanoGPT). Recompute adds forward work that MFU does not credit: full one forward of the
    blocks (2(N - head) + 4Lhs: the LM head is outside the recomputed blocks, as in Megatron's eq.
    3), selective QK^T and AV (4Lhs)."""
    extra = {
        "none": 0,
        "selective": 4 * n_layer * h * s,
        "full": 2 * (n_params - head_params) + 4 * n_layer * h * s,
    }[recompute]
    return 6 * n_params + 12 * n_layer * h * s + extra


def implied_mfu(total_flops, days, gpus, peak_flops):
    """Model FLOPs utilisation a reported run implies: useful FLOPs / (wall time * GPUs * peak)."""
    return total_flops / (days * 86400 * gpus * peak_flops)


def model_flops_per_token(cfg, seq_len=None):
    """Training FLOPs per token of a gpt_config.GPTConfig: flops_per_token's 6 N' + 12 L h s
    (PaLM appendix B; nanoGPT's estimate_mfu) with N' counted from the config.

    N' counts every parameter that takes part in a matmul: blocks, and the (tied) vocab matrix once,
    since the LM head multiplies by it (an untied Llama head: its own matrix, and the embedding, a
    lookup, is left out like the position embeddings). LayerNorm and bias parameters are included,
    as in the 6N rule (they are a ~1e-3 correction).
    """
    L, h, s = cfg.n_layer, cfg.n_embd, seq_len or cfg.block_size
    if cfg.arch == "llama":  # the head's V x h matrix (tied or not) and the final RMSNorm's h
        per_layer = (
            llama_layer_params(h, cfg.ffn, cfg.n_head, cfg.kv_heads)
            if not cfg.n_experts
            else moe_layer_params(
                h,
                cfg.ffn,
                cfg.n_head,
                cfg.kv_heads,
                cfg.n_experts,
                cfg.top_k,
                cfg.shared_experts,
                gate=cfg.shared_expert_gate,
            )[1]
        )
        # DeepSeek-V3's first_k_dense blocks: a dense SwiGLU of dense_ffn instead of the experts
        k = cfg.first_k_dense if cfg.n_experts else 0
        dense = llama_layer_params(h, cfg.dense_ffn, cfg.n_head, cfg.kv_heads) if k else 0
        n = (L - k) * per_layer + k * dense + L * mla_layer_delta(cfg)
        n += cfg.padded_vocab_size * h + h
        # MTP's D modules: a layer each (and its core) and one more pass through the head
        mtp, D = (
            mtp_params(cfg) + cfg.mtp_num_layers * cfg.padded_vocab_size * h,
            cfg.mtp_num_layers,
        )
        # the core's QK^T and AV: 12 L h s with h = a d_h; MLA's heads: 6 L s a (d_n + d_r + d_v)
        core = cfg.n_head * sum(cfg.mla_dims) / 2 if cfg.kv_lora_rank else h
        return flops_per_token(n + mtp, L + D, core, s)
    per_layer = layer_params(h)  # qkv 3h^2+3h, proj h^2+h, fc 4h^2+4h, proj 4h^2+h, 2 LN 4h
    n = L * per_layer + cfg.padded_vocab_size * h + 2 * h + (2 * h if cfg.embed_layernorm else 0)
    return flops_per_token(n, L, h, s)


def chinchilla_optimal(compute, tokens_per_param=20.0):
    """Compute-optimal parameters and tokens for a budget of `compute` FLOPs, from C = 6 N D and
    D = k N (Hoffmann et al. 2022: k ~ 20 tokens per parameter): N = sqrt(C / 6k), D = k N
    (lesson 22)."""
    n = math.sqrt(compute / (6 * tokens_per_param))
    return n, tokens_per_param * n
