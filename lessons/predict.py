"""The "predict the number, then run" exercises: `python lessons/check.py --predict FILE`.

Idea: write a number down before you measure it. FILE (a copy of lessons/exercises/predictions.py)
holds PREDICTIONS = {name: your number or None}; for each number given, the grader runs the
experiment below that measures it and prints your prediction next to the measurement: RIGHT within
RTOL (1%: a prediction is a formula, not a guess of the rounding), else WRONG. The questions are in
lessons/exercises/predictions.py; the experiments only need what the lessons teach, on a model small
enough to run in seconds: the GPT below (vocabulary 256, context 16, 2 layers, 4 heads, width 32,
tied embedding) and 2 spawned CPU ranks.
Lesson: lessons/exercises/README.md
"""

import math
import sys
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from nanomega import (
    cp,
    dist,
    formulas,
    fp8,
    model,
    onebit,
    recompute,
    schedules,
    tp,
    worlds,
    zeropp,
)
from nanomega.gpt_config import GPTConfig

# the minimal track, in the ranks too
from nanomega.model import GPT

# the minimal track, in the ranks too
sys.path.insert(0, str(Path(__file__).resolve().parent / "minimal"))
import dp_naive  # noqa: E402
import zero1  # noqa: E402

RTOL = 0.01
CFG = dict(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=32)


def loss_at_init():
    torch.manual_seed(0)
    x = torch.randint(256, (4, 16))
    return GPT(GPTConfig(**CFG))(x, x.roll(1, 1)).item()


def flops_per_token():
    torch.manual_seed(0)
    model, x = GPT(GPTConfig(**CFG)), torch.randint(256, (4, 16))
    with FlopCounterMode(display=False) as counter:
        model(x, x.roll(1, 1)).backward()
    return counter.get_total_flops() / x.numel()


def bubble_1f1b():
    return schedules.bubble_fraction(schedules.simulate(4, 12, "1f1b"))


def in_flight(schedule):
    # micro-batches whose forward ran and backward did not, at most, on the first of 4 stages
    def peak():
        live = most = 0
        for op in schedules.ops_in_order(schedules.SCHEDULES[schedule](4, 0, 8)):
            live += 1 if op.kind == "F" else -1
            most = max(most, live)
        return most

    return peak


def full_recompute_saved_bytes():
    # autograd's saved bytes in block 0 under full recompute, the GPT above on a (4, 16) batch
    torch.manual_seed(0)
    model = recompute.apply_recompute(GPT(GPTConfig(**CFG)), "full")
    x = torch.randint(256, (4, 16))
    return recompute.saved_bytes_per_layer(model, lambda: model(x, x.roll(1, 1)))["0"]


def gqa_attention_params():
    # one Llama block's attention on meta: h = 64, 8 query heads, 2 key/value heads, no biases
    cfg = GPTConfig(**{**CFG, "n_head": 8, "n_embd": 64}, n_kv_head=2, arch="llama", ffn_hidden=128)
    with torch.device("meta"):
        attn = GPT(cfg).blocks["0"].attn
    return sum(p.numel() for p in attn.parameters())


def moe_active_params():
    # one MoE block's MLP: the router plus the top_k experts a token is sent to (each expert alike)
    cfg = GPTConfig(**CFG, arch="llama", ffn_hidden=64, n_experts=4, top_k=2)
    with torch.device("meta"):
        mlp = GPT(cfg).blocks["0"].mlp
    expert = sum(p.numel() for p in mlp.experts["0"].parameters())
    return mlp.router.weight.numel() + cfg.top_k * expert


def ring_bytes_per_rank():
    # lesson 03's ring all-reduce run on 8 threads standing in for ranks, its sends' bytes counted
    import diagrams  # lessons/diagrams.py: the ring on threads

    n, sent = 8, []

    class Counting(diagrams.ThreadRing):
        def p2p(self, sends, recvs):
            sent.extend(t.numel() * t.element_size() for t, peer in sends if self.rank == 0)
            super().p2p(sends, recvs)

    lesson = diagrams.lesson_script("03_collectives.py")
    boxes = [diagrams.queue.Queue() for _ in range(n)]
    diagrams.on_threads(n, lambda r: lesson.ring_all_reduce(Counting(r, boxes), torch.ones(1024)))
    return sum(sent)


def training_state_bytes():
    # lesson 00's count on the GPT above: bf16 weights and gradients, an fp32 master copy, Adam's m, v
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG)).to(torch.bfloat16)
    master = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.Adam(master, lr=1e-3)
    x = torch.randint(256, (4, 16))
    model(x, x.roll(1, 1)).backward()
    for m, p in zip(master, model.parameters()):
        m.grad = p.grad.float()
    opt.step()
    state = [t for s in opt.state.values() for t in s.values() if t.dim() > 0]
    tensors = [*model.parameters(), *(p.grad for p in model.parameters()), *master, *state]
    return sum(t.numel() * t.element_size() for t in tensors)


def bf16_values_between_1_and_1024():
    # every one of the 2^16 bit patterns read as a bf16 number
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return int(((every >= 1) & (every < 1024)).sum())


def eager_gelu_forward_bytes():
    # lesson 13's ByteCounter around the eager forward only: x (64, 128), bias (128,), fp32
    import diagrams

    x, bias = torch.randn(64, 128), torch.randn(128)
    with diagrams.lesson_script("13_fused.py").ByteCounter() as counter:
        model.bias_gelu(x, bias)
    return counter.bytes


def dp_peer_of_rank_5():
    # dist.layout(dp=4, pp=2, tp=2): the rank at dp index 3 of rank 5's data-parallel group
    return next(g for g in dist.layout(dp=4, pp=2, tp=2)["dp"] if 5 in g.tolist())[3].item()


def reshard_elements_of_rank_2():
    # lesson 19's flat buffer of 80 elements (lessons/diagrams.py:RESHARD_PARAMS) over N = 3 ranks
    import diagrams

    return sum(b - a for _, a, b in diagrams.shard_pieces(3)[2])


def zero3_bytes_per_gpu():
    # the planner's cost model (lesson 21): a 7B model's training state per GPU, ZeRO-3 over dp = 64
    return sum(formulas.zero_state_bytes(7e9, 3, 64))  # weights, gradients, optimizer


def young_interval_hours():
    # lesson 20's trade-off C/T + T/(2M) minimised on a grid of intervals: C = 30 s, M = 56 h
    import diagrams

    return diagrams.checkpoint_overhead(56.0, (30,))[30][2]


def causal_tiles_computed():
    # lesson 12's tiles(s, block) at s = 384, block = 32
    import diagrams

    return len(diagrams.lesson_script("12_flash.py").tiles(384, 32))


def chinchilla_params():
    return formulas.chinchilla_optimal(1e21)[0]


def profiler_bmm_forward_bytes():
    # torch.profiler's memory view of one forward of the GPT above, eager attention, on (4, 16)
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    gpt, x = GPT(GPTConfig(**CFG, attention="eager")), torch.randint(256, (4, 16))
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        gpt(x, x.roll(1, 1))
    return next(e.self_cpu_memory_usage for e in prof.key_averages() if e.key == "aten::bmm")


def e4m3_positive_finite_values():
    # every one of the 256 bit patterns read as an E4M3 number
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8.E4M3).float()
    return int(((every > 0) & torch.isfinite(every)).sum())


def mx_scale_for_amax_3():
    # fp8.quantize_mx of one 1 x 32 block whose amax is 3.0: x ~ q x scale_inv, so x is multiplied
    # by 1 / scale_inv before the cast
    x = torch.zeros(1, 32)
    x[0, 5], x[0, 6] = 3.0, -1.0
    return 1 / fp8.quantize_mx(x).scale_inv.item()


def qwz_int4_row_bytes():
    # zeropp.quantize of one (1, 5000) fp32 row at int4: what the all-gather would move
    codes, scales = zeropp.quantize(torch.randn(1, 5000), bits=4)
    return codes.numel() * codes.element_size() + scales.numel() * scales.element_size()


def _world():
    """One world of 2: plain DP's and ZeRO-1's bytes per parameter, and a tp=2 layer's forward
    bytes (and, under sequence parallelism, its forward + backward bytes)."""
    naive, zero = dp_naive.train(steps=1), zero1.train(steps=1)
    grid = dist.Grid(tp=2)
    torch.manual_seed(0)
    block = tp.apply_tensor_parallel(
        GPT(GPTConfig(**CFG, make_vocab_size_divisible_by=256)), grid.tp
    ).blocks["0"]
    grid.log.reset()
    block(torch.randn(2, 16, 32))
    tp_bytes = grid.log.wire_bytes("tp")

    # the same layer under sequence parallelism: this rank's half of the sequence, both passes
    torch.manual_seed(0)
    cfg = GPTConfig(**CFG, make_vocab_size_divisible_by=256)
    sp = tp.apply_tensor_parallel(GPT(cfg), grid.tp, sequence_parallel=True).blocks["0"]
    grid.log.reset()
    sp(torch.randn(2, 8, 32, requires_grad=True)).sum().backward()
    sp_bytes = grid.log.wire_bytes("tp")

    # ring attention over cp = 2: this rank's 8 of 16 tokens, 4 heads of 8, fp32, forward only
    ring = dist.Grid(cp=2)
    q, k, v = (torch.randn(1, 4, 8, 8) for _ in range(3))
    ring.log.reset()
    cp.attention(q, k, v, ring.cp, "ring")

    # 1-bit Adam's compressed mean over dp = 2 of a 1,000-element momentum
    data = dist.Grid(dp=2)
    mean = onebit.CompressedMean(data.dp, 1000)
    data.log.reset()
    mean(torch.randn(1000))
    # less the loss's 4
    return {
        "dp-wire-bytes-per-param": (naive["bytes_per_step"] - 4) / naive["params"],
        "zero1-state-bytes-per-param": zero["state_bytes"] / zero["params"],
        "tp-forward-wire-bytes": tp_bytes,
        "sp-layer-wire-bytes": sp_bytes,
        "cp-ring-forward-bytes": ring.log.wire_bytes("cp"),
        "onebit-wire-bytes": data.log.wire_bytes("dp"),
    }


QUESTIONS = {  # name: (lesson, how it is measured)
    "loss-at-init": ("01", loss_at_init),
    "flops-per-token": ("01", flops_per_token),
    "dp-wire-bytes-per-param": ("04", "world"),
    "zero1-state-bytes-per-param": ("04", "world"),
    "tp-forward-wire-bytes": ("05", "world"),
    "sp-layer-wire-bytes": ("06", "world"),
    "1f1b-bubble": ("08", bubble_1f1b),
    "1f1b-in-flight": ("08", in_flight("1f1b")),
    "gpipe-in-flight": ("08", in_flight("gpipe")),
    "full-recompute-saved-bytes": ("11", full_recompute_saved_bytes),
    "gqa-attention-params": ("02", gqa_attention_params),
    "moe-active-params": ("16", moe_active_params),
    "cp-ring-forward-bytes": ("07", "world"),
    "ring-bytes-per-rank": ("03", ring_bytes_per_rank),
    "training-state-bytes": ("00", training_state_bytes),
    "bf16-values-in-1-1024": ("09", bf16_values_between_1_and_1024),
    "eager-gelu-forward-bytes": ("13", eager_gelu_forward_bytes),
    "dp-peer-of-rank-5": ("15", dp_peer_of_rank_5),
    "reshard-elements-of-rank-2": ("19", reshard_elements_of_rank_2),
    "zero3-bytes-per-gpu": ("21", zero3_bytes_per_gpu),
    "young-interval-hours": ("20", young_interval_hours),
    "causal-tiles-computed": ("12", causal_tiles_computed),
    "chinchilla-params": ("22", chinchilla_params),
    "profiler-bmm-forward-bytes": ("14", profiler_bmm_forward_bytes),
    "e4m3-positive-finite-values": ("10", e4m3_positive_finite_values),
    "mx-scale-for-amax-3": ("10", mx_scale_for_amax_3),
    "qwz-int4-row-bytes": ("17", qwz_int4_row_bytes),
    "onebit-wire-bytes": ("18", "world"),
}


def grade(path):
    """Print each prediction next to its measurement; True when every question has a right
    answer."""
    import grade as grader  # lessons/grade.py: loads a file by path

    given = getattr(grader.load_file(path, "student_predictions"), "PREDICTIONS", None)
    if not isinstance(given, dict) or set(given) - set(QUESTIONS):
        raise ValueError(
            f"{path}: PREDICTIONS must be a dict with keys among {', '.join(QUESTIONS)}"
        )
    answered = {k: v for k, v in given.items() if v is not None}
    world = worlds.launch(_world, 2)[0] if any(QUESTIONS[k][1] == "world" for k in answered) else {}
    right = 0
    for name, (lesson, how) in QUESTIONS.items():
        if name not in answered:
            print(f"predict {name} (lesson {lesson}): no prediction yet")
            continue
        measured = world[name] if how == "world" else how()
        ok = math.isclose(measured, answered[name], rel_tol=RTOL)
        right += ok
        print(
            f"predict {name} (lesson {lesson}): yours {answered[name]:.6g}, measured {measured:.6g} -> "
            f"{'RIGHT' if ok else 'WRONG'}",
            flush=True,
        )
    print(f"predictions: {right}/{len(QUESTIONS)} right")
    return right == len(QUESTIONS)
