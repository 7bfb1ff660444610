"""nanomega: large-language-model training as Megatron-LM and DeepSpeed do it, one concept per file.

Read the concepts in the lessons' reading order (lessons/README.md: 00-23); each module sits
beside its lesson, and its docstring gives its idea, its formulas and its lesson:

    00  overview
        the three walls (memory, compute, communication): no module of its own
    01  the dense model
        model.py      the dense GPT: the reference every sharded form is tested against
        gpt_config.py its shape: GPTConfig (sizes, architecture, options) and its validation
        initialization.py
                      its values by parameter name: element i a function of (seed, name, i)
        seams.py      its op table: linear, attention core, norm, ... swapped by one call
        data.py       text -> tokens on disk, once
        windows.py    token windows -> this rank's resumable batches
    02  the modern block
        modern.py     the Llama block's pieces: rotary positions, RMSNorm, SwiGLU, grouped-query
        mla.py        multi-head latent attention: keys and values from a small latent (DeepSeek)
        mtp.py        multi-token prediction: D more modules, each predicting one token further
                      (DeepSeek-V3); their loss over the whole step's valid targets
    03  collectives
        dist.py       the rank grid (dp, pp, cp, tp) and the Axis every collective goes through, in
                      bytes
        worlds.py     local worlds: N CPU ranks on this machine (tests, lessons, bench)
    04  data parallelism and ZeRO
        ddp.py        data parallelism: gradient buckets all-reduced while backward runs
        flat.py       flat buffers and their shards: the bookkeeping under ZeRO
        zero_buckets.py
                      ZeRO's buckets: reduce-scattered, only this rank's slice kept (ZeRO-2/3)
        zero_rules.py ZeRO's rules: what each stage shards, the optimizers it steps, replica groups
        zero.py       the engine: the optimizer over this rank's pieces, per replica group
        zero3.py      ZeRO-3: parameter units gathered on demand
        clip.py       the global gradient norm over dp, tp and pp: each element counted once
        offload.py    ZeRO-Offload: optimizer state (and ZeRO-3's parameter shards) in host memory
        muon.py       Muon: the blocks' matrices stepped by their momentum orthogonalized
        owners.py     owner-compute: each sharded matrix's update computed whole on one rank
    05  tensor parallelism
        tp.py, rng.py tensor parallelism (Megatron's f/g) and its dropout RNG
        tp_loss.py    the cross-entropy of vocabulary-split logits: no rank holds them all
    06  sequence parallelism
        tp.py         the same file: all-gather / reduce-scatter for f/g
    07  long context
        cp.py         context parallelism: ring, all-gather and Ulysses attention over a cp axis
        documents.py  --document-mask: packed documents attend only inside themselves (ids per
                      window)
    08  pipeline parallelism
        pp.py, schedules.py
                      pipeline stages; GPipe / 1F1B / interleaved / ZB-H1 / ZB-H2 / ZB-V as plain
                      data and a simulator
        pp_calls.py   the p2p calls in flight between ops; sent outputs freed (deallocate)
        timeline.py   a step's timeline drawn, one row per rank (ASCII, and a PNG)
        wgrad.py      zero bubble: the backward split into B (input gradients) and W (weights,
                      later)
        dualpipe.py   DualPipeV as data: overlapped forward-and-backward pairs on the V
        moe_overlap.py
                      a pair's MoE all-to-all issued before the other micro-batch computes
        post_validate.py
                      ZB-H2's optimizer step without the barrier: step, validate, roll back
    09  mixed precision
        precision.py  bf16 / fp16, fp32 masters, loss scaling
    10  FP8
        fp8.py        FP8 numbers: E4M3 / E5M2 casts and each recipe's scales
        fp8_linear.py the FP8 linear: the op table's linear entry with its three GEMMs in FP8
        fp8_gather.py ZeRO-3's weights gathered in FP8: each rank quantizes its shard with the whole
                      weight's scale (an amax MAX), the ranks gather the codes
    11  activation recompute
        recompute.py  full and selective activation recompute
    12  FlashAttention
        no module of its own: the tiled forward and backward are lessons/12_flash.py's; model.py's
        sdpa_core calls torch's
    13  fused kernels
        fused.py, csrc/
                      fused C++/CUDA kernels
        extension.py  their loader: csrc/ built once per machine, cached by key
        cpu_adam.py   CPUAdamW: the Adam/AdamW step in one fused C++ pass over host fp32 buffers
    14  profiling
        job/meter.py  MFU and memory per step (the profiler is torch's)
    15  3D parallelism
        meta.py       build any size: the model on meta, each rank draws only its slice (+ dry run)
        compose.py    the composition: TP -> EP -> CP -> PP -> recompute -> fused -> precision ->
                      engine
        train.py      the loop, read top-down: main -> train -> train_step -> forward_backward
    16  experts
        moe.py        mixture of experts: the router, balancing, capacity, shared experts
        ep.py         expert parallelism: tokens to their experts' ranks and back (all-to-all)
    17  communication compression
        zeropp.py     ZeRO++: ZeRO-3's weight gathers as int8/int4 blocks (qwZ), the backward gather
                      from a copy inside the host (hpZ), the gradients reduced by two quantized all-
                      to-alls, inside then across (qgZ)
    18  1-bit Adam
        onebit.py     after a warm-up the momentum averaged as signs and a scale per chunk, with
                      error feedback (--optimizer onebit)
    19  checkpoints and failures
        checkpoint.py, async_checkpoint.py, reshard.py
                      sharded checkpoints (--async-save: written by a thread); any layout loads any
                      other
        flash.py      each rank's newest shard also in shared memory: a restart reads it from there
    20  when training breaks
        job/          guard, health, saves, faults: what a run does when a rank breaks
    21  planning a run
        formulas.py   the closed forms (FLOPs, bytes, activations) the planner (tools/plan.py) and
                      the tests use
    22  sizing a run
        formulas.py   the same closed forms: the compute-optimal parameters and tokens for a budget
    23  capstone
        no module of its own: lessons/23_capstone.py plans, trains and checks one run

Beside the concepts, two folders a student may skip:
    job/    running a job: flags (declared: config_model.py, config_train.py, config_run.py, joined in
            config.py; parsed: flags.py) and their checks, failure handling, health check, meter
            (MFU, memory)
    tools/  commands around training: planner, HF interchange, plots, sampling, corpus and tokenizer
            preparation
Imports point down: tools -> job -> concepts; model.py imports only modern.py, mla.py, moe.py and
mtp.py (the block's pieces), seams.py (its op table), gpt_config.py (its shape) and
initialization.py (its values).
"""
