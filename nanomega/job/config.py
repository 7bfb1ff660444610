"""train.py's flags declared as one frozen Config: each flag once, with its help and its range
beside it.

Idea: a field of Config is a flag. Its declaration says everything about it: its section (one group
of `--help`), default, help, range (job/ranges.py) and whether the model's shape (gpt_config.GPTConfig)
takes it. A Section is a group of flags; calling it declares one (a dataclass field whose metadata
holds the rest). The fields after the flags are the values checks.check derives (dp, the
vocabulary, ...). What reads the declarations (the parser, the range table, `model_config`) is
job/flags.py; a new flag is one field here.
Lesson: lessons/15-3d-parallelism.md
"""

import argparse
import dataclasses
import os

from nanomega.job.ranges import MAX_SEED, MAX_TIMEOUT, MAX_WORLD, above, at_least, within

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout


class Section:
    """A group of flags (one group in `--help`); calling it declares one flag: a field of Config.

    default: the flag's default (a function: called when the parser is built); help: its `--help`
    line; rule: its range (ranges.py: (ok(v, config), what it must be)); model: gpt_config.GPTConfig
    takes it; names: its option strings (default: --field-name); argparse: add_argument's other
    keywords.
    """

    def __init__(self, title):
        self.title = title

    def __call__(self, default, help, rule=None, *, model=False, names=(), **argparse):
        meta = {"section": self.title, "help": help, "rule": rule, "model": model}
        meta.update(names=names, argparse=argparse)
        if callable(default):
            return dataclasses.field(default_factory=default, metadata=meta)
        return dataclasses.field(default=default, metadata=meta)


MODEL = Section("model")
EXPERTS = Section("mixture of experts (--arch llama; nanomega/moe.py, nanomega/ep.py)")
DATA = Section("data")
OPTIMIZER = Section("optimizer and schedule")
PARALLEL = Section("parallelism")
PRECISION = Section("precision, memory and kernels")
LOGGING = Section("logging and evaluation")
CHECKPOINTS = Section("checkpoints")
FAILURES = Section("failures")
DRY_RUN = Section("dry run")


@dataclasses.dataclass(frozen=True)
class Config:
    """Every flag of train.py, by section; then the values checks.check derives from them."""

    # the model's shape (gpt_config.GPTConfig), or a preset's
    model: str | None = MODEL(
        None,
        "a preset shape from nanomega/job/presets.py (gpt2-124m, ...); shape flags given explicitly "
        "override it; the vocabulary stays the tokenizer's",
    )
    n_layer: int = MODEL(4, "transformer blocks", at_least(1), model=True)
    n_head: int = MODEL(4, "attention heads", at_least(1), model=True)
    n_embd: int = MODEL(128, "hidden size h", at_least(1), model=True)
    block_size: int = MODEL(128, "sequence length s (tokens per window)", at_least(1), model=True)
    dropout: float = MODEL(
        0.0, "dropout probability (0: off)", (lambda v, c: 0 <= v < 1, "in [0, 1)"), model=True
    )
    alibi: bool = MODEL(False, "ALiBi attention biases instead of learned positions", model=True)
    embed_layernorm: bool = MODEL(False, "LayerNorm after the embedding (BLOOM)", model=True)
    arch: str = MODEL(
        "gpt2",
        "gpt2 (LayerNorm, GeLU, learned positions) or llama (RMSNorm, SwiGLU, rotary positions, "
        "no biases: nanomega/modern.py)",
        model=True,
    )
    n_kv_head: int = MODEL(
        0, "llama: key/value heads (grouped-query); 0: --n-head", at_least(0), model=True
    )
    ffn_hidden: int = MODEL(
        0, "llama: MLP width; 0: 2/3 x 4h up to a multiple of 256", at_least(0), model=True
    )
    rope_theta: float = MODEL(10000.0, "llama: rotary base (Llama 3: 500000)", above(0), model=True)
    rope_scaling: float = MODEL(
        1.0,
        "llama: RoPE's frequency scaling factor (Llama 3.1: 8)",
        above(0, " (1: no scaling)"),
        model=True,
    )
    rope_type: str = MODEL(
        "llama3", "llama: --rope-scaling's rule: llama3, linear, dynamic or yarn", model=True
    )
    rope_original_context: int = MODEL(
        8192, "llama: the pretraining context of --rope-scaling", at_least(1), model=True
    )
    rope_mscale_all_dim: float = MODEL(
        0.0,
        "MLA with --rope-type yarn: DeepSeek's mscale_all_dim (scores x mscale^2; 0: off)",
        at_least(0),
        model=True,
    )
    qkv_bias: bool = MODEL(False, "llama: biases on q, k and v (Qwen2)", model=True)
    qk_norm: bool = MODEL(False, "llama: RMSNorm on each head of q and k (Qwen3)", model=True)
    qk_norm_whole: bool = MODEL(
        False, "llama: RMSNorm over the whole q and k projections (OLMoE; --tp 1)", model=True
    )
    tie_embeddings: bool = MODEL(
        True,
        "llama: an LM head of its own instead of the token embedding",
        model=True,
        names=("--untie-embeddings",),
        action="store_false",
    )
    norm_eps: float = MODEL(1e-5, "epsilon of every LayerNorm / RMSNorm", above(0), model=True)
    # multi-head latent attention (nanomega/mla.py; DeepSeek-V2, V3)
    kv_lora_rank: int = MODEL(
        0,
        "llama: latent attention's key/value latent (DeepSeek-V3: 512; 0: off)",
        at_least(0),
        model=True,
    )
    q_lora_rank: int = MODEL(
        0, "MLA: the query latent (DeepSeek-V3: 1536; 0: one q projection)", at_least(0), model=True
    )
    qk_nope_head_dim: int = MODEL(
        0,
        "MLA: a head's q/k size without positions (DeepSeek-V3: 128; 0: h/a)",
        at_least(0),
        model=True,
    )
    qk_rope_head_dim: int = MODEL(
        0,
        "MLA: its rotary part, one key for all heads (DeepSeek-V3: 64; 0: h/2a)",
        at_least(0),
        model=True,
    )
    v_head_dim: int = MODEL(
        0, "MLA: a value head's size (DeepSeek-V3: 128; 0: h/a)", at_least(0), model=True
    )
    # multi-token prediction (nanomega/mtp.py; DeepSeek-V3; Megatron-Core's flag names)
    mtp_num_layers: int = MODEL(
        0,
        "llama: multi-token prediction modules D on the last stage (DeepSeek-V3: 1; 0: off)",
        at_least(0),
        model=True,
    )
    mtp_loss_scaling_factor: float = MODEL(
        0.1,
        "the MTP loss's weight lambda: lambda / D x the depths' losses (DeepSeek-V3: 0.3, then 0.1)",
        at_least(0),
        model=True,
    )

    # mixture of experts: the router and the experts (moe.py)
    n_experts: int = EXPERTS(
        0, "routed SwiGLU experts per block (0: dense MLPs)", at_least(0), model=True
    )
    top_k: int = EXPERTS(2, "experts per token", at_least(1), model=True)
    router: str = EXPERTS(
        "mixtral",
        "mixtral (top-k of the logits, softmax over k), softmax_topk (softmax over all, top-k: "
        "DeepSeek-V2, Qwen2-MoE, OLMoE), softmax_topk_norm (the same renormalized: Qwen3-MoE) or "
        "deepseek_v3 (sigmoid, group-limited, normalized, scaled); moe.ROUTERS",
        model=True,
    )
    n_group: int = EXPERTS(
        1, "deepseek_v3: expert groups (nodes; DeepSeek-V3: 8)", at_least(1), model=True
    )
    topk_group: int = EXPERTS(
        1, "deepseek_v3: groups one token may use (DeepSeek-V3: 4)", at_least(1), model=True
    )
    routed_scaling: float = EXPERTS(
        1.0, "deepseek_v3: routed weights x this (DeepSeek-V3: 2.5)", above(0), model=True
    )
    moe_aux_loss: float = EXPERTS(
        0.01, "load-balancing loss coefficient (Switch)", at_least(0), model=True
    )
    moe_z_loss: float = EXPERTS(0.0, "router z-loss coefficient (ST-MoE)", at_least(0), model=True)
    capacity_factor: float = EXPERTS(
        0.0,
        "assignments per expert and sequence <= ceil(cf s k / E), the rest dropped (0: dropless)",
        at_least(0),
        model=True,
    )
    shared_experts: int = EXPERTS(
        0, "experts every token also runs through", at_least(0), model=True
    )
    shared_expert_gate: bool = EXPERTS(
        False, "Qwen2-MoE: the shared experts' output x sigmoid(x . w_gate)", model=True
    )
    first_k_dense: int = EXPERTS(
        0,
        "the first k blocks keep a dense SwiGLU, the rest are MoE (DeepSeek-V3's "
        "first_k_dense_replace: 3)",
        at_least(0),
        model=True,
    )
    dense_ffn_hidden: int = EXPERTS(
        0,
        "the width of those dense blocks' MLP (0: (top_k + shared_experts) x ffn; DeepSeek-V3: "
        "18432)",
        at_least(0),
        model=True,
    )
    moe_bias_balance: float = EXPERTS(
        0.0,
        "DeepSeek-V3's auxiliary-loss-free balancing: the routing bias's step per optimizer step "
        "(0: off; DeepSeek-V3: 0.001)",
        at_least(0),
    )

    # the tokens and the batch
    tokenizer: str = DATA(
        "shakespeare-4k",
        "shakespeare-4k (ours), a tiktoken encoding available offline, or a .tiktoken file",
    )
    corpus: str = DATA(
        os.path.join(REPO, "data", "shakespeare.txt.gz"),
        "a file, directory or glob of .txt[.gz] / .jsonl[.gz] (one .txt: split at its last 5%%)",
    )
    text_field: str = DATA("text", "the JSON field with a document's text (.jsonl)")
    data: str | None = DATA(
        None, "shards prepared by `python -m nanomega.tools.corpus` (instead of --corpus)"
    )
    data_cache: str | None = DATA(None, "tokenized memmaps (default: OUT/data)")
    document_mask: bool = DATA(
        False,
        "a token attends only inside its own document of the packed window (documents end with "
        "<|endoftext|>; nanomega/documents.py)",
    )
    batch_size: int = DATA(16, "micro-batch size", at_least(1))
    grad_accum: int = DATA(
        1,
        "micro-batches per step per data-parallel rank (the pipeline's m)",
        at_least(1),
        names=("--grad-accum", "--microbatches"),
    )
    global_batch: int | None = DATA(
        None,
        "sequences per optimizer step; sets --grad-accum to global / (batch-size x dp), so a "
        "resume under another world size keeps the data order and the optimizer's view",
    )  # its range needs dp: checks.check

    # AdamW and its cosine schedule
    lr: float = OPTIMIZER(1e-3, "peak learning rate (AdamW, betas 0.9, 0.95)", above(0))
    min_lr: float = OPTIMIZER(
        1e-4,
        "learning rate at the end of the cosine decay",
        (lambda v, c: 0 <= v <= c.lr, "in [0, --lr {c.lr:g}]"),
    )
    # --warmup above --max-steps is allowed: the run only warms up (nothing non-finite), and a
    # shared flag set with a short --max-steps override (the tests' quick runs) does exactly that
    warmup: int = OPTIMIZER(20, "steps of linear warm-up to --lr", at_least(0))
    max_steps: int = OPTIMIZER(600, "optimizer steps; the cosine decay ends here", at_least(1))
    weight_decay: float = OPTIMIZER(0.1, "AdamW weight decay (not on biases, norms)", at_least(0))
    optimizer: str = OPTIMIZER(
        "adamw",
        "adamw, muon: the blocks' matrices by Muon (nanomega/muon.py), the rest by AdamW, or "
        "onebit: 1-bit Adam, the momentum all-reduced as signs after --onebit-warmup steps "
        "(nanomega/onebit.py; --zero 0)",
        choices=["adamw", "muon", "onebit"],
    )
    onebit_warmup: int = OPTIMIZER(
        100, "--optimizer onebit: uncompressed AdamW steps before the variance freezes", at_least(1)
    )
    grad_clip: float = OPTIMIZER(1.0, "clip the global gradient norm (0: off)", at_least(0))
    post_validate: bool = OPTIMIZER(
        False,
        "pipeline: step at once, validate the global norm and loss after, roll back and redo when "
        "a clip or skip was needed (ZB-H2's post-validation: nanomega/post_validate.py)",
    )
    seed: int = OPTIMIZER(
        1337,
        "the model's init and the data order",
        (lambda v, c: 0 <= v < MAX_SEED, "in [0, 2**62)"),
    )

    # the layout: world = tp x pp x cp x dp; ZeRO and offload over dp
    tp: int = PARALLEL(1, "tensor-parallel size", at_least(1))
    pp: int = PARALLEL(1, "pipeline-parallel size (dp = world / (tp x pp))", at_least(1))
    ep: int = PARALLEL(1, "expert-parallel size, carved out of dp (experts spread)", at_least(1))
    sequence_parallel: bool = PARALLEL(False, "shard LayerNorm/dropout activations over tp")
    cp: int = PARALLEL(
        1,
        "context-parallel size: each sequence split over cp ranks, attention included "
        "(nanomega/cp.py; dp = world / (tp x pp x cp))",
        at_least(1),
    )
    cp_method: str = PARALLEL(
        "ring",
        "ring (K/V passed rank to rank), allgather (Llama 3's) or ulysses (all-to-all to head "
        "shards: cp must divide the heads per tp rank)",
    )
    schedule: str = PARALLEL(
        "1f1b",
        "gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-v or dualpipev (zero bubble: the backward "
        "split, wgrad.py; zb-h2: 2p - 1 micro-batches in flight; zb-v, dualpipev: two chunks per "
        "rank in a V; dualpipev: m >= 2 pp)",
    )
    virtual_stages: int = PARALLEL(
        1, "model chunks per rank (interleaved, zb-v, dualpipev)"
    )  # pp.check_args
    zero: int = PARALLEL(0, "ZeRO stage 0-3 (0: plain data parallelism)")  # zero.check_config
    dp_shard: int = PARALLEL(
        0,
        "hybrid sharding (--zero 1-3): ZeRO shards over groups of this many neighbouring dp ranks "
        "(inside a host), replicated dp / dp-shard times across (0: all of dp)",
        at_least(0),
    )  # divides dp: zero_rules.hybrid_error
    zeropp_qwz: int = PARALLEL(
        0,
        "ZeRO++ qwZ (--zero 3): the weights' all-gather as blockwise int8 or int4 codes + scales "
        "(8 or 4; 0: off; nanomega/zeropp.py)",
        (lambda v, c: v in (0, 4, 8), "0, 4 or 8 (bits)"),
    )
    zeropp_hpz: bool = PARALLEL(
        False,
        "ZeRO++ hpZ (--zero 3 --dp-shard S): a copy of the gathered weights sharded inside each "
        "host of S ranks, so the backward all-gather stays inside (ZeRO-3 shards over all of dp)",
    )
    zeropp_qgz: int = PARALLEL(
        0,
        "ZeRO++ qgZ (--zero 3 --dp-shard S): the gradients' reduce-scatter as two all-to-alls of "
        "blockwise int8 or int4 codes, inside the host then across (8 or 4; 0: off)",
        (lambda v, c: v in (0, 4, 8), "0, 4 or 8 (bits)"),
    )  # what does not compose: zeropp.error
    offload: float = PARALLEL(
        0.0,
        "ZeRO-Offload (--zero 1-3): the share (0-1) of the fp32 masters and Adam state kept in "
        "host memory, stepped by the CPU Adam (nanomega/offload.py)",
        (lambda v, c: 0 <= v <= 1, "in [0, 1] (a share of the optimizer state)"),
    )
    offload_params: bool = PARALLEL(
        False,
        "ZeRO-3 parameter offload (--zero 3 --offload 1): the parameter shards in host memory "
        "too, copied up at each gather (nanomega/zero3.py)",
    )

    # numerics, recompute, kernels and the device
    dtype: str = PRECISION("fp32", "fp32, bf16 or fp16 (with dynamic loss scaling)")
    recompute: str = PRECISION("none", "none, selective or full")
    recompute_layers: int | None = PRECISION(
        None, "recompute only the first k layers"
    )  # its range needs --n-layer: checks.check
    fused: bool = PRECISION(False, "C++/CUDA fused LayerNorm, softmax, bias-GeLU")
    attention: str = PRECISION(
        "sdpa",
        "sdpa (F.scaled_dot_product_attention: FlashAttention on CUDA), eager (explicit softmax, "
        "as the lessons teach) or fused (eager + our fused softmax)",
        model=True,
    )
    device: str = PRECISION(
        lambda: os.environ.get("NANOMEGA_DEVICE", "auto"),
        "auto: CUDA when present ($NANOMEGA_DEVICE changes this default: the CPU test suite's is cpu)",
        choices=["auto", "cpu", "cuda"],
    )
    tf32: bool = PRECISION(
        True,
        "fp32 matmuls in TF32 on CUDA tensor cores (--no-tf32: full fp32)",
        action=argparse.BooleanOptionalAction,
    )
    compile: bool = PRECISION(False, "torch.compile each transformer block")
    fp8: str = PRECISION(
        "off",
        "the blocks' linears in FP8 (nanomega/fp8_linear.py): tensorwise, delayed, rowwise, "
        "blockwise (DeepSeek-V3) or mxfp8; the head and the MoE router stay in --dtype",
        choices=["off", "tensorwise", "delayed", "rowwise", "blockwise", "mxfp8"],
    )
    fp8_block: int = PRECISION(
        128, "--fp8 blockwise: the tile side (DeepSeek-V3: 128)", at_least(1)
    )
    fp8_history: int = PRECISION(
        1024, "--fp8 delayed: amax history length (Transformer Engine's default)", at_least(1)
    )
    fp8_min_dim: int = PRECISION(
        0,
        "--fp8: a weight with a dimension below this stays in --dtype. Default 0 (all in FP8): this "
        "CPU has no FP8 units, so no size pays; on an H100 torchao keeps e.g. tensorwise GEMMs with "
        "K <= 4096 and N <= 1024 in bf16 (its auto-filter)",
        at_least(0),
    )

    # what the run prints and measures
    out_dir: str = LOGGING("out", "checkpoints, metrics.jsonl, traces (one job at a time)")
    log_every: int = LOGGING(10, "print a line every N steps", at_least(1))
    tensorboard: str | None = LOGGING(
        None, "also write metrics.jsonl's scalars as TensorBoard events to DIR (the extra)"
    )
    eval_every: int = LOGGING(100, "validation loss every N steps (0: never)", at_least(0))
    eval_iters: int = LOGGING(10, "global batches per validation", at_least(1))
    peak_flops: float | None = LOGGING(
        None,
        "peak FLOP/s per device for MFU (default: the datasheet of a known GPU, else measured)",
        above(0, " FLOP/s per device"),
    )

    # when to save, how many to keep, where to resume from
    save_every: int = CHECKPOINTS(0, "checkpoint every N steps (0: only at the end)", at_least(0))
    save_every_minutes: float = CHECKPOINTS(0.0, "also checkpoint every M minutes", at_least(0))
    async_save: bool = CHECKPOINTS(False, "write checkpoints from a background thread")
    flash_restore: bool = CHECKPOINTS(
        False,
        "also keep each rank's newest shard in /dev/shm (host RAM: one shard per rank, two while "
        "a save is in flight); a restart on the same host reads it from there when step and "
        "sha256 match (nanomega/flash.py); removed at the job's end",
    )
    keep_last: int = CHECKPOINTS(
        0,
        "keep only the K newest checkpoints (0: keep all); the one resumed from is never deleted",
        at_least(0),
    )
    resume: bool = CHECKPOINTS(
        False, "continue from the last checkpoint in --out-dir; start fresh if none"
    )
    resume_from: str | None = CHECKPOINTS(
        None,
        "resume from this step (OUT/ckpt/step_STEP) or checkpoint folder; implies --resume",
        metavar="STEP|PATH",
    )
    allow_tokenizer_change: bool = CHECKPOINTS(
        False,
        "resume a checkpoint trained with another --tokenizer (refused otherwise: its token ids "
        "would mean other text)",
    )
    allow_arithmetic_change: bool = CHECKPOINTS(
        False,
        "resume a checkpoint trained with another --router, --capacity-factor, --moe-aux-loss, "
        "--moe-z-loss, --moe-bias-balance or --document-mask (refused otherwise: every step would "
        "compute otherwise; job/faults.py ARITHMETIC)",
    )

    # what the run does when a step or a rank goes wrong (lesson 20)
    on_nan: str = FAILURES(
        "skip", "skip (drop the step) or stop, when the loss or grad norm is not finite"
    )
    max_skipped: int = FAILURES(
        20,
        "stop (non-zero) after this many consecutive skipped (non-finite) steps",
        at_least(0),
    )
    on_spike: str = FAILURES(
        "warn",
        "a loss above --spike-threshold x its running mean: log it, drop that step's update, or "
        "reload the last verified checkpoint and skip the data since it",
        choices=["warn", "skip", "rollback"],
    )
    spike_threshold: float = FAILURES(
        1.5,
        "a spike: loss > this x its running mean",
        above(1, " (a spike: loss > this x its running mean)"),
    )
    rollback_lr_factor: float = FAILURES(
        1.0,
        "scale the lr by this at each rollback",
        (lambda v, c: 0 < v <= 1, "in (0, 1]"),
    )
    collective_timeout: float = FAILURES(
        300.0,
        "seconds before a stuck collective aborts the job",
        (
            lambda v, c: 0 < v <= MAX_TIMEOUT,
            f"> 0 and <= {MAX_TIMEOUT} seconds (30 days)",
        ),
    )
    hang_timeout: float | None = FAILURES(
        None,
        "seconds without progress before every live rank dumps its stacks to OUT/hang/ and the "
        "job names the stuck ranks and exits (0: off; default: 180, or half "
        "--collective-timeout if that is less)",
        (
            lambda v, c: 0 <= v < c.collective_timeout,
            (
                ">= 0 (0: off) and below --collective-timeout {c.collective_timeout:g} (the "
                "watchdog must fire before the collective gives up)"
            ),
        ),
    )
    health_check: bool = FAILURES(
        False,
        "check every rank's compute and links first (nanomega/job/health.py); a bad rank stops "
        "the job with one line",
    )
    inject_fault: str | None = FAILURES(
        None,
        "testing fault handling: KIND raise (the rank raises), nan (its loss becomes NaN), sigterm "
        "(it is sent SIGTERM, a preemption) hang (it stops itself, SIGSTOP), hang-save (it stops "
        "while writing STEP's checkpoint) or spike (its loss x 10) at STEP",
        metavar="KIND:RANK:STEP",
    )

    # one rank of the layout on the meta device, then exit
    dry_run: bool = DRY_RUN(
        False,
        "build one rank of this layout on the meta device (no process group, nothing allocated), "
        "print its parameter, gradient and optimizer bytes next to the planner's, and exit; with "
        "--model the vocabulary is the preset's (no data is read)",
    )
    rank: int = DRY_RUN(0, "the rank --dry-run builds", at_least(0))
    world: int | None = DRY_RUN(
        None, "the world size --dry-run assumes (default: tp x pp)", within(1, MAX_WORLD)
    )

    # derived by checks.check: dp = world / (tp x pp x cp); the tokenizer's vocabulary;
    # --inject-fault as (kind, rank, step); (and in the flags above: grad_accum from --global-batch,
    # global_batch, hang_timeout's default, resume)
    dp: int = 1
    vocab_size: int = 4096
    fault: tuple | None = None
    eot: int | None = None  # --document-mask: the tokenizer's end-of-text id, ending each document
