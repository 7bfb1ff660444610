"""Context parallelism in the planner: one layout with a cp axis -- memory, bytes and step time.

Idea: a cp group of cp GPUs holds s/cp tokens of every sequence (nanomega/cp.py), so per GPU
everything in tools/cost.py is the model at seq_len s/cp -- the dense matmuls, the activations, tp's
and pp's bytes -- except:
    attention  a rank's s/cp queries see all s keys: cost_time.layer_seconds at s/cp counts 4 b (s/cp)^2 h / t of
               QK^T and AV (no causal halving, as cost.py counts); the other cp - 1 key blocks add
               4 b (s/cp)(s - s/cp) h / t, times the same forward/backward/recompute factor
    cp bytes   formulas.cp_comm_bytes_per_layer per micro-batch and layer, on the link a cp group spans (tp
               neighbours first: a cp group leaves the node when tp x cp > GPUs per node). allgather (Llama 3's)
               is exposed; ring overlaps its sends with the blocks' attention: max(compute, sends) per layer
    state      ZeRO shards over dp x cp (the weights' replicas: zero.py's dp_cp), activations at s/cp
    dp time    tools/overlap.py's exposed seconds over dp x cp (Run.overlap "none": all of them)
The result is a tools/cost_time.Estimate (its dp is the data-parallel size, its tp_comm the tp bytes
at s/cp).
Lesson: lessons/07-long-context.md
"""

from dataclasses import replace

from nanomega.formulas import (
    cp_comm_bytes_per_layer,
    dp_comm_bytes,
    flops_per_token,
    rank_inflight,
    pipeline_bubble,
    pp_comm_bytes,
    tp_comm_bytes_per_layer,
)
from nanomega.tools import cost, cost_time, overlap


def cp_layer_seconds(model, gpu, run, tp, cp, method="allgather", time=cost_time.TIME):
    """(seconds of one layer and micro-batch on one GPU, cp bytes it sends) with s/cp tokens per
    sequence."""
    b, s, h = run.micro_batch, model.seq_len, model.n_embd
    local = cost_time.layer_seconds(replace(model, seq_len=s // cp), gpu, run, tp, time)
    again, flash = run.recompute in ("full", "selective"), run.attention == "sdpa"
    # query-key pairs with the other ranks' keys, x h/t
    other = b * (s // cp) * (s - s // cp) * h / tp
    attn = (4 * other * (3 + again) + (2 * other if flash else 0)) / (gpu.peak_flops * time.matmul)
    eb = 4 if run.dtype == "fp32" else 2
    fwd, bwd = cp_comm_bytes_per_layer(
        method, cp, b, s, h // model.n_head, model.n_head // tp, max(1, model.kv_heads // tp), eb, 4
    )
    sent = fwd * (1 + again) + bwd  # recompute gathers (or rings) the keys and values again
    link = gpu.intra_bw if tp * cp <= gpu.per_node else gpu.inter_bw
    comm = sent / link
    return local + (max(attn, comm) if method == "ring" else attn + comm), sent


def cp_exposed_seconds(model, gpu, run, tp, cp, method="allgather", time=cost_time.TIME):
    """(seconds of one layer's tp and cp bytes on their links, of which waited for) per
    micro-batch: what the layer takes beyond the same layer on links of endless bandwidth (the
    ring's sends hide behind the other blocks' attention; tp's as cost_time.layer_parts says)."""
    local = replace(model, seq_len=model.seq_len // cp)
    _, tp_s, _ = cost_time.layer_parts(local, gpu, run, tp, time)
    layer, sent = cp_layer_seconds(model, gpu, run, tp, cp, method, time)
    endless = replace(gpu, intra_bw=float("inf"), inter_bw=float("inf"))
    link = gpu.intra_bw if tp * cp <= gpu.per_node else gpu.inter_bw
    return tp_s + sent / link, layer - cp_layer_seconds(model, endless, run, tp, cp, method, time)[
        0
    ]


def evaluate(model, gpu, gpus, tp, pp, cp, zero, run, method="allgather", time=cost_time.TIME):
    """cost_time.evaluate with a cp axis: dp = gpus / (tp pp cp); the same global batch of whole
    sequences."""
    L, h, s, b = model.n_layer, model.n_embd, model.seq_len, run.micro_batch
    local = replace(model, seq_len=s // cp)
    dp = gpus // (tp * pp * cp)
    m = run.global_batch // (dp * b)
    v = run.chunks if run.schedule == "interleaved" and pp > 1 else 1
    pb, gb, eb = *cost.PRECISIONS[run.dtype][:2], 4 if run.dtype == "fp32" else 2

    # memory: the fullest stage's state and held activations
    layers = cost.layers_per_stage(model, pp, v, run.split)
    act = cost.layer_activation_bytes(local, run, tp)
    stages = []
    for k, state in enumerate(
        cost.rank_state_bytes(model, tp, pp, dp * cp, zero, run.dtype, v, run.split)
    ):
        held = act * layers[k] * rank_inflight(pp, k, m, run.schedule, v)
        stages.append((sum(state) + held, state, held))
    _, (params, grads, optim), acts = max(stages, key=lambda x: x[0])

    # time: m + (p-1)/v slots of the slowest stage, then dp
    layer, cp_b = cp_layer_seconds(model, gpu, run, tp, cp, method, time)
    head = (
        6 * b * (s // cp) * cost.padded_vocab(model, tp) * h / tp / (gpu.peak_flops * time.matmul)
    )
    times = [n * layer for n in layers]
    times[-1] += head
    # a pipeline is tp x cp x pp neighbours (dist.layout)
    pp_bw, dp_bw = cost_time.links(gpu, gpus, tp * cp, pp)
    pp_b = pp_comm_bytes(b, s // cp, h, tp, eb, 1, v) if pp > 1 else 0
    n = max(cost.stage_params(model, tp, pp, v, run.split))
    dp_b = dp_comm_bytes(n, zero, dp * cp, gb, pb, m)
    dp_t = overlap.dp_seconds(
        n, zero, dp * cp, m, gb, pb, dp_bw, max(times), run.recompute, max(layers) + 1, run.overlap
    )
    step = (m + (pp - 1) / v) * (max(times) + pp_b / pp_bw) + dp_t.exposed

    tokens, fpt = run.global_batch * s, cost.flops_params(model)
    extra = cost.padded_vocab(model) * h
    tflops = tokens * flops_per_token(fpt, L, h, s, run.recompute, extra) / (step * gpus)
    mfu = tokens * flops_per_token(fpt, L, h, s) / (step * gpus * gpu.peak_flops)
    tp_b = (
        m
        * max(layers)
        * tp_comm_bytes_per_layer(
            b, s // cp, h, tp, eb, run.sp, run.recompute, cost_time.column_inputs(model)
        )
    )

    comm_s, exposed_s = cp_exposed_seconds(model, gpu, run, tp, cp, method, time)
    days = run.tokens / tokens * step / 86400
    fits = params + grads + optim + acts <= run.usable * gpu.memory
    return cost_time.Estimate(
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
        m * pp_b,
        dp_b,
        step,
        pipeline_bubble(pp, m, v),
        tflops,
        mfu,
        days,
        fits,
        m * max(layers) * comm_s + (m * pp_b / pp_bw if pp > 1 else 0.0) + dp_t.total,
        m * max(layers) * exposed_s + (m * pp_b / pp_bw if pp > 1 else 0.0) + dp_t.exposed,
    ), m * max(layers) * cp_b
