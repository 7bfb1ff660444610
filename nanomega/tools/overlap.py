"""Which communication hides behind which compute: the data-parallel seconds a step cannot hide.

Idea: a collective that runs while independent compute runs costs only what sticks out. The
Ultra-Scale Playbook's overlap rules, as PyTorch DDP, FSDP and nanomega's engine (ddp.GradBuckets,
zero3.ShardedParameters) schedule them; per micro-batch of one pipeline stage, forward F, backward
B (recompute included), U units (ZeRO-3's: the stage's layers + the root; a bucket per unit), T the
seconds of the bytes on the dp link (tools/cost_time.links):
    ZeRO-0/1   gradients reduced once, bucket by bucket in the last micro-batch's backward:
               max(0, T_grad - B) + T_grad / U (the last bucket starts when backward ends)
    ZeRO-1/2   the updated parameters all-gathered after the step: exposed (the engine waits)
    ZeRO-2     a reduce-scatter in every micro-batch's backward: m (max(0, T_rs - B) + T_rs / U)
    ZeRO-3     every micro-batch gathers each unit before its forward and again before its backward
               (zero3.py: per micro-batch, never once per step), the next unit prefetched during
               this one's compute, the reduce-scatter in backward:
               m (max(0, T_ag - F) + T_ag / U + max(0, T_ag + T_rs - B) + T_ag / U)
    TP         without overlap (tp.py) every collective waits; with Run.tp_overlap (Megatron's
               --tp-comm-overlap, async TP) only max(0, T_tp - the layer's dense matmuls)
Left exposed: pp's sends (a slot waits for its input), the experts' all-to-all (cost_moe.py); cp's
ring overlaps in tools/cp_cost.py.
Run.overlap "none" keeps Megatron-LM 2021's sum (the calibration rows were fitted so).
Lesson: lessons/21-planning-a-run.md
"""

from dataclasses import dataclass

from nanomega.formulas import dp_comm_bytes


@dataclass(frozen=True)
class DataParallelTime:
    total: float  # seconds the dp bytes take on their link
    exposed: float  # of which the step waits for


def tp_exposed(tp_seconds, matmul_seconds, on):
    """A layer's tp seconds not hidden: all without overlap (nanomega's tp.py); with it (Megatron's
    --tp-comm-overlap, torchtitan's async TP) each all-gather / reduce-scatter is cut into chunks
    that run beside the matmul chunks they feed or come from: only what outlasts the matmuls."""
    return max(0.0, tp_seconds - matmul_seconds) if on else tp_seconds


def split_compute(slot, recompute):
    """(forward, backward) seconds of one micro-batch's slot: a forward is one of the 3 matmul
    passes (forward 1, backward 2), and full recompute's extra forward runs inside backward."""
    forward = slot / (4 if recompute == "full" else 3)
    return forward, slot - forward


def dp_seconds(n, zero, dp, m, grad_bytes, param_bytes, bw, slot, recompute, units, overlap):
    """The dp link's seconds per step, total and exposed, for n parameters per GPU (formulas'
    dp_comm_bytes, term by term) behind a micro-batch slot of `slot` seconds."""
    total = dp_comm_bytes(n, zero, dp, grad_bytes, param_bytes, m) / bw
    if overlap == "none":
        return DataParallelTime(total, total)

    # seconds of one gradient and one parameter pass over the n elements
    f = (dp - 1) / dp * n / bw
    grad, param = f * grad_bytes, f * param_bytes
    once = 2 * grad if zero == 0 else grad  # ZeRO-0's all-reduce: two passes

    fwd, bwd = split_compute(slot, recompute)
    if zero <= 1:  # the last micro-batch's backward hides the buckets but the last one
        hidden_tail = max(0.0, once - bwd) + once / units
        return DataParallelTime(total, hidden_tail + (param if zero == 1 else 0.0))
    if zero == 2:
        return DataParallelTime(total, m * (max(0.0, grad - bwd) + grad / units) + param)
    gathers = max(0.0, param - fwd) + max(0.0, param + grad - bwd) + 2 * param / units
    return DataParallelTime(total, m * gathers)
