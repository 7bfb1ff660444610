"""One composition step: the dense GPT made into this rank's piece of a layout, and its engine.

The model is built on the meta device (shapes only); each technique then slices or replaces what
it owns, in one fixed order, and the engine draws this rank's values of the dense model from --seed
straight into its flat buffers on grid.device (meta.py: bitwise the dense model's, sliced; no rank
ever holds the dense model). On a meta grid (--dry-run: meta.PaperGrid) nothing is drawn.

    GPT on meta -> TP -> EP -> CP -> PP stage -> recompute -> fused -> precision -> buffers
        -> torch.compile per block -> ZeRO/DP engine (draws the parameters)

Lesson: lessons/15-3d-parallelism.md
"""

import torch

from nanomega import (
    cp,
    ep,
    fp8_gather,
    fp8_linear,
    fused,
    meta,
    moe,
    muon,
    pp,
    precision,
    recompute,
    rng,
    schedules,
    tp,
    wgrad,
    zero,
    zero_rules,
    zeropp,
)
from nanomega.model import GPT
from nanomega.job import flags


def build(config, grid):
    """This rank's model pieces, the engine that owns their optimizer state, and the dense model's
    parameter count: (model, engine, n_params). The GPT's shape comes from the Config
    (flags.model_config)."""
    cfg = flags.model_config(config)
    with torch.device("meta"):
        model = GPT(cfg, seed=config.seed)  # shapes only: every parallel form below slices shapes
    n_params = sum(p.numel() for p in model.parameters())

    # tensor parallel: column/row linears over grid.tp (and sequence parallel), its dropout RNG
    tracker = rng.model_parallel_seed(config.seed, grid)
    if grid.tp.size > 1:
        tp.apply_tensor_parallel(model, grid.tp, config.sequence_parallel, tracker)

    # expert parallel: this ep rank's experts only (ep.py)
    if cfg.n_experts:
        ep.apply_expert_parallel(model, grid.ep)

    # context parallel: attention over the cp axis; positions per chunk
    cp.apply_context_parallel(model, grid.cp, config.cp_method)
    moe.apply_context_parallel(model, grid.cp)  # the balance loss's counts: whole sequences'

    # pipeline parallel: this rank's stage; a zero-bubble schedule's linears split their backward
    if grid.pp.size > 1:
        pp.build_stage(model, grid, config.virtual_stages, schedules.placement(config.schedule))
        if config.schedule in schedules.SPLIT:
            wgrad.split_backward(model)

    # activation recompute, fused kernels, precision: the ops inside whatever the rank now holds
    recompute.apply_recompute(model, config.recompute, config.recompute_layers)
    if config.fused:
        fused.apply_fused(model)
    if config.attention == "fused":  # the eager core with our fused scale-mask-softmax kernel
        fused.apply_fused_softmax(model)
    dtype = precision.parse_dtype(config.dtype)
    fp8 = fp8_linear.apply_fp8(  # --fp8: the blocks' linear entry in FP8 (off: nothing)
        model,
        config.fp8,
        dtype,
        config.fp8_block,
        config.fp8_history,
        config.fp8_min_dim,
        grid.tp,
        grid.cp,
        grid.ep,
    )
    precision.cast_model(model, dtype)

    # buffers now; the engine draws the parameters. The dense init, seen from this tp rank
    init = meta.Init(cfg, config.seed, grid.tp_rank, grid.tp.size)
    meta.materialize(model, init, grid.device, params=False)
    if config.compile:  # per block, as torchtitan: small graphs compile fast; names and hooks stay
        for block in model.blocks.values():
            block.compile()

    # the engine: ZeRO/DP over this rank's pieces. Fused AdamW on CUDA (one kernel for all tensors);
    # the CPU keeps foreach, the arithmetic of every fingerprint
    options = dict(betas=(0.9, 0.95))
    if grid.device.type == "cuda":
        options = dict(betas=(0.9, 0.95), fused=True)
    # the replica groups, each built by the technique that owns its rule: the dense weights over dp
    # x cp (and the tied embedding's extra sum over its two pipeline stages), the routed experts
    # over edp. --dp-shard (hybrid sharding): the dense weights sharded over grid.dp_shard (inside
    # a host), their slices all-reduced over grid.dp_rep (across); without it dp_shard is dp_cp
    across = grid.dp_rep if grid.dp_rep.size > 1 else None
    # ZeRO++ (zeropp.py): ZeRO-3 over all of dp_cp; --dp-shard names the host (hpZ, qgZ)
    plan = zeropp.Plan(
        config.zeropp_qwz, config.zeropp_hpz, config.zeropp_qgz, grid.dp_shard, grid.dp_rep
    )
    if config.zeropp_qwz or config.zeropp_hpz or config.zeropp_qgz:
        across = None
    replicas = [
        zero_rules.Replicas(
            "dense",
            grid.dp_shard if across else grid.dp_cp,
            **pp.tied_rule(model, grid),
            replicate=across,
        ),
        zero_rules.Replicas(**ep.replica_group(grid)),
    ]
    # --optimizer: AdamW, or Muon on the hidden matrices (muon.py) and AdamW on the rest
    optimizer_cls, groups = muon.choose(config.optimizer)
    if config.optimizer == "onebit":  # its warm-up of uncompressed steps (onebit.py)
        options = dict(betas=(0.9, 0.95), warmup=config.onebit_warmup)  # (no fused kernel)
    engine = zero.ZeroEngine(
        model,
        optimizer_cls,
        groups(config.weight_decay, **options),
        grid,
        config.zero,
        replicas=replicas,
        init=init.values,
        offload=config.offload,
        offload_params=config.offload_params,
        # --fp8 at --zero 3: the FP8 linear's weights gathered as FP8 codes (fp8_gather.py)
        wire=fp8_gather.FP8Gather(fp8.recipe.weight, grid.tp)
        if fp8 is not None and config.zero == 3
        else None,
        zeropp=plan if plan.qwz or plan.hpz or plan.qgz else None,
    )
    return model, engine, n_params
