"""train.py's flags as one typed, frozen Config, and the checks that refuse a bad one before any collective starts.

Idea: on a 1,000-GPU job a typo found after the rendezvous costs minutes of every GPU; found here it costs
nothing. `parse` reads the command line once into a Config (frozen: no module rewrites a flag later);
nanomega/ops/checks.py refuses a bad one. The layout: world = tp x pp x dp, with dp derived from the world size.
Lesson: lessons/09-3d-parallelism.md
"""
import argparse
import dataclasses
import os
import sys

from nanomega.ops import presets
from nanomega.model import GPTConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # nanomega/ops/ -> the checkout


@dataclasses.dataclass(frozen=True)
class Config:
    """Every flag of train.py (its defaults: `parser`), then the values `check` derives from them."""
    model: str | None  # model
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    dropout: float
    alibi: bool
    embed_layernorm: bool
    arch: str
    n_kv_head: int
    ffn_hidden: int
    rope_theta: float
    rope_scaling: float
    tie_embeddings: bool
    norm_eps: float
    n_experts: int  # mixture of experts
    top_k: int
    router: str
    moe_aux_loss: float
    moe_z_loss: float
    capacity_factor: float
    shared_experts: int
    moe_bias_balance: float
    tokenizer: str  # data
    corpus: str
    text_field: str
    data: str | None
    data_cache: str | None
    document_mask: bool
    batch_size: int
    grad_accum: int
    global_batch: int | None
    lr: float  # optimizer and schedule
    min_lr: float
    warmup: int
    max_steps: int
    weight_decay: float
    grad_clip: float
    seed: int
    tp: int  # parallelism
    pp: int
    ep: int
    sequence_parallel: bool
    cp: int
    cp_method: str
    schedule: str
    virtual_stages: int
    zero: int
    offload: float
    offload_params: bool
    dtype: str  # precision, memory and kernels
    recompute: str
    recompute_layers: int | None
    fused: bool
    attention: str
    device: str
    tf32: bool
    compile: bool
    out_dir: str  # logging and evaluation
    log_every: int
    eval_every: int
    eval_iters: int
    peak_flops: float | None
    save_every: int  # checkpoints
    save_every_minutes: float
    async_save: bool
    flash_restore: bool
    keep_last: int
    resume: bool
    resume_from: str | None
    allow_tokenizer_change: bool
    on_nan: str  # failures
    max_skipped: int
    on_spike: str
    spike_threshold: float
    rollback_lr_factor: float
    collective_timeout: float
    hang_timeout: float | None
    health_check: bool
    inject_fault: str | None
    dry_run: bool  # dry run
    rank: int
    world: int | None
    # derived by check: dp = world / (tp x pp x cp); the tokenizer's vocabulary; --inject-fault as (kind, rank, step);
    # (and in the fields above: grad_accum from --global-batch, global_batch, hang_timeout's default, resume)
    dp: int = 1
    vocab_size: int = 4096
    fault: tuple | None = None
    eot: int | None = None  # --document-mask: the tokenizer's end-of-text id, which ends each document


class Parser(argparse.ArgumentParser):
    """argparse whose errors (an unknown flag, a value of the wrong type) are one ValueError line, said once by
    rank 0 (lifecycle.entrypoint), instead of the usage block printed by every rank."""

    def error(self, message):
        raise ValueError(f"{message}; `python nanomega/train.py --help` lists the flags")


def parser():
    """The flags, in the groups `--help` shows (one flag per line)."""
    p = Parser(description="Train a GPT with any tp x pp x dp x ZeRO layout.")
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help="a preset shape from nanomega/ops/presets.py (gpt2-124m, ...); "
                   "shape flags given explicitly override it; the vocabulary stays the tokenizer's")
    g.add_argument("--n-layer", type=int, default=4, help="transformer blocks")
    g.add_argument("--n-head", type=int, default=4, help="attention heads")
    g.add_argument("--n-embd", type=int, default=128, help="hidden size h")
    g.add_argument("--block-size", type=int, default=128, help="sequence length s (tokens per window)")
    g.add_argument("--dropout", type=float, default=0.0, help="dropout probability (0: off)")
    g.add_argument("--alibi", action="store_true", help="ALiBi attention biases instead of learned positions")
    g.add_argument("--embed-layernorm", action="store_true", help="LayerNorm after the embedding (BLOOM)")
    g.add_argument("--arch", default="gpt2", help="gpt2 (LayerNorm, GeLU, learned positions) or llama (RMSNorm, "
                   "SwiGLU, rotary positions, no biases: nanomega/modern.py)")
    g.add_argument("--n-kv-head", type=int, default=0, help="llama: key/value heads (grouped-query); 0: --n-head")
    g.add_argument("--ffn-hidden", type=int, default=0, help="llama: MLP width; 0: 2/3 x 4h up to a multiple of 256")
    g.add_argument("--rope-theta", type=float, default=10000.0, help="llama: rotary base (Llama 3: 500000)")
    g.add_argument("--rope-scaling", type=float, default=1.0, help="llama: Llama 3.1's frequency scaling factor")
    g.add_argument("--untie-embeddings", dest="tie_embeddings", action="store_false",
                   help="llama: an LM head of its own instead of the token embedding")
    g.add_argument("--norm-eps", type=float, default=1e-5, help="epsilon of every LayerNorm / RMSNorm")

    g = p.add_argument_group("mixture of experts (--arch llama; nanomega/moe.py, nanomega/ep.py)")
    g.add_argument("--n-experts", type=int, default=0, help="routed SwiGLU experts per block (0: dense MLPs)")
    g.add_argument("--top-k", type=int, default=2, help="experts per token")
    g.add_argument("--router", default="mixtral", help="mixtral (top-k of the logits, softmax over k), deepseek "
                   "(softmax over all, top-k, renormalized) or qwen (the same, not renormalized)")
    g.add_argument("--moe-aux-loss", type=float, default=0.01, help="load-balancing loss coefficient (Switch)")
    g.add_argument("--moe-z-loss", type=float, default=0.0, help="router z-loss coefficient (ST-MoE)")
    g.add_argument("--capacity-factor", type=float, default=0.0, help="assignments per expert and sequence <= "
                   "ceil(cf s k / E), the rest dropped (0: dropless)")
    g.add_argument("--shared-experts", type=int, default=0, help="experts every token also runs through")
    g.add_argument("--moe-bias-balance", type=float, default=0.0, help="DeepSeek-V3's auxiliary-loss-free "
                   "balancing: the routing bias's step per optimizer step (0: off; DeepSeek-V3: 0.001)")

    g = p.add_argument_group("data")
    g.add_argument("--tokenizer", default="shakespeare-4k",
                   help="shakespeare-4k (ours), a tiktoken encoding available offline, or a .tiktoken file")
    g.add_argument("--corpus", default=os.path.join(REPO, "data", "shakespeare.txt.gz"),
                   help="a file, directory or glob of .txt[.gz] / .jsonl[.gz] (one .txt: split at its last 5%%)")
    g.add_argument("--text-field", default="text", help="the JSON field with a document's text (.jsonl)")
    g.add_argument("--data", default=None, help="shards prepared by `python -m nanomega.tools.corpus` (instead of --corpus)")
    g.add_argument("--data-cache", default=None, help="tokenized memmaps (default: OUT/data)")
    g.add_argument("--document-mask", action="store_true", help="a token attends only inside its own document "
                   "of the packed window (documents end with <|endoftext|>; nanomega/documents.py)")
    g.add_argument("--batch-size", type=int, default=16, help="micro-batch size")
    g.add_argument("--grad-accum", "--microbatches", dest="grad_accum", type=int, default=1,
                   help="micro-batches per step per data-parallel rank (the pipeline's m)")
    g.add_argument("--global-batch", type=int, default=None,
                   help="sequences per optimizer step; sets --grad-accum to global / (batch-size x dp), so a "
                        "resume under another world size keeps the data order and the optimizer's view")

    g = p.add_argument_group("optimizer and schedule")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW, betas 0.9, 0.95)")
    g.add_argument("--min-lr", type=float, default=1e-4, help="learning rate at the end of the cosine decay")
    g.add_argument("--warmup", type=int, default=20, help="steps of linear warm-up to --lr")
    g.add_argument("--max-steps", type=int, default=600, help="optimizer steps; the cosine decay ends here")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (not on biases, norms)")
    g.add_argument("--grad-clip", type=float, default=1.0, help="clip the global gradient norm (0: off)")
    g.add_argument("--seed", type=int, default=1337, help="the model's init and the data order")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (dp = world / (tp x pp))")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel size, carved out of dp (experts spread)")
    g.add_argument("--sequence-parallel", action="store_true", help="shard LayerNorm/dropout activations over tp")
    g.add_argument("--cp", type=int, default=1, help="context-parallel size: each sequence split over cp ranks, "
                   "attention included (nanomega/cp.py; dp = world / (tp x pp x cp))")
    g.add_argument("--cp-method", default="ring", help="ring (K/V passed rank to rank), allgather (Llama 3's) or "
                   "ulysses (all-to-all to head shards: cp must divide the heads per tp rank)")
    g.add_argument("--schedule", default="1f1b", help="gpipe, 1f1b or interleaved")
    g.add_argument("--virtual-stages", type=int, default=1, help="model chunks per rank (interleaved)")
    g.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3 (0: plain data parallelism)")
    g.add_argument("--offload", type=float, default=0.0, help="ZeRO-Offload (--zero 1-3): the share (0-1) of the "
                   "fp32 masters and Adam state kept in host memory, stepped by the CPU Adam (nanomega/offload.py)")
    g.add_argument("--offload-params", action="store_true", help="ZeRO-3 parameter offload (--zero 3 --offload 1): "
                   "the parameter shards in host memory too, copied up at each gather (nanomega/zero3.py)")

    g = p.add_argument_group("precision, memory and kernels")
    g.add_argument("--dtype", default="fp32", help="fp32, bf16 or fp16 (with dynamic loss scaling)")
    g.add_argument("--recompute", default="none", help="none, selective or full")
    g.add_argument("--recompute-layers", type=int, default=None, help="recompute only the first k layers")
    g.add_argument("--fused", action="store_true", help="C++/CUDA fused LayerNorm, softmax, bias-GeLU")
    g.add_argument("--attention", default="sdpa", help="sdpa (F.scaled_dot_product_attention: FlashAttention on "
                   "CUDA), eager (explicit softmax, as the lessons teach) or fused (eager + our fused softmax)")
    g.add_argument("--device", default=os.environ.get("NANOMEGA_DEVICE", "auto"), choices=["auto", "cpu", "cuda"],
                   help="auto: CUDA when present ($NANOMEGA_DEVICE changes this default: the CPU test suite's is cpu)")
    g.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=True,
                   help="fp32 matmuls in TF32 on CUDA tensor cores (--no-tf32: full fp32)")
    g.add_argument("--compile", action="store_true", help="torch.compile each transformer block")

    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--out-dir", default="out", help="checkpoints, metrics.jsonl, traces (one job at a time)")
    g.add_argument("--log-every", type=int, default=10, help="print a line every N steps")
    g.add_argument("--eval-every", type=int, default=100, help="validation loss every N steps (0: never)")
    g.add_argument("--eval-iters", type=int, default=10, help="global batches per validation")
    g.add_argument("--peak-flops", type=float, default=None,
                   help="peak FLOP/s per device for MFU (default: the datasheet of a known GPU, else measured)")

    g = p.add_argument_group("checkpoints")
    g.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    g.add_argument("--save-every-minutes", type=float, default=0.0, help="also checkpoint every M minutes")
    g.add_argument("--async-save", action="store_true", help="write checkpoints from a background thread")
    g.add_argument("--flash-restore", action="store_true", help="also keep each rank's newest shard in /dev/shm "
                   "(host RAM: one shard per rank, two while a save is in flight); a restart on the same host "
                   "reads it from there when step and sha256 match (nanomega/flash.py); removed at the job's end")
    g.add_argument("--keep-last", type=int, default=0, help="keep only the K newest checkpoints (0: keep all); "
                   "the one resumed from is never deleted")
    g.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out-dir; "
                   "start fresh if none")
    g.add_argument("--resume-from", default=None, metavar="STEP|PATH",
                   help="resume from this step (OUT/ckpt/step_STEP) or checkpoint folder; implies --resume")
    g.add_argument("--allow-tokenizer-change", action="store_true",
                   help="resume a checkpoint trained with another --tokenizer (refused otherwise: its token ids "
                        "would mean other text)")

    g = p.add_argument_group("failures")
    g.add_argument("--on-nan", default="skip",
                   help="skip (drop the step) or stop, when the loss or grad norm is not finite")
    g.add_argument("--max-skipped", type=int, default=20,
                   help="stop (non-zero) after this many consecutive skipped (non-finite) steps")
    g.add_argument("--on-spike", default="warn", choices=["warn", "skip", "rollback"],
                   help="a loss above --spike-threshold x its running mean: log it, drop that step's update, or "
                   "reload the last verified checkpoint and skip the data since it")
    g.add_argument("--spike-threshold", type=float, default=1.5, help="a spike: loss > this x its running mean")
    g.add_argument("--rollback-lr-factor", type=float, default=1.0, help="scale the lr by this at each rollback")
    g.add_argument("--collective-timeout", type=float, default=300.0,
                   help="seconds before a stuck collective aborts the job")
    g.add_argument("--hang-timeout", type=float, default=None, help="seconds without progress before every live "
                   "rank dumps its stacks to OUT/hang/ and the job names the stuck ranks and exits (0: off; "
                   "default: 180, or half --collective-timeout if that is less)")
    g.add_argument("--health-check", action="store_true", help="check every rank's compute and links first "
                   "(nanomega/ops/health.py); a bad rank stops the job with one line")
    g.add_argument("--inject-fault", default=None, metavar="KIND:RANK:STEP",
                   help="testing fault handling: KIND raise (the rank raises), nan (its loss becomes NaN), sigterm "
                   "(it is sent SIGTERM, a preemption) hang (it stops itself, SIGSTOP), hang-save (it stops while "
                   "writing STEP's checkpoint) or spike (its loss x 10) at STEP")

    g = p.add_argument_group("dry run")
    g.add_argument("--dry-run", action="store_true", help="build one rank of this layout on the meta device (no "
                   "process group, nothing allocated), print its parameter, gradient and optimizer bytes next to "
                   "the planner's, and exit; with --model the vocabulary is the preset's (no data is read)")
    g.add_argument("--rank", type=int, default=0, help="the rank --dry-run builds")
    g.add_argument("--world", type=int, default=None, help="the world size --dry-run assumes (default: tp x pp)")
    return p


def parse(argv=None):
    """The command line as a Config; --model fills the shape flags not given."""
    argv = sys.argv[1:] if argv is None else argv
    p = parser()
    values = vars(p.parse_args(argv))
    if values["model"] in presets.PRESETS:
        values.update(preset_shape(values["model"], p, argv))
    return Config(**values)


def preset_shape(model, parser, argv):
    """--model NAME: the preset's shape for every shape flag not given on the command line (vocabulary excepted:
    the tokenizer decides it)."""
    given = {a.dest for a in parser._actions for opt in a.option_strings for tok in argv
             if tok == opt or tok.startswith(opt + "=")}
    return {field: value for field, value in presets.PRESETS[model].items()
            if field != "vocab_size" and field not in given}


def model_config(config, vocab_size=None):
    """The GPT's shape (model.GPTConfig); its vocabulary: vocab_size, else the Config's (the tokenizer's, once
    checked; 4096 before)."""
    return GPTConfig(vocab_size=vocab_size or config.vocab_size, block_size=config.block_size,
                     n_layer=config.n_layer, n_head=config.n_head, n_embd=config.n_embd, dropout=config.dropout,
                     alibi=config.alibi, embed_layernorm=config.embed_layernorm, arch=config.arch,
                     n_kv_head=config.n_kv_head, ffn_hidden=config.ffn_hidden, rope_theta=config.rope_theta,
                     rope_scaling=config.rope_scaling, tie_embeddings=config.tie_embeddings, norm_eps=config.norm_eps,
                     make_vocab_size_divisible_by=128 * config.tp, attention=config.attention,
                     n_experts=config.n_experts, top_k=config.top_k, router=config.router,
                     moe_aux_loss=config.moe_aux_loss, moe_z_loss=config.moe_z_loss,
                     capacity_factor=config.capacity_factor, shared_experts=config.shared_experts)
