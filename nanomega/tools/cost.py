"""What one layout holds: the model's shape, the GPUs and runs, parameters and memory per GPU.

Puts the closed forms of formulas.py together for a model shape, a GPU and a tp x pp x dp x ZeRO
layout (the trainer's: pp.stage_layers, dist.Grid's rank order). It is a model, not a measurement.
Memory is the heaviest stage's (fits if <= usable (0.9) x GPU memory). The step time, FLOP/s and
days: tools/cost_time.py; the search over layouts: tools/layouts.py; the command line:
tools/plan.py. Blocks: GPT-2, Llama, Llama + experts (cost_moe.py).
Lesson: lessons/21-planning-a-run.md
"""

from dataclasses import dataclass

from nanomega.formulas import (
    activation_bytes_per_layer,
    layer_params,
    llama_activation_bytes_per_layer,
    llama_layer_params,
    mla_layer_delta,
    moe_layer_params,
    mtp_params,
    zero_state_bytes,
)
from nanomega.gpt_config import SHAPE_KEYS, GPTConfig
from nanomega.job.presets import PRESETS
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
    rope_type: str = "llama3"
    rope_original_context: int = 8192
    rope_mscale_all_dim: float = 0.0
    qkv_bias: bool = False  # Qwen2's q, k, v biases (2h/g + h per layer: left out of the counts)
    qk_norm: bool = False  # Qwen3's two (hd,) scales per layer (left out of the counts)
    qk_norm_whole: bool = False  # OLMoE's (h,) and (kv hd,) scales per layer (left out too)
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    # mixture of experts (llama): E SwiGLU experts of width ffn per block, top_k per token,
    n_experts: int = 0
    # and shared ones every token runs through (tools/cost_moe.py: active parameters, ep,
    # all-to-all)
    top_k: int = 2
    shared_experts: int = 0
    shared_expert_gate: bool = False  # Qwen2-MoE: a (1, h) gate per block
    first_k_dense: int = 0  # DeepSeek-V3: the first k blocks a dense SwiGLU of dense_ffn_hidden
    dense_ffn_hidden: int = 0
    # multi-head latent attention (mla.py): parameters counted (formulas.mla_layer_delta)
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # multi-token prediction (mtp.py): D modules on the last stage (formulas.mtp_params)
    mtp_num_layers: int = 0

    @classmethod
    def from_shape(cls, shape):
        """A preset ({gpt_config.SHAPE_KEYS: value}) as a Model: GPTConfig's block_size is the
        planner's seq_len."""
        return cls(**{"seq_len" if k == "block_size" else k: shape[k] for k in SHAPE_KEYS})

    @property
    def llama(self):
        return self.arch == "llama"

    def config(self):
        """This shape as a gpt_config.GPTConfig: the one home of its derived sizes (kv_heads,
        ffn)."""
        return GPTConfig(
            **{k: getattr(self, "seq_len" if k == "block_size" else k) for k in SHAPE_KEYS}
        )

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
    fp8_flops: float = 0.0  # dense FP8 FLOP/s (datasheet); 0: none recorded (A100: no FP8 units)


# NVIDIA datasheets, dense bf16 (without 2:4 sparsity), one direction of NVLink, each GPU's NIC:
# A100 SXM 80GB (DGX A100: 8x 200 Gb/s HDR InfiniBand); H100 SXM 80GB and PCIe (NVIDIA H100 Tensor
# Core GPU datasheet; DGX H100: 8x 400 Gb/s NDR); H200 SXM (NVIDIA H200 datasheet: 141 GB HBM3e,
# 4.8 TB/s); B200 (NVIDIA DGX B200 datasheet: 1,440 GB and 64 TB/s HBM3e over 8 GPUs, NVLink 5
# 1.8 TB/s both directions, 8x 400 Gb/s ConnectX-7; HGX B200: 4.5 PFLOP/s bf16 with sparsity).
# h100-96gb: torchtitan's Grand Teton H100s (benchmarks/llama3_h100_202412_torchtitan.md: 96 GB
# HBM2e at 2.4 TB/s, 500 W; its footnote: peak between SXM's and NVL's, SXM's used for its MFU).
# host: PCIe 4 / 5 x16 (32 / 64 GB/s, ~80% reached), 2 sockets x 8 DDR4-3200 / DDR5-4800 channels
# over 8 GPUs. --peak-tflops, --hbm-tbps, --inter-bw (plan.py) replace a preset's numbers by measured
# ones. FP8 (--fp8), dense = half the datasheets' "FP8 Tensor Core" numbers, printed with 2:4
# sparsity: NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100, "H100 SXM /
# H100 PCIe": 3,958 / 3,026 TFLOPS*), NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200,
# "H200 SXM": 3,958 TFLOPS*, the H100 SXM's compute); h100-96gb priced at SXM's, as for bf16.
# A100 (Ampere) has no FP8 tensor cores; B200's is not recorded here (not checked): both 0.
GPUS = {
    "a100-80gb": GPU(312e12, 80 * 2**30, 2039e9, 300e9, 25e9, 8, 25e9, 51e9),
    # h100-80gb = h100-sxm
    "h100-80gb": GPU(989e12, 80 * 2**30, 3350e9, 450e9, 50e9, 8, 50e9, 77e9, fp8_flops=1979e12),
    "h100-sxm": GPU(989e12, 80 * 2**30, 3350e9, 450e9, 50e9, 8, 50e9, 77e9, fp8_flops=1979e12),
    # PCIe card: 756 TFLOP/s, HBM2e 2.0 TB/s; GPUs of a node talk over PCIe 5 (NVLink bridges pairs)
    "h100-pcie": GPU(756e12, 80 * 2**30, 2000e9, 64e9, 50e9, 8, 50e9, 77e9, fp8_flops=1513e12),
    "h100-96gb": GPU(989e12, 96 * 2**30, 2400e9, 450e9, 50e9, 8, 50e9, 77e9, fp8_flops=1979e12),
    "h200": GPU(989e12, 141e9, 4800e9, 450e9, 50e9, 8, 50e9, 77e9, fp8_flops=1979e12),
    "b200": GPU(2250e12, 180e9, 8000e9, 900e9, 50e9, 8, 50e9, 77e9),
}
# bytes/param (params, grads, optimizer) as the engine allocates them: gradients reduced in fp32
# whatever the model's dtype (Megatron's main_grad), fp32 masters + Adam m, v for 16-bit models, m
# and v alone for fp32
PRECISIONS = {"bf16": (2, 4, 12), "fp16": (2, 4, 12), "fp32": (4, 4, 8)}


@dataclass(frozen=True)
class Run:
    global_batch: int = 512  # sequences per optimizer step
    micro_batch: int = 1
    dtype: str = "bf16"
    recompute: str = "selective"  # none | selective | full
    sp: bool = True  # sequence parallelism with TP
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved | zb-h1 | zb-h2 | zb-v | dualpipev
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
    # which communication hides behind compute: "none" (Megatron-LM 2021, the calibration rows) or
    # "overlap" (tools/overlap.py: buckets in backward, ZeRO-3's prefetch, as FSDP and the engine)
    overlap: str = "none"
    tp_overlap: bool = False  # tp's collectives chunked beside the matmuls (overlap.tp_exposed)
    # train.py --fp8: the blocks' GEMMs at the GPU's FP8 peak (attention's and the head's in dtype)
    fp8: bool = False
    post_validate: bool = False  # zb-h2: the step without the barrier (--post-validate)


# ---- model shapes --------------------------------------------------------------------------------
def padded_vocab(model, tp=1):
    return -(-model.vocab_size // (128 * tp)) * 128 * tp


def layers_per_stage(model, pp, v=1, split="trainer"):
    """Layers each pipeline rank holds, summed over its v chunks: the trainer's split
    (pp.chunk_layers), or "llama3": the embedding and the head take a layer's slot each, L + 2 slots
    split by the same rule, so the first and last ranks hold a layer less (Llama 3 405B: 128 slots
    on 16 ranks x 8 chunks; the first chunk holds only the embedding, the last only the head)."""
    return [len(layers) for layers in stage_layers(model, pp, v, split)]


def stage_layers(model, pp, v=1, split="trainer"):
    """The layer indices each pipeline rank holds (its v chunks'), by layers_per_stage's rule."""
    if split not in ("trainer", "llama3"):
        raise ValueError(f"split {split!r} is not one of trainer, llama3")
    L = model.n_layer
    if split == "llama3":  # slot j > 0 is layer j - 1
        slots = [[chunk_layers(L + 2, pp, k, c, v) for c in range(v)] for k in range(pp)]
        return [
            [j - 1 for r in rank for j in range(max(r.start, 1), min(r.stop, L + 1))]
            for rank in slots
        ]
    return [[i for c in range(v) for i in chunk_layers(L, pp, k, c, v)] for k in range(pp)]


def block_params(model, tp=1, layer=None):
    """One layer on one TP rank: GPT-2's, Llama's (tp.kv_replicated) or Llama's with all E
    experts (not / ep); an MoE model's dense layers (layer < first_k_dense) their SwiGLU's."""
    h, f, a, kv = model.n_embd, model.ffn, model.n_head, model.kv_heads
    # multi-head latent attention: its attention's count instead of q, k, v, o
    mla = mla_layer_delta(model.config(), tp) if model.kv_lora_rank else 0
    if model.n_experts and layer is not None and not model.config().is_moe(layer):
        return mla + llama_layer_params(h, model.config().dense_ffn, a, kv, tp)
    if model.n_experts:
        return (
            mla
            + moe_layer_params(
                h,
                f,
                a,
                kv,
                model.n_experts,
                model.top_k,
                model.shared_experts,
                tp,
                gate=model.shared_expert_gate,
            )[0]
        )
    return mla + (llama_layer_params(h, f, a, kv, tp) if model.llama else layer_params(h, tp))


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
    counts = [
        sum(block_params(model, tp, i) for i in layers)
        for layers in stage_layers(model, pp, v, split)
    ]
    counts[0] += first
    counts[-1] += (h if model.llama else 2 * h) + (wte if pp > 1 or not model.tie_embeddings else 0)
    counts[-1] += mtp_params(model.config(), tp) if model.mtp_num_layers else 0  # mtp.py
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
    return [
        zero_state_bytes(n, zero, dp, *PRECISIONS[dtype])
        for n in stage_params(model, tp, pp, v, split)
    ]


def layer_activation_bytes(model, run, tp, recompute=None, layer=None):
    """Activation bytes one layer keeps per micro-batch on one GPU (run.recompute unless given), in
    the run's dtype. GPT-2: Korthikanti's count in the paper's bytes (sdpa keeps no scores: the
    selective count); Llama: llama_activation_bytes_per_layer with fused-kernel bytes, the dense
    MLP's width in the first first_k_dense layers (`layer` < k). Latent attention is counted as
    multi-head attention of h (not derived yet: an MLA block saves more)."""
    recompute = run.recompute if recompute is None else recompute
    s, b, h, a = model.seq_len, run.micro_batch, model.n_embd, model.n_head
    eb = 4 if run.dtype == "fp32" else 2

    if model.llama:
        return llama_activation_bytes_per_layer(
            s,
            b,
            h,
            a,
            model.kv_heads,
            model.config().dense_ffn
            if layer is not None and layer < model.first_k_dense
            else model.ffn,
            tp,
            run.sp,
            recompute,
            run.attention,
            act=eb,
            norm=eb,
        )

    if run.attention == "sdpa" and recompute == "none":
        # FlashAttention keeps q, k, v and the output, as selective recompute does
        recompute = "selective"
    # the paper counts 2 bytes
    return activation_bytes_per_layer(s, b, h, a, tp, run.sp, recompute) * eb / 2


def stage_activation_bytes(model, run, tp, pp, v=1, split="trainer"):
    """Activation bytes each pipeline rank's layers keep per micro-batch: its blocks' (the first
    first_k_dense at their own MLP width), and on the last the D MTP modules' blocks (mtp.py; their
    norms and 2h -> h projection's input, ~5 sbh bytes each, left out)."""
    rest = layer_activation_bytes(model, run, tp)
    dense = layer_activation_bytes(model, run, tp, layer=0) if model.first_k_dense else 0
    k = [sum(i < model.first_k_dense for i in ids) for ids in stage_layers(model, pp, v, split)]
    n = layers_per_stage(model, pp, v, split)
    out = [rest * (n_ - k_) + dense * k_ for n_, k_ in zip(n, k)]
    out[-1] += model.mtp_num_layers * rest
    return out
