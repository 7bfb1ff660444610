"""How long one layout's step takes, and one layout's whole estimate (memory: tools/cost.py).

Idea: one micro-batch through the slowest pipeline stage plus its sends, times (m + (p-1)/v) slots,
plus the data-parallel seconds not hidden behind compute (tools/overlap.py; Run.overlap "none": all
of them, as Megatron-LM 2021); one set of constants (TIME) fitted on the calibration rows of
tools/published.py. evaluate adds tools/cost.py's memory: one layout's Estimate.
    layer = matmul FLOPs / (peak x MATMUL) + tp bytes / NVLink
            + (ELEM x bsh [/t with SP] + SCORE x b(a/t)s^2) / HBM bandwidth
    step  = (m + (p-1)/v) x (slowest stage + its sends / link) + exposed dp seconds [+ offload]
    MFU   = tokens x (6N + 12Lhs) / (step x GPUs x datasheet peak)
matmul FLOPs: Llama q, o 2h^2, k, v 2h^2 n_kv/a, SwiGLU 3hf; GPT-2 12h^2; Run.fp8: these at the
GPU's datasheet FP8 peak, the same fraction MATMUL of it (assumed: no FP8 row calibrates it), QK^T,
AV and the head at the bf16 peak (train.py --fp8 keeps them in --dtype). Run.attention "sdpa"
(FlashAttention): no SCORE term, but its backward recomputes QK^T (2bs^2h/t more matmul FLOPs).
TFLOP/s per GPU is reported counting recompute (Megatron's eq. 3 accounting, as papers report it).
Lesson: lessons/21-planning-a-run.md
"""

from dataclasses import dataclass

from nanomega.formulas import (
    dp_comm_bytes,
    flops_per_token,
    mla_layer_delta,
    offload_seconds,
    pipeline_bubble,
    ramp_slots,
    rank_inflight,
    pp_comm_bytes,
    tp_comm_bytes_per_layer,
)
from nanomega.schedules import placement
from nanomega.tools import overlap
from nanomega.tools.cost import (
    PRECISIONS,
    flops_params,
    layer_activation_bytes,
    layers_per_stage,
    padded_vocab,
    rank_state_bytes,
    stage_activation_bytes,
    stage_layers,
    stage_params,
)


@dataclass(frozen=True)
class TimeModel:
    """The constants of the time model, one set for every run, fitted on the calibration rows of
    tools/published.py (Megatron-LM 2021 Table 1 rows 1, 3, 5, 7, 9 and BLOOM, all A100, eager
    attention, full recompute, no overlap) and never refitted since; every other row of
    tools/published.py is out of sample (its table says which).
    The bytes are effective: what the memory-bound kernels cost, at the datasheet HBM bandwidth."""

    # fraction of peak a matmul reaches (qkv, proj, fc1, fc2, QK^T, AV, LM head); fitted on: Table
    # 1 rows 1, 3, 5, 7, 9 and BLOOM (one value for every GEMM size: see published.SMALL_GEMMS)
    matmul: float = 0.67
    # HBM bytes per (b, s, h) element and layer, forward + backward (LayerNorm, dropout, add);
    # fitted on: the same rows
    elem: float = 110.0
    # HBM bytes per (b, a, s, s) score element and layer, forward + backward (mask, softmax);
    # fitted on: the same rows (eager attention; sdpa runs have no such term)
    score: float = 40.0


TIME = TimeModel()


# ---- the cluster
# ------------------------------------------------------------------------------------------
def links(gpu, gpus, tp, pp):
    """(pp, dp) bandwidths under the trainer's rank order rank = (d*pp + p)*tp + t. A pipeline is
    tp*pp neighbouring ranks: on NVLink if that fits in a node. A dp group takes one rank per
    pipeline: inside a node if all tp*pp*dp do, else it leaves through the NICs of its k members per
    node (a ring through a node enters and leaves it once per member's NIC), k = per_node / (tp*pp)
    or 1."""
    per_node = min(gpu.per_node, gpus)
    pp_bw = gpu.intra_bw if tp * pp <= per_node else gpu.inter_bw
    dp_bw = (
        gpu.intra_bw
        if gpus <= per_node
        else min(gpu.intra_bw, max(1, per_node // (tp * pp)) * gpu.inter_bw)
    )
    return pp_bw, dp_bw


# ---- time
# ---------------------------------------------------------------------------------------------
def layer_weights(model, tp=1, layer=None):
    """Matmul weights one TP rank multiplies per token in one layer: GPT-2 12h^2/t; Llama (2h^2 +
    3hf)/t and its own key/value heads' 2h (h/a) max(1, n_kv/t) (a rank holding k/v whole computes
    one group only); f: the dense MLP's width in the first first_k_dense layers (`layer` < k); latent
    attention: its attention's count instead (formulas.mla_layer_delta)."""
    h = model.n_embd
    if model.llama:
        f = (
            model.config().dense_ffn
            if layer is not None and layer < model.first_k_dense
            else model.ffn
        )
        mla = mla_layer_delta(model.config(), tp) if model.kv_lora_rank else 0
        return (
            (2 * h * h + 3 * h * f) / tp
            + 2 * h * (h // model.n_head) * max(1, model.kv_heads // tp)
            + mla
        )
    return 12 * h * h / tp


def core_widths(model):
    """(QK^T's, AV's) widths summed over heads: h each; latent attention a (d_n + d_r), a d_v."""
    if not model.kv_lora_rank:
        return model.n_embd, model.n_embd
    d_n, d_r, d_v = model.config().mla_dims
    return model.n_head * (d_n + d_r), model.n_head * d_v


def column_inputs(model):
    """Column-parallel layers that gather (SP) or all-reduce the gradient of (TP) the block's input
    on their own: GPT-2 qkv and fc; Llama q_proj, kv_proj and gate_up (tp.py splits q and k/v
    apart)."""
    return 3 if model.llama else 2


def layer_seconds(model, gpu, run, tp, time=TIME, layer=None):
    """One layer (`layer`: its index, for the first first_k_dense; None: any other), one
    micro-batch, forward + backward (+ recompute) on one GPU (the formula in the docstring)."""
    compute, _, tp_exposed = layer_parts(model, gpu, run, tp, time, layer)
    return compute + tp_exposed


def layer_parts(model, gpu, run, tp, time=TIME, layer=None):
    """(compute seconds, tp seconds, tp seconds not hidden) of one layer and micro-batch: with
    run.tp_overlap the collectives hide behind the matmuls they feed (overlap.tp_exposed)."""
    b, s, h, a = run.micro_batch, model.seq_len, model.n_embd, model.n_head
    full, attn_again = run.recompute == "full", run.recompute in ("full", "selective")
    flash = run.attention == "sdpa"
    # forward 1, backward 2, recompute 1
    dense = 2 * b * s * layer_weights(model, tp, layer) * (3 + full)
    if run.fp8:  # the blocks' GEMMs at the FP8 peak: as fewer FLOPs at the bf16 one (same MATMUL)
        dense = dense * gpu.peak_flops / gpu.fp8_flops
    # QK^T and AV (GQA shares k/v between heads, not the products; MLA's heads are d_n + d_r and
    # d_v wide); FlashAttention's backward reruns QK^T
    qk, av = core_widths(model)
    attn = 2 * b * s * s * (qk + av) / tp * (3 + attn_again) + (
        2 * b * s * s * qk / tp if flash else 0
    )
    hbm = time.elem * b * s * h / (tp if run.sp else 1) * (1 + full / 3) + (
        0 if flash else time.score * b * a / tp * s * s * (1 + attn_again / 3)
    )
    eb = 4 if run.dtype == "fp32" else 2
    tp_b = tp_comm_bytes_per_layer(b, s, h, tp, eb, run.sp, run.recompute, column_inputs(model))
    matmul = dense / (gpu.peak_flops * time.matmul)
    tp_s = tp_b / gpu.intra_bw
    compute = (dense + attn) / (gpu.peak_flops * time.matmul) + hbm / gpu.hbm_bw
    return compute, tp_s, overlap.tp_exposed(tp_s, matmul, run.tp_overlap)


@dataclass(frozen=True)
class StepTime:
    step: float  # seconds
    bubble: float  # fraction of the pipeline time idle
    comm: float  # seconds of tp, pp and dp bytes on their links (+ offload's copies)
    exposed: float  # of which the step waits for (tools/overlap.py)


def step_time(model, gpu, gpus, tp, pp, zero, run, time=TIME, global_batch=None):
    """One step's StepTime at a global batch (default run.global_batch)."""
    batch = run.global_batch if global_batch is None else global_batch
    dp = gpus // (tp * pp)
    m = batch // (dp * run.micro_batch)
    v = run.chunks if run.schedule == "interleaved" and pp > 1 else 1
    eb = 4 if run.dtype == "fp32" else 2

    # each stage's compute per micro-batch; the last stage has the head too
    layer = layer_seconds(model, gpu, run, tp, time)
    head = 6 * run.micro_batch * model.seq_len * padded_vocab(model, tp) * model.n_embd / tp
    layers = layers_per_stage(model, pp, v, run.split)
    stages = [n * layer for n in layers]
    if model.first_k_dense:  # DeepSeek-V3's first k blocks: a dense MLP of their own width
        dense = layer_seconds(model, gpu, run, tp, time, 0) - layer
        held = stage_layers(model, pp, v, run.split)
        stages = [
            t + dense * sum(i < model.first_k_dense for i in ids) for t, ids in zip(stages, held)
        ]
    # logits forward + 2 backward GEMMs, never recomputed
    stages[-1] += head / (gpu.peak_flops * time.matmul)
    # MTP's D modules on the last stage (mtp.py): a layer, the 2h -> h projection (whole on every
    # tp rank) and one more pass through the head each
    eh = 6 * run.micro_batch * model.seq_len * 2 * model.n_embd**2
    stages[-1] += model.mtp_num_layers * (layer + (head + eh) / (gpu.peak_flops * time.matmul))

    pp_bw, dp_bw = links(gpu, gpus, tp, pp)
    sent_v = 2 if placement(run.schedule) == "v" else v
    sends = (
        # (on the V, ZB-V and DualPipeV: two chunks per rank, each sends; the turn's pair stays on its rank)
        pp_comm_bytes(run.micro_batch, model.seq_len, model.n_embd, tp, eb, 1, sent_v)
        if pp > 1
        else 0
    )
    slot = max(stages) + sends / pp_bw
    # the ramp: p - 1 slots of one chunk; the split schedules' W fill most of each (formulas.py)
    ramp_v = ramp_slots(run.schedule, v, run.post_validate)
    pipe = (m + (pp - 1) / ramp_v) * slot

    # dp's gradient (and ZeRO-3's parameter) bytes, what of them hides behind compute (overlap.py)
    n = max(stage_params(model, tp, pp, v, run.split))
    pb, gb = PRECISIONS[run.dtype][:2]
    units = max(layers) + 1
    dp_t = overlap.dp_seconds(
        n, zero, dp, m, gb, pb, dp_bw, max(stages), run.recompute, units, run.overlap
    )
    # the host's copies and step (offload)
    host = (
        offload_seconds(
            run.offload * (-(-n // dp) if zero else n),
            *PRECISIONS[run.dtype][1::-1],
            gpu.pcie_bw,
            gpu.host_bw,
        )
        if run.offload
        else 0.0
    )

    # tp's collectives (those not hidden by run.tp_overlap) and pp's sends wait inside the slots
    _, tp_s, tp_exposed = layer_parts(model, gpu, run, tp, time)
    waits = m * sends / pp_bw + host
    tp_total, tp_waits = m * max(layers) * tp_s, m * max(layers) * tp_exposed
    return StepTime(
        pipe + dp_t.exposed + host,
        pipeline_bubble(pp, m, ramp_v),
        waits + tp_total + dp_t.total,
        waits + tp_waits + dp_t.exposed,
    )


def step_seconds(model, gpu, gpus, tp, pp, zero, run, time=TIME, global_batch=None):
    """(step seconds, bubble fraction) at a global batch (default run.global_batch)."""
    t = step_time(model, gpu, gpus, tp, pp, zero, run, time, global_batch)
    return t.step, t.bubble


def train_seconds(step_at, run, seq_len):
    """Seconds for run.tokens tokens. Ramp-up as Megatron's --rampup-batch-size START INC SAMPLES:
    the batch grows START, START+INC, ... each for SAMPLES / ((B - START) / INC) samples, then stays
    at B."""
    total, done, seconds = run.tokens / seq_len, 0.0, 0.0
    if run.rampup:
        start, inc, samples = run.rampup
        steps = (run.global_batch - start) // inc
        for i in range(steps):
            n = min(samples / steps, total - done)
            seconds += n / (start + i * inc) * step_at(start + i * inc)
            done += n
    return seconds + max(0.0, total - done) / run.global_batch * step_at(run.global_batch)


# ---- one layout's estimate
# --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Estimate:
    tp: int
    pp: int
    dp: int
    zero: int
    micro_batches: int
    layers: tuple  # per pipeline rank
    params: float  # bytes per GPU (the heaviest pipeline stage)
    grads: float
    optim: float
    acts: float
    tp_comm: float  # bytes per GPU per step
    pp_comm: float
    dp_comm: float
    step_s: float
    bubble: float  # fraction of the pipeline time idle
    tflops: float  # per GPU, counting recompute (hardware FLOP/s, as papers report)
    mfu: float  # model FLOPs (6N + 12Lhs) / datasheet peak
    days: float  # run.tokens, with the batch ramp-up
    fits: bool
    comm_s: float = 0.0  # seconds of communication per step (StepTime.comm)
    exposed_s: float = 0.0  # of which not hidden behind compute (StepTime.exposed)

    @property
    def memory(self):
        return self.params + self.grads + self.optim + self.acts


def evaluate(model, gpu, gpus, tp, pp, zero, run, time=TIME):
    """Memory, bytes, step time, FLOP/s, MFU and days of one layout."""
    L, h, s, b = model.n_layer, model.n_embd, model.seq_len, run.micro_batch
    dp = gpus // (tp * pp)
    m = run.global_batch // (dp * b)
    v = run.chunks if run.schedule == "interleaved" and pp > 1 else 1
    pb, gb, eb = *PRECISIONS[run.dtype][:2], 4 if run.dtype == "fp32" else 2

    # memory: the fullest stage's state and held activations
    layers = layers_per_stage(model, pp, v, run.split)
    acts = stage_activation_bytes(model, run, tp, pp, v, run.split)
    # full recompute rebuilds one layer's whole activations in backward: the working set on top of
    # the inputs
    work = layer_activation_bytes(model, run, tp, "none") if run.recompute == "full" else 0
    stages = []
    for k, (p_, g_, o_) in enumerate(
        rank_state_bytes(model, tp, pp, dp, zero, run.dtype, v, run.split)
    ):
        state = (p_, g_, o_ * (1 - run.offload))  # the offloaded share lives in host memory
        held = acts[k] * rank_inflight(pp, k, m, run.schedule, v) + work
        stages.append((sum(state) + held, state, held))
    _, (params, grads, optim), acts = max(stages, key=lambda x: x[0])

    # bytes on the tp, pp and dp links
    tp_b = (
        m
        * max(layers)
        * tp_comm_bytes_per_layer(b, s, h, tp, eb, run.sp, run.recompute, column_inputs(model))
    )
    pp_b = (
        pp_comm_bytes(b, s, h, tp, eb, m, 2 if placement(run.schedule) == "v" else v)
        if pp > 1
        else 0
    )
    dp_b = dp_comm_bytes(max(stage_params(model, tp, pp, v, run.split)), zero, dp, gb, pb, m)

    # time, FLOP/s, MFU
    t = step_time(model, gpu, gpus, tp, pp, zero, run, time)
    step, bubble = t.step, t.bubble
    tokens = run.global_batch * s
    n = flops_params(model)
    head = padded_vocab(model) * h
    tflops = tokens * flops_per_token(n, L, h, s, run.recompute, head) / (step * gpus)
    mfu = tokens * flops_per_token(n, L, h, s) / (step * gpus * gpu.peak_flops)
    days = (
        train_seconds(
            lambda batch: step_seconds(model, gpu, gpus, tp, pp, zero, run, time, batch)[0], run, s
        )
        / 86400
    )

    fits = params + grads + optim + acts <= run.usable * gpu.memory
    return Estimate(
        tp,
        pp,
        dp,
        zero,
        m,
        tuple(layers),
        params,
        grads,
        optim,
        acts,
        tp_b,
        pp_b,
        dp_b,
        step,
        bubble,
        tflops,
        mfu,
        days,
        fits,
        t.comm,
        t.exposed,
    )
