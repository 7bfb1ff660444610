"""What one layout costs on one cluster: memory per GPU, bytes per step, step time, FLOP/s and days.

Puts the closed forms of formulas.py together for a model shape, a GPU and a tp x pp x dp x ZeRO
layout (the trainer's: pp.stage_layers, dist.Grid's rank order). It is a model, not a measurement;
tools/plan.py searches the layouts with it and is the command line. Memory is the heaviest stage's
(fits if <= usable (0.9) x GPU memory); time is paced by the slowest stage, with no overlap (as
Megatron-LM 2021). Blocks: GPT-2, Llama, Llama + experts (cost_moe.py).

Formulas (one set of constants, TIME, fitted on published runs):
    step       (one micro-batch through the slowest stage + its pipeline sends)
               x (m + (p-1)/v) slots + dp bytes / link
    a layer    matmul FLOPs / (peak x MATMUL)
               + (ELEM bytes x bsh [/t with SP] + SCORE bytes x b(a/t)s^2) / HBM bandwidth
               + tp bytes / NVLink
               matmul FLOPs: Llama q, o 2h^2, k, v 2h^2 n_kv/a, SwiGLU 3hf; GPT-2 12h^2;
               Run.attention "sdpa" (FlashAttention): no SCORE term, but its backward recomputes
               QK^T (2bs^2h/t more matmul FLOPs)
    report     TFLOP/s per GPU counting recompute (Megatron's eq. 3 accounting, as papers report
               it);
               MFU = tokens x (6N + 12Lhs) / (step x GPUs x datasheet peak); days with the ramp-up
Lesson: lessons/11-planning-a-run.md
"""
from dataclasses import dataclass

from nanomega.formulas import (activation_bytes_per_layer, dp_comm_bytes, flops_per_token,
                               inflight_microbatches, layer_params, llama_activation_bytes_per_layer,
                               llama_layer_params, moe_layer_params, offload_seconds, pipeline_bubble, pp_comm_bytes,
                               tp_comm_bytes_per_layer, zero_state_bytes)
from nanomega.model import SHAPE_KEYS, GPTConfig
from nanomega.ops.presets import PRESETS
from nanomega.pp import chunk_layers


@dataclass(frozen=True)
class Model:
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int
    seq_len: int
    alibi: bool = False  # BLOOM: no position embedding table
    embed_layernorm: bool = False  # BLOOM: LayerNorm after the embedding
    # llama: RMSNorm, SwiGLU (ffn_hidden), rotary positions, grouped-query (n_kv_head)
    arch: str = "gpt2"
    n_kv_head: int = 0
    ffn_hidden: int = 0
    rope_theta: float = 10000.0
    rope_scaling: float = 1.0
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    # mixture of experts (llama): E SwiGLU experts of width ffn per block, top_k per token,
    n_experts: int = 0
    # and shared ones every token runs through (tools/cost_moe.py: active parameters, ep,
    # all-to-all)
    top_k: int = 2
    shared_experts: int = 0

    @classmethod
    def from_shape(cls, shape):
        """A preset ({model.SHAPE_KEYS: value}) as a Model: GPTConfig's block_size is the
        planner's seq_len."""
        return cls(**{"seq_len" if k == "block_size" else k: shape[k] for k in SHAPE_KEYS})

    @property
    def llama(self):
        return self.arch == "llama"

    def config(self):
        """This shape as a model.GPTConfig: the one home of its derived sizes (kv_heads, ffn)."""
        return GPTConfig(**{k: getattr(self, "seq_len" if k == "block_size" else k) for k in SHAPE_KEYS})

    @property
    def kv_heads(self):
        return self.config().kv_heads

    @property
    def ffn(self):  # the MLP width f
        return self.config().ffn


MODELS = {name: Model.from_shape(shape) for name, shape in PRESETS.items()}


@dataclass(frozen=True)
class GPU:
    peak_flops: float  # dense bf16 FLOP/s (datasheet)
    memory: float  # bytes
    hbm_bw: float  # bytes/s of device memory
    intra_bw: float  # bytes/s one GPU sends inside a node (NVLink, one direction)
    inter_bw: float  # bytes/s one GPU sends to other nodes (its share of the node's NICs)
    per_node: int = 8
    pcie_bw: float = 25e9  # bytes/s between host and GPU, one direction (ZeRO-Offload's copies)
    host_bw: float = 51e9  # bytes/s of host memory, one GPU's share (ZeRO-Offload's CPU Adam)


# NVIDIA datasheets; DGX A100: 8x 200 Gb/s HDR InfiniBand, DGX H100: 8x 400 Gb/s
# NDR, one NIC per GPU;
GPUS = {
    # host: PCIe 4 / 5 x16 (32 / 64 GB/s, ~80% reached), 2 sockets x 8 DDR4-3200 / DDR5-4800
    # channels over 8 GPUs
    # NVLink 3: 600 GB/s both directions
    "a100-80gb": GPU(312e12, 80 * 2**30, 2039e9, 300e9, 25e9, 8, 25e9, 51e9),
    # H100 SXM, NVLink 4: 900 GB/s both
    "h100-80gb": GPU(989e12, 80 * 2**30, 3350e9, 450e9, 50e9, 8, 50e9, 77e9),
}
# bytes/param (params, grads, optimizer) as the engine allocates them: gradients reduced in fp32
# whatever the model's dtype (Megatron's main_grad), fp32 masters + Adam m, v for 16-bit models, m
# and v alone for fp32
PRECISIONS = {"bf16": (2, 4, 12), "fp16": (2, 4, 12), "fp32": (4, 4, 8)}


@dataclass(frozen=True)
class TimeModel:
    """The constants of the time model, one set for every run, fitted on the calibration rows of
    lessons/11_plan.py (Megatron-LM 2021 Table 1 rows 1, 3, 5, 7, 9 and BLOOM) and checked on the
    others (rows 2, 4, 6, 8, 10). The bytes are effective: what the memory-bound kernels cost, at
    the datasheet HBM bandwidth."""
    # fraction of peak a matmul reaches (qkv, proj, fc1, fc2, QK^T, AV, LM head)
    matmul: float = 0.67
    # HBM bytes per (b, s, h) element and layer, forward + backward (LayerNorm, dropout, add)
    elem: float = 110.0
    # HBM bytes per (b, a, s, s) score element and layer, forward + backward (mask, softmax)
    score: float = 40.0


TIME = TimeModel()


@dataclass(frozen=True)
class Run:
    global_batch: int = 512  # sequences per optimizer step
    micro_batch: int = 1
    dtype: str = "bf16"
    recompute: str = "selective"  # none | selective | full
    sp: bool = True  # sequence parallelism with TP
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved
    chunks: int = 2  # model chunks per stage for the interleaved schedule
    zero: tuple = (0, 1, 2, 3)  # ZeRO stages to consider
    # fraction of GPU memory we plan to fill (CUDA context, NCCL buffers, fragmentation)
    usable: float = 0.9
    tokens: float = 300e9  # training budget for the days column
    rampup: tuple = None  # Megatron's --rampup-batch-size START INCREMENT SAMPLES
    # eager: an explicit softmax over scores in HBM (Megatron 2021, BLOOM: the runs TIME was fitted
    # on); sdpa: FlashAttention (train.py's default --attention on a GPU), the scores stay on chip
    attention: str = "eager"
    split: str = "trainer"  # layers per stage: the trainer's, or "llama3" (layers_per_stage)
    # ZeRO-Offload: the share of the optimizer state in host memory (offload.py)
    offload: float = 0.0


# ---- model shapes --------------------------------------------------------------------------------
def padded_vocab(model, tp=1):
    return -(-model.vocab_size // (128 * tp)) * 128 * tp


def layers_per_stage(model, pp, v=1, split="trainer"):
    """Layers each pipeline rank holds, summed over its v chunks: the trainer's split
    (pp.chunk_layers), or "llama3": the embedding and the head take a layer's slot each, L + 2 slots
    split by the same rule, so the first and last ranks hold a layer less (Llama 3 405B: 128 slots
    on 16 ranks x 8 chunks; the first chunk holds only the embedding, the last only the head)."""
    if split not in ("trainer", "llama3"):
        raise ValueError(f"split {split!r} is not one of trainer, llama3")
    if split == "llama3":
        L = model.n_layer
        slots = [[chunk_layers(L + 2, pp, k, c, v) for c in range(v)] for k in range(pp)]
        return [sum(len(range(max(r.start, 1), min(r.stop, L + 1))) for r in rank) for rank in slots]
    return [sum(len(chunk_layers(model.n_layer, pp, k, c, v)) for c in range(v)) for k in range(pp)]


def block_params(model, tp=1):
    """One layer on one TP rank: GPT-2's, Llama's (tp.kv_replicated) or Llama's with all E
    experts (not / ep)."""
    h, f, a, kv = model.n_embd, model.ffn, model.n_head, model.kv_heads
    if model.n_experts:
        return moe_layer_params(h, f, a, kv, model.n_experts, model.top_k, model.shared_experts, tp)[0]
    return llama_layer_params(h, f, a, kv, tp) if model.llama else layer_params(h, tp)


def stage_params(model, tp=1, pp=1, v=1, split="trainer"):
    """Parameters on one TP rank of each pipeline stage: its layers, the embedding
    (vocabulary padded to a multiple of 128*tp, split by tp; GPT-2's positions replicated,
    none with ALiBi or rotary) on the first; the final norm (LayerNorm 2h, RMSNorm h) and the
    LM head on the last: an untied head's own (V/tp, h) matrix, or with pp > 1 the last
    stage's copy of the tied embedding."""
    h = model.n_embd
    wte = padded_vocab(model, tp) // tp * h
    positions = 0 if model.alibi or model.llama else model.seq_len * h
    first = wte + positions + (2 * h if model.embed_layernorm else 0)
    counts = [n * block_params(model, tp) for n in layers_per_stage(model, pp, v, split)]
    counts[0] += first
    counts[-1] += (h if model.llama else 2 * h) + (wte if pp > 1 or not model.tie_embeddings else 0)
    return counts


def n_params(model):
    return stage_params(model)[0]


def flops_params(model):
    """N of 6N: every parameter a matmul multiplies. Lookups are left out: the position table, and
    the token embedding when the head is its own matrix (tied, the one matrix is the head's)."""
    h = model.n_embd
    positions = 0 if model.alibi or model.llama else model.seq_len * h
    return n_params(model) - positions - (0 if model.tie_embeddings else padded_vocab(model) * h)


def rank_state_bytes(model, tp, pp, dp, zero, dtype="bf16", v=1, split="trainer"):
    """(parameter, gradient, optimizer) bytes held by one GPU of each pipeline stage: what
    zero.ZeroEngine allocates, up to its flat buffers' padding (< dp elements per group) and Adam's
    4-byte step counters (train.py --dry-run builds a rank on meta and prints both)."""
    return [zero_state_bytes(n, zero, dp, *PRECISIONS[dtype]) for n in stage_params(model, tp, pp, v, split)]


# ---- the cluster ---------------------------------------------------------------------------------
def links(gpu, gpus, tp, pp):
    """(pp, dp) bandwidths under the trainer's rank order rank = (d*pp + p)*tp + t. A
    pipeline is tp*pp neighbouring ranks: on NVLink if that fits in a node. A dp group takes
    one rank per pipeline: inside a node if all tp*pp*dp do, else it leaves through the NICs
    of its k members per node (a ring through a node enters and leaves it once per member's
    NIC), k = per_node / (tp*pp) or 1."""
    per_node = min(gpu.per_node, gpus)
    pp_bw = gpu.intra_bw if tp * pp <= per_node else gpu.inter_bw
    dp_bw = gpu.intra_bw if gpus <= per_node else min(gpu.intra_bw, max(1, per_node // (tp * pp)) * gpu.inter_bw)
    return pp_bw, dp_bw


# ---- time ----------------------------------------------------------------------------------------
def layer_weights(model, tp=1):
    """Matmul weights one TP rank multiplies per token in one layer: GPT-2 12h^2/t; Llama (2h^2 +
    3hf)/t and its own key/value heads' 2h (h/a) max(1, n_kv/t) (a rank holding k/v whole computes
    one group only)."""
    h = model.n_embd
    if model.llama:
        return (2 * h * h + 3 * h * model.ffn) / tp + 2 * h * (h // model.n_head) * max(1, model.kv_heads // tp)
    return 12 * h * h / tp


def column_inputs(model):
    """Column-parallel layers that gather (SP) or all-reduce the gradient of (TP) the
    block's input on their own: GPT-2 qkv and fc; Llama q_proj, kv_proj and gate_up (tp.py
    splits q and k/v apart)."""
    return 3 if model.llama else 2


def layer_activation_bytes(model, run, tp, recompute=None):
    """Activation bytes one layer keeps per micro-batch on one GPU (run.recompute unless given), in
    the run's dtype. GPT-2: Korthikanti's count in the paper's bytes (sdpa keeps no scores: the
    selective count); Llama: llama_activation_bytes_per_layer with fused-kernel bytes."""
    recompute = run.recompute if recompute is None else recompute
    s, b, h, a = model.seq_len, run.micro_batch, model.n_embd, model.n_head
    eb = 4 if run.dtype == "fp32" else 2
    if model.llama:
        return llama_activation_bytes_per_layer(s, b, h, a, model.kv_heads, model.ffn, tp, run.sp, recompute,
                                                run.attention, act=eb, norm=eb)
    if run.attention == "sdpa" and recompute == "none":
        # FlashAttention keeps q, k, v and the output, as selective recompute does
        recompute = "selective"
    # the paper counts 2 bytes
    return activation_bytes_per_layer(s, b, h, a, tp, run.sp, recompute) * eb / 2


def layer_seconds(model, gpu, run, tp, time=TIME):
    """One layer, one micro-batch, forward + backward (+ recompute), one GPU (module docstring)."""
    b, s, h, a = run.micro_batch, model.seq_len, model.n_embd, model.n_head
    full, attn_again = run.recompute == "full", run.recompute in ("full", "selective")
    flash = run.attention == "sdpa"
    dense = 2 * b * s * layer_weights(model, tp) * (3 + full)  # forward 1, backward 2, recompute 1
    # QK^T and AV (GQA shares k/v between heads, not the products); FlashAttention's
    # backward reruns QK^T
    attn = 4 * b * s * s * h / tp * (3 + attn_again) + (2 * b * s * s * h / tp if flash else 0)
    hbm = (time.elem * b * s * h / (tp if run.sp else 1) * (1 + full / 3)
           + (0 if flash else time.score * b * a / tp * s * s * (1 + attn_again / 3)))
    eb = 4 if run.dtype == "fp32" else 2
    tp_b = tp_comm_bytes_per_layer(b, s, h, tp, eb, run.sp, run.recompute, column_inputs(model))
    return (dense + attn) / (gpu.peak_flops * time.matmul) + hbm / gpu.hbm_bw + tp_b / gpu.intra_bw


def step_seconds(model, gpu, gpus, tp, pp, zero, run, time=TIME, global_batch=None):
    """(step seconds, bubble fraction) at a global batch (default run.global_batch)."""
    batch = run.global_batch if global_batch is None else global_batch
    dp = gpus // (tp * pp)
    m = batch // (dp * run.micro_batch)
    v = run.chunks if run.schedule == "interleaved" and pp > 1 else 1
    eb = 4 if run.dtype == "fp32" else 2
    layer = layer_seconds(model, gpu, run, tp, time)
    head = 6 * run.micro_batch * model.seq_len * padded_vocab(model, tp) * model.n_embd / tp
    stages = [n * layer for n in layers_per_stage(model, pp, v, run.split)]
    # logits forward + 2 backward GEMMs, never recomputed
    stages[-1] += head / (gpu.peak_flops * time.matmul)
    pp_bw, dp_bw = links(gpu, gpus, tp, pp)
    sends = pp_comm_bytes(run.micro_batch, model.seq_len, model.n_embd, tp, eb, 1, v) if pp > 1 else 0
    slot = max(stages) + sends / pp_bw
    pipe = (m + (pp - 1) / v) * slot
    n = max(stage_params(model, tp, pp, v, run.split))
    dp_b = dp_comm_bytes(n, zero, dp, PRECISIONS[run.dtype][1], PRECISIONS[run.dtype][0], m)
    host = offload_seconds(run.offload * (-(-n // dp) if zero else n), *PRECISIONS[run.dtype][1::-1], gpu.pcie_bw,
                           gpu.host_bw) if run.offload else 0.0
    # = (p-1)/v slots of the m + (p-1)/v
    return pipe + dp_b / dp_bw + host, pipeline_bubble(pp, m, v)


def train_seconds(step_at, run, seq_len):
    """Seconds for run.tokens tokens. Ramp-up as Megatron's --rampup-batch-size START INC
    SAMPLES: the batch grows START, START+INC, ... each for SAMPLES / ((B - START) / INC)
    samples, then stays at B."""
    total, done, seconds = run.tokens / seq_len, 0.0, 0.0
    if run.rampup:
        start, inc, samples = run.rampup
        steps = (run.global_batch - start) // inc
        for i in range(steps):
            n = min(samples / steps, total - done)
            seconds += n / (start + i * inc) * step_at(start + i * inc)
            done += n
    return seconds + max(0.0, total - done) / run.global_batch * step_at(run.global_batch)


# ---- one layout's estimate -----------------------------------------------------------------------
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
    layers = layers_per_stage(model, pp, v, run.split)
    act = layer_activation_bytes(model, run, tp)
    # full recompute rebuilds one layer's whole activations in backward: the working set
    # on top of the inputs
    work = layer_activation_bytes(model, run, tp, "none") if run.recompute == "full" else 0
    stages = []
    for k, (p_, g_, o_) in enumerate(rank_state_bytes(model, tp, pp, dp, zero, run.dtype, v, run.split)):
        state = (p_, g_, o_ * (1 - run.offload))  # the offloaded share lives in host memory
        held = act * layers[k] * inflight_microbatches(pp - k, m, run.schedule, v) + work
        stages.append((sum(state) + held, state, held))
    _, (params, grads, optim), acts = max(stages, key=lambda x: x[0])
    tp_b = m * max(layers) * tp_comm_bytes_per_layer(b, s, h, tp, eb, run.sp, run.recompute, column_inputs(model))
    pp_b = pp_comm_bytes(b, s, h, tp, eb, m, v) if pp > 1 else 0
    dp_b = dp_comm_bytes(max(stage_params(model, tp, pp, v, run.split)), zero, dp, gb, pb, m)
    step, bubble = step_seconds(model, gpu, gpus, tp, pp, zero, run, time)
    tokens = run.global_batch * s
    n = flops_params(model)
    head = padded_vocab(model) * h
    tflops = tokens * flops_per_token(n, L, h, s, run.recompute, head) / (step * gpus)
    mfu = tokens * flops_per_token(n, L, h, s) / (step * gpus * gpu.peak_flops)
    days = train_seconds(lambda batch: step_seconds(model, gpu, gpus, tp, pp, zero, run, time, batch)[0], run,
                         s) / 86400
    fits = params + grads + optim + acts <= run.usable * gpu.memory
    return Estimate(tp, pp, dp, zero, m, tuple(layers), params, grads, optim, acts, tp_b, pp_b, dp_b, step, bubble,
                    tflops, mfu, days, fits)
