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

from nanomega import cp, dist, recompute, schedules, tp, worlds
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
    # lesson 17's ring all-reduce run on 8 threads standing in for ranks, its sends' bytes counted
    import diagrams  # lessons/diagrams.py: the ring on threads

    n, sent = 8, []

    class Counting(diagrams.ThreadRing):
        def p2p(self, sends, recvs):
            sent.extend(t.numel() * t.element_size() for t, peer in sends if self.rank == 0)
            super().p2p(sends, recvs)

    lesson = diagrams.lesson_script("17_collectives.py")
    boxes = [diagrams.queue.Queue() for _ in range(n)]
    diagrams.on_threads(n, lambda r: lesson.ring_all_reduce(Counting(r, boxes), torch.ones(1024)))
    return sum(sent)


def _world():
    """One world of 2: plain DP's and ZeRO-1's bytes per parameter, and a tp=2 layer's forward
    bytes."""
    naive, zero = dp_naive.train(steps=1), zero1.train(steps=1)
    grid = dist.Grid(tp=2)
    torch.manual_seed(0)
    block = tp.apply_tensor_parallel(
        GPT(GPTConfig(**CFG, make_vocab_size_divisible_by=256)), grid.tp
    ).blocks["0"]
    grid.log.reset()
    block(torch.randn(2, 16, 32))
    tp_bytes = grid.log.wire_bytes("tp")

    # ring attention over cp = 2: this rank's 8 of 16 tokens, 4 heads of 8, fp32, forward only
    ring = dist.Grid(cp=2)
    q, k, v = (torch.randn(1, 4, 8, 8) for _ in range(3))
    ring.log.reset()
    cp.attention(q, k, v, ring.cp, "ring")
    # less the loss's 4
    return {
        "dp-wire-bytes-per-param": (naive["bytes_per_step"] - 4) / naive["params"],
        "zero1-state-bytes-per-param": zero["state_bytes"] / zero["params"],
        "tp-forward-wire-bytes": tp_bytes,
        "cp-ring-forward-bytes": ring.log.wire_bytes("cp"),
    }


QUESTIONS = {  # name: (lesson, how it is measured)
    "loss-at-init": ("01", loss_at_init),
    "flops-per-token": ("01", flops_per_token),
    "dp-wire-bytes-per-param": ("02", "world"),
    "zero1-state-bytes-per-param": ("02", "world"),
    "tp-forward-wire-bytes": ("03", "world"),
    "1f1b-bubble": ("05", bubble_1f1b),
    "1f1b-in-flight": ("05", in_flight("1f1b")),
    "gpipe-in-flight": ("05", in_flight("gpipe")),
    "full-recompute-saved-bytes": ("07", full_recompute_saved_bytes),
    "gqa-attention-params": ("13", gqa_attention_params),
    "moe-active-params": ("14", moe_active_params),
    "cp-ring-forward-bytes": ("15", "world"),
    "ring-bytes-per-rank": ("17", ring_bytes_per_rank),
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
