"""Refuse a bad Config before any collective: one line naming the flag and the fix.

Idea: `check` runs on every rank and reads only the Config, the environment, the tokenizer and the
data's index. It raises one clear line, or returns the Config with its derived values filled in
(dataclasses.replace). It writes no file and takes no lock: the out-dir is claimed afterwards, a
step of train.py's recipe (nanomega/job/faults.py:claim_out_dir). The flags: job/config.py.
Lesson: lessons/15-3d-parallelism.md
"""

import dataclasses
import os

from nanomega import cp, data, dist, ep, fp8_linear, moe, muon, onebit, pp, precision, recompute, tp
from nanomega import mtp, post_validate, zero_rules, zeropp
from nanomega.job import faults, flags, guard, meter, presets, ranges
from nanomega.job.flags import model_config


def world_size():
    return int(os.environ.get("WORLD_SIZE", 1))


def check(config):
    """Every check that needs no collective, in the order a user would fix them. Returns the Config
    with its derived values (dp, grad_accum and global_batch, vocab_size, fault, hang_timeout,
    resume); changes nothing."""
    c = config
    # every numeric flag finite and in its declared range
    ranges.check(c, flags.RANGES, flags.default)
    fault = guard.parse_fault(c.inject_fault) if c.inject_fault else None
    if c.on_nan not in ("skip", "stop"):
        raise ValueError(f"--on-nan {c.on_nan!r}: choose skip or stop")
    if c.model is not None and c.model not in presets.PRESETS:
        raise ValueError(
            f"--model {c.model!r} is unknown; choose one of {', '.join(presets.PRESETS)}"
        )
    if not c.dry_run and (c.rank or c.world is not None):
        raise ValueError(
            "--rank and --world are for --dry-run (torchrun sets both for a real run); add --dry-run "
            "or leave them out"
        )

    # the world: dp, and the accumulation that keeps the global batch
    model_ranks = c.tp * c.pp * c.cp  # the ranks one replica of the model spans
    world = (c.world or model_ranks) if c.dry_run else world_size()
    if world % model_ranks:
        cp_flag = f" x --cp {c.cp}" if c.cp > 1 else ""
        raise ValueError(
            f"world size {world} is not divisible by --tp {c.tp} x --pp {c.pp}{cp_flag}; "
            f"launch a multiple of {model_ranks} processes"
        )
    dp, grad_accum = world // model_ranks, c.grad_accum
    # the global batch is the invariant; accumulation follows the world
    if c.global_batch is not None:
        per_step = c.batch_size * dp
        if c.global_batch < 1 or c.global_batch % per_step:
            raise ValueError(
                f"--global-batch {c.global_batch} is not a positive multiple of --batch-size "
                f"{c.batch_size} x dp {dp} (world {world} / (tp {c.tp} x pp {c.pp})); "
                f"pick a global batch divisible by {per_step} or another --batch-size"
            )
        grad_accum = c.global_batch // per_step

    # the engine's rules
    muon.check(c.optimizer)
    if c.optimizer == "onebit" and onebit.check(c.zero, c.offload, c.ep, c.pp, c.dtype):
        raise ValueError(onebit.check(c.zero, c.offload, c.ep, c.pp, c.dtype))
    zero_rules.check_config(c.zero, muon.choose(c.optimizer)[0], c.pp, c.offload, c.offload_params)
    if zero_rules.hybrid_error(c.dp_shard, dp, c.zero, c.cp, c.ep, c.pp):
        raise ValueError(zero_rules.hybrid_error(c.dp_shard, dp, c.zero, c.cp, c.ep, c.pp))
    zpp_on = c.zeropp_qwz or c.zeropp_hpz or c.zeropp_qgz
    if c.post_validate and post_validate.error(c.pp, c.optimizer, c.offload, zpp_on):
        raise ValueError(post_validate.error(c.pp, c.optimizer, c.offload, zpp_on))
    zpp = (c.zeropp_qwz, c.zeropp_hpz, c.zeropp_qgz, c.zero, dp, c.dp_shard, c.fp8, c.cp, c.ep)
    if error := zeropp.error(*zpp, c.pp, c.offload or c.offload_params):
        raise ValueError(error)
    vocab_size = data.get_tokenizer(c.tokenizer).n_vocab
    # documents.ids counts them
    eot = data.get_tokenizer(c.tokenizer).eot_token if c.document_mask else None
    if c.dry_run and c.model:  # no data is read: the preset's vocabulary, as the planner takes it
        vocab_size = presets.PRESETS[c.model]["vocab_size"]

    if c.router in moe.RENAMED:  # the rule it always computed, under its name
        faults.say(
            f"--router {c.router} is now called {moe.rule(c.router)} ({moe.ROUTERS[moe.rule(c.router)]})"
        )
        c = dataclasses.replace(c, router=moe.rule(c.router))
    cfg = model_config(c, vocab_size)
    cfg.validate()
    check_experts(c, cfg, dp)
    tp.check_tensor_parallel(cfg, c.tp, c.sequence_parallel)
    if cfg.qk_norm_whole and c.tp > 1:
        raise ValueError(
            f"--qk-norm-whole normalizes q and k over every head, which --tp {c.tp} splits across "
            "ranks: use --tp 1 (or --qk-norm, per head)"
        )
    pp.check_args(c.n_layer, c.pp, grad_accum, c.schedule, c.virtual_stages, c.compile)
    cp.check(cfg, c.cp, c.cp_method, c.tp)
    mtp.check(cfg, c.tp, c.pp, c.cp)

    # combinations the engines cannot run
    if c.cp > 1 and c.sequence_parallel and (c.block_size // c.cp) % c.tp:
        raise ValueError(
            f"--cp {c.cp} with --sequence-parallel needs --block-size / cp = {c.block_size // c.cp} "
            f"divisible by --tp {c.tp}"
        )
    if c.compile and c.zero == 3:
        raise ValueError(
            "--compile with --zero 3: ZeRO-3's hooks free and re-gather parameter storage inside "
            "each block, which torch.compile cannot trace; use --zero 2 or leave out --compile"
        )
    fp8_linear.check(c, cfg, dp)
    if c.recompute not in recompute.MODES:
        raise ValueError(f"--recompute {c.recompute!r} is not one of {', '.join(recompute.MODES)}")
    if c.recompute_layers is not None and not 0 <= c.recompute_layers <= c.n_layer:
        raise ValueError(
            f"--recompute-layers {c.recompute_layers} is outside [0, --n-layer {c.n_layer}]"
        )

    # the dtype on this device, then the data
    precision.check_dtype_supported(precision.parse_dtype(c.dtype), dist.default_device(c.device))
    if c.data:
        index = data.load_index(c.data)
        if index["tokenizer_sha256"] != data.tokenizer_sha256(data.get_tokenizer(c.tokenizer)):
            raise ValueError(
                f"--data {c.data} was prepared with --tokenizer {index['tokenizer']}; pass that one"
            )
    else:
        data.corpus_files(c.corpus)  # raises the --corpus line when it names no file

    hang_timeout = check_failure_flags(c)
    if not c.dry_run:
        warn_spanning(c.tp, world)

    return dataclasses.replace(
        c,
        dp=dp,
        grad_accum=grad_accum,
        global_batch=c.batch_size * grad_accum * dp,
        vocab_size=vocab_size,
        fault=fault,
        hang_timeout=hang_timeout,
        eot=eot,
        # --resume-from implies --resume
        resume=c.resume or c.resume_from is not None,
    )


def check_experts(c, cfg, dp):
    """MoE and --ep: what moe.py, ep.py and the engine refuse, and what they do not compose with
    yet."""
    moe.check(cfg)
    ep.check(cfg.n_experts, c.ep, dp)
    ep.check_engine(cfg.n_experts, c.zero, c.offload)
    if cfg.n_experts and c.sequence_parallel:
        raise ValueError(
            "--sequence-parallel with --n-experts: the router and its per-sequence balance loss "
            "would see part of each sequence; leave out --sequence-parallel"
        )
    # cp: the balance loss sums its counts over cp (moe.balance_loss); a capacity queue does not
    if cfg.n_experts and c.cp > 1 and cfg.capacity_factor:
        raise ValueError(
            f"--cp {c.cp} with --capacity-factor: an expert's queue runs in the sequence's token "
            "order, across the cp ranks' chunks, which is not built; use --capacity-factor 0"
        )
    if c.moe_bias_balance and not cfg.n_experts:
        raise ValueError("--moe-bias-balance needs --n-experts")


def check_data(config, train_set):
    """Once the data is known (after start-up: every rank raises the same line): one step may not
    take more sequences than an epoch holds (--batch-size 1000000000 was a numpy MemoryError in the
    sampler on every rank); --document-mask needs documents: without one end-of-text token every
    window is one document and the mask does nothing."""
    c, n_windows = config, len(train_set)
    if c.global_batch > n_windows:
        raise ValueError(
            f"--batch-size {c.batch_size} x --grad-accum {c.grad_accum} x dp {c.dp} = {c.global_batch} "
            f"sequences per step is more than the {n_windows} training windows of --block-size "
            f"{c.block_size} in the data; lower --batch-size (or --global-batch)"
        )
    # the first end-of-text token ends the scan (documents are short); none: all of it is read
    chunks = (t[i : i + (1 << 24)] for t in train_set.tokens for i in range(0, len(t), 1 << 24))
    if c.eot is not None and not any((chunk == c.eot).any() for chunk in chunks):
        raise ValueError(
            f"--document-mask: the training data ({c.data or c.corpus}) holds no end-of-text token, "
            f"so every window would be one document and the mask would do nothing (a single .txt "
            f"file is one document); pass a corpus of documents (.jsonl) or leave --document-mask out"
        )


def check_failure_flags(c):
    """The out-dir's path, refused before any collective (the numbers: ranges.check). Returns
    --hang-timeout (its default: 180 s, or half --collective-timeout if that is less)."""
    hang_timeout = (
        min(180.0, c.collective_timeout / 2) if c.hang_timeout is None else c.hang_timeout
    )
    # reads the path only: claiming the out-dir is a step of the recipe
    faults.check_out_dir(c.out_dir)
    if c.data_cache:
        faults.check_out_dir(c.data_cache, "--data-cache")
    if c.tensorboard:
        faults.check_out_dir(c.tensorboard, "--tensorboard")
        meter.require_tensorboard()
    return hang_timeout


def split_groups(groups, per_host):
    """The groups (lists of ranks) whose ranks sit on more than one host, with ranks numbered host
    by host."""
    return [g for g in groups if len({r // per_host for r in g}) > 1]


def warn_spanning(tp_size, world):
    """torchrun numbers ranks host by host (RANK = node rank x LOCAL_WORLD_SIZE + LOCAL_RANK), so
    the contiguous tp groups of dist.layout stay inside a host exactly when LOCAL_WORLD_SIZE % tp ==
    0: else rank 0 warns."""
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    spanning = split_groups(
        [list(range(r, r + tp_size)) for r in range(0, world, tp_size)], per_host
    )
    if spanning and int(os.environ.get("RANK", 0)) == 0:
        print(
            f"warning: tensor-parallel group {spanning[0]} spans hosts (--tp {tp_size} with {per_host} ranks per "
            f"host): its per-layer all-reduces cross the network; use --tp dividing the ranks per host",
            flush=True,
        )
