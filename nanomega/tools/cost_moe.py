"""Mixture of experts in the planner: total and active parameters, expert memory, the all-to-all.

An MoE block (moe.py) holds E SwiGLU experts but runs each token through k of them (and the shared
ones), so per token it costs what a dense Llama block with a (k + shared) f wide MLP costs, while it
holds the state of E experts, E/ep per GPU under expert parallelism (ep.py), plus two all-to-alls
per layer. So a layout's estimate is tools/cost.py's for that dense stand-in, corrected where the
experts differ; like the trainer (job/checks.py), it refuses SP, ZeRO-3 and offload with experts.

Formulas:
    parameters  total: cost.n_params (cost.block_params counts all E experts); active per token:
                k of them (formulas.moe_layer_params); FLOPs per token 6 N_active + 12 L h s
    memory      per stage: the dense part ZeRO-sharded over dp; the routed experts
                (formulas.moe_expert_params per layer) split over ep, then ZeRO-sharded over
                edp = dp / ep; activations: the stand-in's; heaviest state + heaviest activations
    dp bytes    the dense gradients over dp + the experts' over edp (formulas.dp_comm_bytes each)
    all-to-all  per MoE layer and micro-batch formulas.moe_all_to_all_bytes of uniform routing
                (rows out = rows in = formulas.moe_balanced_rows), the share to other nodes at the
                NIC's bandwidth, the rest over NVLink; (m + (p-1)/v) pipeline slots, no overlap
Lesson: lessons/16-experts.md
"""

from dataclasses import replace

from nanomega.formulas import (
    dp_comm_bytes,
    moe_all_to_all_bytes,
    moe_balanced_rows,
    moe_expert_params,
    moe_layer_params,
    zero_state_bytes,
)
from nanomega.tools import cost, cost_time


def params(model):
    """(total, active per token) parameters: every layer with its E experts, or with
    the k a token uses."""
    h, f, a, kv = model.n_embd, model.ffn, model.n_head, model.kv_heads
    total = cost.n_params(model)
    if not model.n_experts:
        return total, total
    layer, active = moe_layer_params(
        h,
        f,
        a,
        kv,
        model.n_experts,
        model.top_k,
        model.shared_experts,
        gate=model.shared_expert_gate,
    )
    return total, total - moe_layers(model) * (layer - active)


def moe_layers(model, layers=None):
    """How many of `layers` (default: all) are MoE blocks (not the first first_k_dense)."""
    cfg = model.config()
    return sum(cfg.is_moe(i) for i in (range(model.n_layer) if layers is None else layers))


def stand_in(model):
    """The dense Llama that costs per token what the MoE model does: its MLP (k + shared) f wide;
    the first first_k_dense blocks keep their dense MLP's width (cost_time.layer_weights)."""
    return replace(
        model,
        n_experts=0,
        ffn_hidden=(model.top_k + model.shared_experts) * model.ffn,
        dense_ffn_hidden=model.config().dense_ffn if model.first_k_dense else 0,
    )


def expert_stage_params(model, tp=1, pp=1, v=1, split="trainer"):
    """Routed-expert parameters (all E) on one TP rank of each pipeline stage."""
    per_layer = moe_expert_params(model.n_embd, model.ffn, model.n_experts, tp)
    return [moe_layers(model, k) * per_layer for k in cost.stage_layers(model, pp, v, split)]


def rank_state_bytes(model, tp, pp, dp, zero, dtype="bf16", v=1, split="trainer", ep=1):
    """cost.rank_state_bytes with experts: (parameter, gradient, optimizer) bytes of one GPU of each
    stage, the dense part over dp and this ep rank's experts over edp (a dense model:
    cost.rank_state_bytes)."""
    if not model.n_experts:
        return cost.rank_state_bytes(model, tp, pp, dp, zero, dtype, v, split)
    sizes = cost.PRECISIONS[dtype]
    out = []
    for n, e in zip(
        cost.stage_params(model, tp, pp, v, split), expert_stage_params(model, tp, pp, v, split)
    ):
        dense, experts = (
            zero_state_bytes(n - e, zero, dp, *sizes),
            zero_state_bytes(e // ep, zero, dp // ep, *sizes),
        )
        out.append(tuple(x + y for x, y in zip(dense, experts)))
    return out


def muon_saved_bytes(model, tp, pp, dp, zero, v=1, split="trainer", ep=1):
    """Optimizer bytes --optimizer muon saves on one GPU of each stage: the blocks' matrices (all
    but norms, biases and the router: muon.is_hidden_matrix) keep one fp32 buffer, the momentum,
    not Adam's two (m, v); the dense ones sharded over dp, this ep rank's experts over edp."""
    h, layers = model.n_embd, cost.stage_layers(model, pp, v, split)
    vectors = 2 * h if model.llama else 7 * h // tp + 6 * h  # + each MoE block's router
    experts = expert_stage_params(model, tp, pp, v, split) if model.n_experts else [0] * len(layers)
    matrices = [
        sum(cost.block_params(model, tp, i) - vectors for i in k)
        - moe_layers(model, k) * model.n_experts * h
        for k in layers
    ]
    return [
        zero_state_bytes(n - e, zero, dp, 0, 0, 4)[2]
        + zero_state_bytes(e // ep, zero, dp // ep, 0, 0, 4)[2]
        for n, e in zip(matrices, experts)
    ]


def expert_state_bytes(model, tp, pp, dp, zero, dtype="bf16", v=1, split="trainer", ep=1):
    """Parameter + gradient + optimizer bytes of the routed experts one GPU of the
    heaviest stage holds."""
    return max(
        sum(zero_state_bytes(e // ep, zero, dp // ep, *cost.PRECISIONS[dtype]))
        for e in expert_stage_params(model, tp, pp, v, split)
    )


def dp_bytes(model, tp, pp, dp, zero, run, ep, m):
    """Bytes one GPU of the heaviest stage sends per step over dp (dense part) and
    edp (its experts)."""
    v = run.chunks if run.schedule == "interleaved" and pp > 1 else 1
    pb, gb = cost.PRECISIONS[run.dtype][:2]
    return max(
        dp_comm_bytes(n - e, zero, dp, gb, pb, m)
        + dp_comm_bytes(e // ep, zero, dp // ep, gb, pb, m)
        for n, e in zip(
            cost.stage_params(model, tp, pp, v, run.split),
            expert_stage_params(model, tp, pp, v, run.split),
        )
    )


def all_to_all(model, gpu, gpus, tp, pp, run, ep):
    """(bytes one GPU sends per micro-batch in its stage's all-to-alls, seconds of one
    micro-batch's)."""
    v = run.chunks if run.schedule == "interleaved" and pp > 1 else 1
    rows = moe_balanced_rows(run.micro_batch * model.seq_len, model.top_k, ep)
    per_layer = moe_all_to_all_bytes(
        rows, rows, model.n_embd, 4 if run.dtype == "fp32" else 2, ep, model.n_experts // ep
    )
    nbytes = max(moe_layers(model, k) for k in cost.stage_layers(model, pp, v, run.split))
    nbytes *= per_layer
    if ep == 1:
        return nbytes, 0.0
    # ep ranks of my group in my node, me too
    in_node = min(ep, max(1, min(gpu.per_node, gpus) // (tp * pp)))
    away = (ep - in_node) / (ep - 1)  # uniform routing: the share of the bytes that leaves the node
    return nbytes, nbytes * (away / gpu.inter_bw + (1 - away) / gpu.intra_bw)


def step_seconds(model, gpu, gpus, tp, pp, zero, run, ep=1, time=cost_time.TIME, global_batch=None):
    """(step seconds, dp bytes, all-to-all bytes, all-to-all seconds) per GPU and step: the
    stand-in's step, its dp time replaced by the dense part's and the experts', + the all-to-all of
    every pipeline slot."""
    batch = run.global_batch if global_batch is None else global_batch
    dense, dp = stand_in(model), gpus // (tp * pp)
    m, v = (
        batch // (dp * run.micro_batch),
        run.chunks if run.schedule == "interleaved" and pp > 1 else 1,
    )

    # its dp bytes are charged here whole: experts are priced without overlap (tools/overlap.py)
    run = replace(run, overlap="none")
    step, _ = cost_time.step_seconds(dense, gpu, gpus, tp, pp, zero, run, time, batch)
    pb, gb = cost.PRECISIONS[run.dtype][:2]
    charged = dp_comm_bytes(
        max(cost.stage_params(dense, tp, pp, v, run.split)), zero, dp, gb, pb, m
    )

    # the experts' dp bytes and the all-to-all of every pipeline slot
    dp_b = dp_bytes(model, tp, pp, dp, zero, run, ep, m)
    a2a_b, a2a_s = all_to_all(model, gpu, gpus, tp, pp, run, ep)
    dp_bw = cost_time.links(gpu, gpus, tp, pp)[1]
    a2a_s *= m + (pp - 1) / v
    return step + (dp_b - charged) / dp_bw + a2a_s, dp_b, a2a_b * m, a2a_s


def layout_error(model, gpus, tp, pp, zero, run, ep):
    """Why the trainer cannot run experts in this layout, in one line naming the flag, or None."""
    dp = gpus // (tp * pp)
    if ep > 1 and not model.n_experts:
        return f"--ep {ep} needs --n-experts"
    if model.n_experts and (model.n_experts % ep or dp % ep):
        return f"--ep {ep} must divide --n-experts {model.n_experts} and dp {dp} (ep is carved out of dp)"
    if model.n_experts and (zero == 3 or run.offload or (run.sp and tp > 1)):
        return (
            "experts run with ZeRO 0-2, without offload and without sequence parallelism (--no-sp)"
        )
    return None


def evaluate(model, gpu, gpus, tp, pp, zero, run, ep=1, time=cost_time.TIME):
    """cost_time.evaluate with experts: the stand-in's estimate, with the experts' memory, dp bytes
    and all-to-all."""
    if not model.n_experts:
        return cost_time.evaluate(model, gpu, gpus, tp, pp, zero, run, time)

    est = cost_time.evaluate(stand_in(model), gpu, gpus, tp, pp, zero, run, time)
    v = run.chunks if run.schedule == "interleaved" and pp > 1 else 1
    params_b, grads_b, optim_b = max(
        rank_state_bytes(model, tp, pp, est.dp, zero, run.dtype, v, run.split, ep), key=sum
    )

    step, dp_b, _, _ = step_seconds(model, gpu, gpus, tp, pp, zero, run, ep, time)
    days = (
        cost_time.train_seconds(
            lambda b: step_seconds(model, gpu, gpus, tp, pp, zero, run, ep, time, b)[0],
            run,
            model.seq_len,
        )
        / 86400
    )

    fits = params_b + grads_b + optim_b + est.acts <= run.usable * gpu.memory
    return replace(
        est,
        params=params_b,
        grads=grads_b,
        optim=optim_b,
        dp_comm=dp_b,
        step_s=step,
        tflops=est.tflops * est.step_s / step,
        mfu=est.mfu * est.step_s / step,
        days=days,
        fits=fits,
        # the experts' extra seconds are communication, all of it waited for
        comm_s=est.comm_s + step - est.step_s,
        exposed_s=est.exposed_s + step - est.step_s,
    )
