"""Pictures of the ideas, drawn from the code that does them, so that they cannot drift from it.

Each diagram is two functions: one computes what the picture shows by calling nanomega (or running
the lesson's own algorithm), the other draws it. tests/test_diagrams.py holds each computed picture
against the rule the lesson states (a ring's chunk after n - 1 steps, ZeRO's bytes per parameter, the
causal tiles, ...); scripts/figures.py redraws them all:
    python lessons/diagrams.py --figure lessons/figures/diagram_ring.png   # one diagram
    python lessons/diagrams.py                                             # all of them
Needs the `plot` extra (matplotlib) to draw; the data functions need only torch.
"""

import argparse
import ast
import os
import queue
import sys
import threading
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "lessons"))

from nanomega import cp, dist, flat, formulas, onebit, schedules, timeline, tp, zero_rules  # noqa: E402

FOLDER = ROOT / "lessons" / "figures"
DPI = 72


# ---------------------------------------------------------------------------------------------------
# what each picture shows, computed


class ThreadRing:
    """The slice of dist.Axis that lesson 03's ring all-reduce uses (size, rank, p2p), for n threads
    standing in for n ranks: a send is put in the receiver's queue, a receive takes from its own."""

    def __init__(self, rank, boxes):
        self.rank, self.size, self.boxes = rank, len(boxes), boxes

    def p2p(self, sends, recvs):
        for tensor, peer in sends:
            self.boxes[peer].put(tensor)
        for buf, _ in recvs:
            buf.copy_(self.boxes[self.rank].get(timeout=10))


def lesson_script(name):
    """A lesson's script as a module ("03_collectives.py" -> module 03_collectives: a name that
    starts with a digit cannot be written in an import statement, but importlib takes it); its
    experiment runs under __main__ only, so importing it runs nothing. Imported once per process,
    like any module, so the exercise grader's substitution of one of its functions is what every
    caller gets (lessons/grade.py)."""
    import importlib

    return importlib.import_module(name.removesuffix(".py"))


def on_threads(n, rank_main):
    """rank_main(rank) on n threads at once, joined; the first exception a thread raised is raised
    here (a thread's own would only be printed)."""
    errors = []

    def run(rank):
        try:
            rank_main(rank)
        except Exception as error:  # handed to the caller below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def ring_steps(n=4):
    """Lesson 03's ring all-reduce run on n threads, each chunk tagged so that what travels can be
    read: element 0 of rank r's chunk c is 2^r (a sum of them names the ranks it holds), element 1
    is c (a sum of k of them is k c). Returns [(step, rank, chunk, ranks summed in it)] of every
    send, in the order the ranks sent them."""
    lesson = lesson_script("03_collectives.py")
    boxes, sent = [queue.Queue() for _ in range(n)], []
    lock = threading.Lock()

    class Recording(ThreadRing):
        def p2p(self, sends, recvs):
            with lock:
                step = sum(1 for s in sent if s[1] == self.rank)
                for tensor, _ in sends:
                    mask, k_times_c = int(tensor[0]), int(tensor[1])
                    ranks = tuple(r for r in range(n) if mask >> r & 1)
                    sent.append((step, self.rank, k_times_c // len(ranks), ranks))
            super().p2p(sends, recvs)

    def rank_main(r):
        x = torch.tensor([[2.0**r, c] for c in range(n)], dtype=torch.float64).flatten()
        lesson.ring_all_reduce(Recording(r, boxes), x)

    on_threads(n, rank_main)
    return sorted(sent)


def zero_memory(n=4):
    """{stage: (weights, gradients, optimizer) bytes per parameter on one of n ranks}, from
    zero_rules.STAGE: bf16 weights 2, fp32 gradients 4, Adam's fp32 master, m and v 12."""
    return {
        stage: (
            2 / (n if rule.parameters else 1),
            4 / (n if rule.gradients else 1),
            12 / (n if rule.optimizer else 1),
        )
        for stage, rule in zero_rules.STAGE.items()
    }


def tp_owners(h=8, t=2):
    """Which tp rank holds each element of the MLP's two matrices, from tp.shard_param: the first
    split by output rows (column-parallel), the second by input columns (row-parallel)."""
    owners = {}
    for name, shape in (
        ("blocks.0.mlp.c_fc.weight", (4 * h, h)),
        ("blocks.0.mlp.c_proj.weight", (h, 4 * h)),
    ):
        full = torch.full(shape, -1)
        for rank in range(t):
            tp.shard_param(name, full, rank, t).fill_(rank)  # a view into full
        owners[name] = full
    return owners


class TracingAxis:
    """A tensor-parallel axis of `size` ranks seen from rank 0 alone: each collective is recorded
    as (op, input shape, output shape) and returns a tensor of the right shape (values are not the
    real sums: only the shapes and the order are drawn)."""

    def __init__(self, size=2):
        self.name, self.size, self.rank, self.trace = "tp", size, 0, []

    def all_reduce(self, t, op=None):
        self.trace.append(("all_reduce", tuple(t.shape), tuple(t.shape)))
        return t

    def all_gather(self, out, t):
        self.trace.append(("all_gather", tuple(t.shape), tuple(out.shape)))
        return out.copy_(torch.cat([t] * self.size))

    def reduce_scatter(self, out, t):
        self.trace.append(("reduce_scatter", tuple(t.shape), tuple(out.shape)))
        return out.copy_(t[: out.shape[0]])

    def start(self, op, out, t=None):  # the overlapped form: done at once, no Work to wait on
        getattr(self, op)(*((out, t) if t is not None else (out,)))


def sp_trace(n_layer=2, t=2, b=2, s=16, h=32):
    """The collectives of one forward of a GPT under tp + sequence parallelism, in order, from
    tp.apply_tensor_parallel's modules run on a TracingAxis: [(op, input shape, output shape)]."""
    from nanomega.gpt_config import GPTConfig
    from nanomega.model import GPT

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=s, n_layer=n_layer, n_head=4, n_embd=h))
    axis = TracingAxis(t)
    tp.apply_tensor_parallel(model, axis, sequence_parallel=True)
    x = torch.randint(256, (b, s))
    model(x, x)
    return axis.trace


RESHARD_PARAMS = (("wte", 24), ("ln.w", 6), ("attn.w", 30), ("mlp.w", 20))  # names, element counts


def shard_pieces(n):
    """{rank: [(name, start, end)]}: the elements of each parameter rank r owns when the flat
    buffer of RESHARD_PARAMS is split over n ranks (flat.FlatGroup.pieces, turned into the
    parameter's own coordinates, the (name, start, end) a checkpoint saves)."""
    named = [(name, torch.zeros(size)) for name, size in RESHARD_PARAMS]
    owned = {}
    for rank in range(n):
        group = flat.FlatGroup(named, n, rank, split=True, keep="shard")
        offsets = dict(zip(group.names, group.offsets))
        owned[rank] = [
            (group.names[i], a - offsets[group.names[i]], b - offsets[group.names[i]])
            for i, a, b in group.pieces()
        ]
    return owned


STEPS = ("apply_", "build_stage", "cast_model", "materialize", "ZeroEngine")  # what composes


def compose_order():
    """The techniques nanomega/compose.py:build applies, in its source order: each call of a
    module's apply_*, pp.build_stage, precision.cast_model, meta.materialize and zero.ZeroEngine,
    read from the code itself (ast), as "module.function"."""
    tree = ast.parse((ROOT / "nanomega" / "compose.py").read_text())
    build = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "build")
    calls = [
        n
        for n in ast.walk(build)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Name)
        and n.func.attr.startswith(STEPS)
    ]
    return [
        f"{c.func.value.id}.{c.func.attr}"
        for c in sorted(calls, key=lambda c: (c.lineno, c.col_offset))
    ]


def cp_chunks(s=16, n=4):
    """{rank: its token positions} for context parallelism over n ranks (cp.positions), and each
    rank's causal work in (chunk, chunk) pairs."""
    held = {rank: cp.positions(s, n, rank).tolist() for rank in range(n)}
    work = {rank: sum(q >= k for q in held[rank] for k in range(s)) for rank in range(n)}
    return held, work


def causal_tiles(s=8 * 32, block=32):
    """The (query tile, key tile) pairs a causal FlashAttention computes: on and below the diagonal."""
    t = s // block
    return [(i, j) for i in range(t) for j in range(t) if j <= i], t


def gqa_groups(n_head=8, n_kv=2):
    """Which key/value head each query head reads: model.py's repeat_interleave of the kv heads."""
    kv = torch.arange(n_kv).view(1, n_kv, 1, 1)
    return kv.repeat_interleave(n_head // n_kv, dim=1).flatten().tolist()


def flops_by_part(vocab=512, s=64, n_layer=2, h=64, a=4, b=2):
    """{part of the GPT: forward matmul FLOPs per token} over all layers, by torch's FlopCounterMode
    per module (lesson 01's count): q, k, v; the attention's two s x s products; the attention's
    output projection; the MLP's two matmuls; the LM head."""
    from torch.utils.flop_counter import FlopCounterMode

    from nanomega.gpt_config import GPTConfig
    from nanomega.model import GPT

    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=vocab, block_size=s, n_layer=n_layer, n_head=a, n_embd=h, attention="eager"
    )
    model, x = GPT(cfg), torch.randint(0, vocab, (b, s))
    with FlopCounterMode(display=False) as counter:
        model(x, x)
    counts = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    layers = [f"GPT.blocks.{i}" for i in range(n_layer)]
    parts = {
        "q, k, v": sum(counts[f"{k}.attn.c_attn"] for k in layers),
        "QK^T, PV": sum(
            counts[f"{k}.attn"] - counts[f"{k}.attn.c_attn"] - counts[f"{k}.attn.c_proj"]
            for k in layers
        ),
        "attention out": sum(counts[f"{k}.attn.c_proj"] for k in layers),
        "MLP up": sum(counts[f"{k}.mlp.c_fc"] for k in layers),
        "MLP down": sum(counts[f"{k}.mlp.c_proj"] for k in layers),
        "LM head": counts["GPT.head"],
    }
    return {k: v / (b * s) for k, v in parts.items()}


def format_spacing(exponents=range(-30, 18)):
    """{format: [(x, spacing)]} for x = 2^k: the gap from x to the next number of bf16, fp16 and
    fp32 (torch.nextafter in the format), None where x is not representable (fp16: below 2^-24 it
    rounds to 0, above 65,504 to inf). Lesson 09's point: an update below half the spacing at a
    weight's magnitude is rounded away."""
    out = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.tensor([2.0**k for k in exponents], dtype=torch.float64)
        cast = x.to(dtype)
        gap = torch.nextafter(cast, torch.full_like(cast, float("inf"))).double() - cast.double()
        ok = (cast.double() == x) & torch.isfinite(cast)
        out[str(dtype).split(".")[1]] = [
            (v, g if good else None) for v, g, good in zip(x.tolist(), gap.tolist(), ok.tolist())
        ]
    return out


def recompute_trade(s=64, b=2, h=32, a=4, n_layer=2, vocab=128):
    """{mode: (bytes autograd keeps in block 0, matmul FLOPs of one step)} for no, selective and
    full recompute (lesson 11), measured on an fp32 GPT with dropout (as the lesson's: the rerun then
    reaches the block's last matmul, whose output the dropout needs): recompute.saved_bytes_per_layer
    and torch's FlopCounterMode, the lesson's two meters."""
    import copy

    from torch.utils.flop_counter import FlopCounterMode

    from nanomega.gpt_config import GPTConfig
    from nanomega.model import GPT
    from nanomega.recompute import apply_recompute, saved_bytes_per_layer

    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=vocab, block_size=s, n_layer=n_layer, n_head=a, n_embd=h, dropout=0.1
    )
    base, x = GPT(cfg), torch.randint(0, vocab, (b, s))
    out = {}
    for mode in ("none", "selective", "full"):
        model = apply_recompute(copy.deepcopy(base), mode)
        kept = saved_bytes_per_layer(model, lambda: model(x, x))["0"]
        with FlopCounterMode(display=False) as counter:
            model(x, x).backward()
        out[mode] = (kept, counter.get_total_flops())
    return out


def fp8_scales(rows=8, cols=64, block=16, outlier=2.0**12, seed=0):
    """{recipe: (rows, cols) log2 of the scale each element of an activation is multiplied by
    before its E4M3/E5M2 cast}, by fp8_linear.FP8's forward operand (lesson 10): channel 0 made
    `outlier` times larger; blockwise's tiles 1 x block (DeepSeek-V3's 1 x 128, made small to be
    seen), MXFP8's 1 x 32. Which elements share the outlier's scale is the recipe's answer."""
    from nanomega.fp8_linear import FP8

    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    x[:, 0] *= outlier
    out = {}
    for name in ("tensorwise", "rowwise", "blockwise", "mxfp8"):
        q = FP8(name, block=block).operand(x, "x", None)
        out[name] = -torch.log2(q.expanded())  # scale = 1 / scale_inv
    return x, out


def grid_groups(dp=2, pp=2, tp=4):
    """{rank: (dp, pp, tp) coordinates} and the tp, pp and dp groups of a 3D layout, from
    dist.layout: tp fastest (neighbours inside a node), then pp, dp outermost."""
    groups = {
        axis: [g.tolist() for g in dist.layout(dp=dp, pp=pp, tp=tp)[axis]]
        for axis in ("tp", "pp", "dp")
    }
    coords = {}
    for axis in ("dp", "pp", "tp"):
        for group in groups[axis]:
            for index, rank in enumerate(group):
                coords.setdefault(rank, {})[axis] = index
    return {r: (c["dp"], c["pp"], c["tp"]) for r, c in sorted(coords.items())}, groups


def capstone_groups(dp=2, cp_size=2, ep=2, experts=4, s=32):
    """Lesson 23's layout at N = 4 (dp 2 x cp 2, ep 2), from dist.layout and cp.positions: {rank:
    (dp index, cp index, its token positions of each sequence, the experts it holds)} and the groups
    of cp (trade K/V), ep (trade tokens), edp (an expert's replicas) and dp_cp (a dense weight's)."""
    groups = {
        axis: [g.tolist() for g in dist.layout(dp=dp, cp=cp_size, ep=ep)[axis]]
        for axis in ("cp", "ep", "edp", "dp_cp")
    }
    per_rank, held = experts // ep, {}
    for group in groups["ep"]:
        for e, rank in enumerate(group):
            held[rank] = tuple(range(e * per_rank, (e + 1) * per_rank))
    ranks = {}
    for r in sorted(held):
        d, c = divmod(r, cp_size)
        ranks[r] = (d, c, cp.positions(s, cp_size, c).tolist(), held[r])
    return ranks, groups


def fused_bytes(rows=64, width=128):
    """Lesson 13's bias + GeLU, forward and backward: [(aten kernel, bytes it read and wrote)], the
    eager kernels counted one at a time by the lesson's ByteCounter, and the fused kernel's (forward,
    backward) bytes by the lesson's formula: it reads x and writes y (2n), reads dy and x and writes
    dx (3n), n = rows x width fp32 elements (the bias's few h bytes left out)."""
    from nanomega import model

    lesson, kernels = lesson_script("13_fused.py"), []

    class PerKernel(lesson.ByteCounter):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = self.bytes
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if self.bytes > before:
                kernels.append((func.overloadpacket.__name__, self.bytes - before))
            return out

    x = torch.randn(rows, width, requires_grad=True)
    bias = torch.randn(width, requires_grad=True)
    grad = torch.ones(rows, width)
    with PerKernel():
        model.bias_gelu(x, bias).backward(grad)
    n = rows * width
    return kernels, (4 * 2 * n, 4 * 3 * n)


def checkpoint_overhead(mtbf_h=112.0, saves_s=(120, 40), longest_h=8.0, points=3200):
    """Lesson 20's trade-off, per hour of training: a checkpoint every T hours stalls C/T, a failure
    (one per M hours) loses T/2 on average: overhead(T) = C/T + T/(2M) (restarts left out). M = 112
    h: BLOOM's reported rate (lesson 20); C = 2 min (the lesson's assumed synchronous save) and 40 s
    (BigScience's chronicles). {C in seconds: (T grid in hours, overhead, the grid's best T)}."""
    grid = torch.linspace(longest_h / points, longest_h, points, dtype=torch.float64)
    curves = {}
    for c_s in saves_s:
        cost = c_s / 3600 / grid + grid / (2 * mtbf_h)
        curves[c_s] = (grid.tolist(), cost.tolist(), grid[cost.argmin()].item())
    return curves


def compute_optimal(budgets=tuple(10.0**e for e in range(19, 27))):
    """Lesson 22's picture: the compute-optimal (C, N, D) of each budget (formulas.chinchilla_optimal,
    k = 20), Chinchilla's Table 3 rows and the published runs, both as lesson 22's script lists
    them."""
    from nanomega import formulas

    lesson = lesson_script("22_sizing.py")
    frontier = [(c, *formulas.chinchilla_optimal(c)) for c in budgets]
    return frontier, lesson.TABLE3, lesson.RUNS


def step_allocations():
    """Lesson 14's memory view without the world: one forward + backward of the lesson's model
    under torch.profiler(profile_memory=True), after a warm-up step. {aten op: bytes its calls
    allocated (self), summed}, the ops that allocated any, largest first."""
    from torch.profiler import ProfilerActivity, profile

    from nanomega.model import GPT

    lesson = lesson_script("14_profiling.py")
    torch.manual_seed(0)
    model = GPT(lesson.CFG)
    x = torch.randint(0, lesson.V, (lesson.B, lesson.S))
    model(x, x).backward()  # warm-up: the gradients exist, as in the lesson's profiled step
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(x, x).backward()
    allocated = {
        e.key: e.self_cpu_memory_usage
        for e in prof.key_averages()
        if e.key.startswith("aten::") and e.self_cpu_memory_usage > 0
    }
    return dict(sorted(allocated.items(), key=lambda kv: -kv[1]))


class Recorder(torch.nn.Module):
    """An expert that records which tokens reach it (a row's element 0 is its token's index) and
    multiplies them by its own factor, expert e by e + 1: the combined output names its experts."""

    def __init__(self, e, seen):
        super().__init__()
        self.e, self.seen = e, seen

    def forward(self, rows):  # (rows, h) -> (rows, h)
        self.seen[self.e] = [int(t) for t in rows[:, 0]]
        return rows * (self.e + 1)


def moe_dispatch(tokens=8, k=2, n_experts=4, seed=0):
    """ep.dispatch_combine of `tokens` tokens routed top-k among n_experts (moe.route, mixtral's rule,
    random logits) to Recorder experts. Returns (experts (T, k), weights (T, k), {expert: tokens it
    received, in its order}, x (T, h), the combined output (T, h))."""
    from nanomega import ep, moe

    g = torch.Generator().manual_seed(seed)
    weights, experts, _ = moe.route(torch.randn(tokens, n_experts, generator=g), k)
    x = torch.cat([torch.arange(tokens, dtype=torch.float32)[:, None], torch.ones(tokens, 3)], 1)
    seen = {}
    modules = {str(e): Recorder(e, seen) for e in range(n_experts)}
    y = ep.dispatch_combine(x, experts, weights, None, modules, n_experts)
    return experts, weights, seen, x, y


# ---------------------------------------------------------------------------------------------------
# drawing


COLLECTIVES = ("forward gather", "backward gather", "gradient reduction")


def zeropp_routes(shard=8, replicate=4, param_bytes=2, bits=8, unit=2**20):
    """Lesson 17's picture: {scheme: {collective: (inside, across) bytes per parameter}} that one
    rank sends in one micro-batch, ZeRO-3 over N = S R ranks (S per host, R hosts), a unit of P =
    unit N padded elements, bf16 weights, fp32 gradients, the ZeRO++ codes `bits` wide. Each
    collective's link is the rule of lesson 17's table; its bytes are formulas.quantized_bytes and
    the ring factors, and tests/test_diagrams.py holds every scheme's sum to
    formulas.zeropp_comm_bytes (hybrid sharding: formulas.hybrid_comm_bytes)."""
    S, R = shard, replicate
    N = S * R
    P, c = unit * N, unit
    gather = (N - 1) / N * P * param_bytes  # a ring all-gather of the unit's weights over N
    quantized = (N - 1) * formulas.quantized_bytes(c, bits)  # qwZ: codes + scales, over N
    inside_gather = (S - 1) / S * P * param_bytes  # hpZ's (and hybrid's) gather over the host
    scatter = (N - 1) / N * P * 4  # fp32 gradients reduce-scattered over N
    qgz = (
        (S - 1) * formulas.quantized_bytes(R * c, bits),
        (R - 1) * formulas.quantized_bytes(c, bits),
    )
    routes = {
        "plain ZeRO-3": ((0, gather), (0, gather), (0, scatter)),
        "hybrid, shard S": (
            (inside_gather, 0),
            (inside_gather, 0),
            ((S - 1) / S * P * 4, 2 * (R - 1) / R * P / S * 4),  # scatter inside, all-reduce across
        ),
        f"qwZ int{bits}": ((0, quantized), (0, quantized), (0, scatter)),
        "hpZ": ((0, gather), (inside_gather, 0), (0, scatter)),
        f"qgZ int{bits}": ((0, gather), (0, gather), qgz),
        "all three": ((0, quantized), (inside_gather, 0), qgz),
    }
    return {
        scheme: {k: (i / P, a / P) for k, (i, a) in zip(COLLECTIVES, links)}
        for scheme, links in routes.items()
    }


def onebit_feedback(n=8, steps=40, seed=0):
    """Lesson 18's picture: one worker's error-compensated 1-bit compression (onebit.compress, one
    chunk) of a momentum-shaped x_t, step by step: [(x_t, e_t, sent_t, e_t+1)], e_t+1 = x_t + e_t -
    C(x_t + e_t), in fp64 around onebit's fp32 scale; and the gap |sum sent - sum x| after each step
    with the error carried and with it dropped (the same compressor)."""
    g = torch.Generator().manual_seed(seed)
    drift = torch.linspace(-1, 1, n, dtype=torch.float64)
    error = torch.zeros(n, dtype=torch.float64)
    records, sums = [], torch.zeros(3, n, dtype=torch.float64)  # true, with, without feedback
    gaps = []
    for _ in range(steps):
        x = drift + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)
        send = x + error
        sent = onebit.decompress(*onebit.compress(send.float(), 1)).double()
        records.append((x, error, sent, send - sent))
        error = send - sent
        dropped = onebit.decompress(*onebit.compress(x.float(), 1)).double()
        sums += torch.stack([x, sent, dropped])
        gaps.append(((sums[1] - sums[0]).norm().item(), (sums[2] - sums[0]).norm().item()))
    return records, gaps


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw_ring(path):
    plt = _plt()
    n, sends = 4, ring_steps(4)
    fig, ax = plt.subplots(figsize=(7, 4))
    colours = plt.get_cmap("tab10")
    for step, rank, chunk, ranks in sends:
        ax.add_patch(
            plt.Rectangle((step, n - 1 - rank), 0.95, 0.9, color=colours(chunk), alpha=0.35)
        )
        label = f"c{chunk}\n" + "+".join(map(str, ranks))
        ax.text(step + 0.47, n - 0.55 - rank, label, ha="center", va="center", fontsize=8)
    ax.axvline(n - 1 - 0.025, color="k", lw=1)
    ax.set_xlim(0, 2 * (n - 1))
    ax.set_ylim(0, n)
    ax.set_yticks([n - 0.55 - r for r in range(n)], [f"rank {r}" for r in range(n)])
    ax.set_xticks([s + 0.47 for s in range(2 * (n - 1))], [f"{s + 1}" for s in range(2 * (n - 1))])
    ax.set_xlabel("step: reduce-scatter (left of the line), then all-gather; each rank sends right")
    ax.set_title(
        "Ring all-reduce, 4 ranks: the chunk each rank sends (c) and the ranks summed in it"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_zero(path):
    plt = _plt()
    n, memory = 4, zero_memory(4)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    parts = ("bf16 weights", "fp32 gradients", "Adam state (fp32 master, m, v)")
    left = [0.0] * len(memory)
    for i, part in enumerate(parts):
        widths = [memory[s][i] for s in memory]
        ax.barh([f"ZeRO-{s}" for s in memory], widths, left=left, label=part)
        left = [a + b for a, b in zip(left, widths)]
    for y, total in enumerate(left):
        ax.text(total + 0.2, y, f"{total:g} B", va="center", fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, 21)
    ax.set_xlabel(f"bytes per parameter on one of N = {n} data-parallel ranks (zero_rules.STAGE)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_tp(path):
    plt = _plt()
    owners = tp_owners()
    fig, axes = plt.subplots(1, 2, figsize=(7, 3.6))
    titles = (
        "c_fc (4h, h): column-parallel,\nsplit by output rows; f before it",
        "c_proj (h, 4h): row-parallel,\nsplit by input columns; g after it",
    )
    for ax, grid, title in zip(axes, owners.values(), titles):
        ax.imshow(grid.numpy(), cmap="Pastel1", vmin=0, vmax=8, aspect="auto")
        for rank in grid.unique().tolist():  # each rank's name at the middle of its block
            rows, cols = (grid == rank).nonzero(as_tuple=True)
            ax.text(
                cols.float().mean().item(), rows.float().mean().item(), f"rank {rank}", ha="center"
            )
        ax.set_title(title, fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(
        "Megatron's MLP over tp = 2: which rank holds each weight (tp.shard_param)", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_1f1b(path):
    traces = schedules.simulate(4, 8, "1f1b")
    timeline.draw_timeline(traces, path)


def draw_sp(path):
    plt = _plt()
    trace = sp_trace(n_layer=1)
    fig, ax = plt.subplots(figsize=(9, 2.2))
    names = {
        "all_gather": "all-gather",
        "reduce_scatter": "reduce-scatter",
        "all_reduce": "all-reduce",
    }
    where = [
        "embedding\n(vocab split)",
        "attention\n(heads split)",
        "MLP\n(cols, rows)",
        "LM head",
    ]
    x, region = 0.0, 0
    for op, *_ in trace:
        if op == "all_reduce":  # the loss's few floats (lesson 05), not an activation
            continue
        # the region before the collective: sequence-split after a reduce-scatter
        split = op == "all_gather"
        colour = "tab:green" if split else "tab:blue"
        label = "LN, dropout,\nresidual\n(b, s/t, h)" if split else where[min(region, 3)]
        ax.add_patch(plt.Rectangle((x, 0.3), 1.6, 0.5, color=colour, alpha=0.3))
        ax.text(x + 0.8, 0.55, label, ha="center", va="center", fontsize=7)
        ax.annotate(names[op], (x + 1.6, 0.85), ha="center", fontsize=7, color="k")
        region += not split
        x += 1.8
    ax.add_patch(plt.Rectangle((x, 0.3), 1.6, 0.5, color="tab:blue", alpha=0.3))
    ax.text(x + 0.8, 0.55, where[3], ha="center", va="center", fontsize=7)
    ax.set_xlim(-0.1, x + 1.8)
    ax.set_ylim(0.1, 1.0)
    ax.axis("off")
    ax.set_title(
        "One layer's forward under tp + SP (tp.py's modules, traced): green holds 1/t of the tokens, "
        "blue all of them",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_reshard(path):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 2.6))
    colours = plt.get_cmap("tab10")
    sizes = [size for _, size in RESHARD_PARAMS]
    offset = {name: sum(sizes[:i]) for i, (name, _) in enumerate(RESHARD_PARAMS)}
    total = sum(sizes)
    for row, n in enumerate((4, 2)):
        y = 1 - row
        for rank, pieces in shard_pieces(n).items():
            for i, (name, a, b) in enumerate(pieces):
                colour = colours([p for p, _ in RESHARD_PARAMS].index(name))
                ax.add_patch(
                    plt.Rectangle((offset[name] + a, y + 0.15), b - a, 0.6, color=colour, alpha=0.5)
                )
                if i == 0:
                    ax.text(offset[name] + a + 0.5, y + 0.82, f"rank {rank}", fontsize=7)
            lo = rank * -(-total // n)  # rank r owns [r S, (r + 1) S), S = ceil(total / n)
            ax.axvline(lo, ymin=(y + 0.1) / 2, ymax=(y + 0.9) / 2, color="k", lw=1)
        ax.text(-1, y + 0.45, f"N = {n}", ha="right", va="center", fontsize=9)
    for name, size in RESHARD_PARAMS:
        ax.text(offset[name] + size / 2, 0.02, name, ha="center", fontsize=8)
    ax.set_xlim(-8, total + 2)
    ax.set_ylim(0, 2)
    ax.axis("off")
    ax.set_title(
        "One flat buffer split over 4 and over 2 ranks (flat.FlatGroup): a checkpoint saves each "
        "piece as (name, start, end),\nso a run at N = 2 reads what N = 4 wrote by name",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_compose(path):
    plt = _plt()
    steps = compose_order()
    fig, ax = plt.subplots(figsize=(4.2, 0.45 * len(steps) + 0.8))
    for i, step in enumerate(steps):
        y = len(steps) - 1 - i
        ax.add_patch(plt.Rectangle((0, y + 0.1), 1, 0.7, color="tab:blue", alpha=0.25))
        ax.text(0.5, y + 0.45, step, ha="center", va="center", fontsize=8)
        if i:
            ax.annotate("", (0.5, y + 0.8), (0.5, y + 1.1), arrowprops=dict(arrowstyle="->"))
    ax.set_xlim(-0.05, 1.05)
    ax.set_ylim(0, len(steps))
    ax.axis("off")
    ax.set_title(
        "compose.build: one rank's model, in this order\n(read from its source)", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_zb_h1(path):
    # the paper's unit setting: F, B (input gradient) and W (weight gradients) one unit each
    timeline.draw_timeline(schedules.simulate(4, 8, "zb-h1", t_f=1, t_b=1, t_w=1), path)


def draw_dualpipev(path):
    # the DualPipe repository's figure: 4 ranks (8 stages), 10 micro-batches; F = B = W = 1
    timeline.draw_timeline(schedules.simulate(4, 10, "dualpipev", v=2, t_f=1, t_b=1, t_w=1), path)


def draw_zb_h2(path):
    # the parallelogram: every rank busy from its first op to its last, the ranks t_f apart
    timeline.draw_timeline(schedules.simulate(4, 8, "zb-h2", t_f=1, t_b=1, t_w=1), path)


def draw_zb_v(path):
    # two chunks per rank in a V, each op a chunk's (half a stage's) F, B or W
    timeline.draw_timeline(schedules.simulate(4, 8, "zb-v", v=2, t_f=1, t_b=1, t_w=1), path)


def draw_cp(path):
    plt = _plt()
    s, n = 16, 4
    held, work = cp_chunks(s, n)
    fig, ax = plt.subplots(figsize=(7, 3))
    colours = plt.get_cmap("tab10")
    for rank, positions in held.items():
        for pos in positions:
            ax.add_patch(
                plt.Rectangle((pos, n - 1 - rank), 0.95, 0.9, color=colours(rank), alpha=0.5)
            )
        ax.text(s + 0.3, n - 0.55 - rank, f"{work[rank]} (q, k) pairs", va="center", fontsize=9)
    ax.set_xlim(0, s + 4)
    ax.set_ylim(0, n)
    ax.set_yticks([n - 0.55 - r for r in range(n)], [f"rank {r}" for r in range(n)])
    ax.set_xticks(range(0, s, 2))
    ax.set_xlabel(
        "token position; each rank holds a head chunk and its mirror tail chunk (cp.positions)"
    )
    ax.set_title(f"Context parallelism, cp = {n}, s = {s}: equal causal work per rank")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_flash(path):
    plt = _plt()
    computed, t = causal_tiles()
    fig, ax = plt.subplots(figsize=(4, 4))
    for i in range(t):
        for j in range(t):
            done = (i, j) in computed
            ax.add_patch(
                plt.Rectangle((j, t - 1 - i), 0.95, 0.95, color="tab:blue" if done else "0.9")
            )
    ax.set_xlim(0, t)
    ax.set_ylim(0, t)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlabel("key tiles")
    ax.set_ylabel("query tiles")
    ax.set_title(f"Causal tiles, T = {t}: {len(computed)} of {t * t} computed", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_gqa(path):
    plt = _plt()
    groups = gqa_groups()
    n_head, n_kv = len(groups), max(groups) + 1
    fig, ax = plt.subplots(figsize=(6, 2.4))
    for h, g in enumerate(groups):
        ax.plot([h, g * n_head / n_kv + (n_head / n_kv - 1) / 2], [1, 0], color="0.5")
    ax.scatter(range(n_head), [1] * n_head, s=300, color="tab:blue", zorder=3)
    ax.scatter(
        [g * n_head / n_kv + (n_head / n_kv - 1) / 2 for g in range(n_kv)],
        [0] * n_kv,
        s=300,
        color="tab:orange",
        zorder=3,
    )
    ax.set_yticks([0, 1], ["k/v heads", "query heads"])
    ax.set_xticks([])
    ax.set_ylim(-0.4, 1.4)
    ax.set_title(
        f"Grouped-query attention: {n_head} query heads read {n_kv} key/value heads", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


PLAN = ("--model", "gpt3-175b", "--gpus", "1024", "--gpu", "a100-80gb", "--global-batch", "1536")


def plan_points(argv=PLAN):
    """Lesson 21's first command: every layout the planner costs (tools/layouts.plan), as
    (estimate, usable bytes per GPU); the planner's pick is the first estimate (it fits and its step
    is the shortest of those that fit)."""
    from nanomega.tools import layouts, plan_flags

    args, model, gpu, run, _ = plan_flags.configure(list(argv))
    return layouts.plan(model, gpu, args.gpus, run), run.usable * gpu.memory


def draw_plan(path):
    plt = _plt()
    ests, usable = plan_points()
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for fits, colour, label in ((True, "tab:blue", "fits"), (False, "0.6", "does not fit")):
        group = [e for e in ests if e.fits == fits]
        ax.scatter(
            [e.memory / 1e9 for e in group], [e.step_s for e in group], s=12, c=colour, label=label
        )
    best = ests[0]
    ax.scatter([best.memory / 1e9], [best.step_s], s=80, facecolors="none", edgecolors="tab:red")
    ax.annotate(
        f"the pick: tp {best.tp} pp {best.pp} dp {best.dp} ZeRO-{best.zero}",
        (best.memory / 1e9, best.step_s),
        xytext=(30, 60),
        textcoords="offset points",
        fontsize=8,
        color="tab:red",
        arrowprops={"arrowstyle": "->", "color": "tab:red"},
    )
    ax.axvline(usable / 1e9, color="k", ls=":", lw=1)
    ax.text(usable / 1e9, ax.get_ylim()[1], " usable memory", fontsize=8, va="top")
    ax.set_xscale("log")
    ax.set_xlabel("memory per GPU (GB): state + activations, the heaviest stage")
    ax.set_ylabel("step time (s), the planner's model")
    ax.set_title(
        f"GPT-3 175B on 1,024 A100-80GB: {len(ests)} layouts costed; drop what does not fit,\n"
        "then take the shortest step (tools/layouts.plan)",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_capstone(path):
    plt = _plt()
    ranks, groups = capstone_groups()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    w, h, dx, dy = 1.8, 1.0, 2.6, 1.6  # a rank's box, and the step between boxes

    def spans(tokens):  # [0, 1, .., 7, 24, ..] -> "0-7, 24-31"
        runs, start = [], tokens[0]
        for a, b in zip(tokens, tokens[1:] + [None]):
            if b != a + 1:
                runs.append(f"{start}-{a}")
                start = b
        return ", ".join(runs)

    for rank, (d, c, tokens, experts) in ranks.items():
        x, y = dx * c, dy * (1 - d)
        ax.add_patch(plt.Rectangle((x, y), w, h, color=f"C{d}", alpha=0.25))
        ax.text(
            x + w / 2,
            y + h / 2,
            f"rank {rank}: dp {d}, cp {c}\ntokens {spans(tokens)}\nof each sequence"
            f"\nexperts {', '.join(map(str, experts))} of 4",
            ha="center",
            va="center",
            fontsize=8,
        )
    for a, _ in groups["cp"]:  # K and V around the ring: left box to right box
        y = dy * (1 - ranks[a][0]) + h / 2
        ax.annotate("", (dx, y), (w, y), arrowprops={"arrowstyle": "<->", "lw": 1.5})
        ax.text((w + dx) / 2, y + 0.08, "K, V\n(cp)", ha="center", fontsize=8)
    for a, _ in groups["ep"]:  # tokens to the experts: upper box to lower box
        x = dx * ranks[a][1] + w / 2
        arrow = {"arrowstyle": "<->", "lw": 1.5, "color": "tab:red", "ls": "--"}
        ax.annotate("", (x, dy), (x, h), arrowprops=arrow)
        ax.text(x + 0.08, (h + dy) / 2, "tokens (ep all-to-all)", color="tab:red", fontsize=8)
    ax.set_xlim(-0.1, dx + w + 0.1)
    ax.set_ylim(-0.1, dy + h + 0.1)
    ax.axis("off")
    ax.set_title(
        "Lesson 23 at N = 4: dp 2 x cp 2, ep 2 (dist.layout). Dense gradients: all-reduce over all 4"
        "\n(dp x cp); an expert's over the ranks that hold it (edp); the balance counts over cp",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_grid(path):
    plt = _plt()
    coords, groups = grid_groups()
    fig, ax = plt.subplots(figsize=(7.5, 3))
    colours = plt.get_cmap("tab10")
    per_node = 8
    for rank, (d, p, t) in coords.items():
        x, y = rank % per_node, 1 - rank // per_node
        ax.add_patch(
            plt.Rectangle((x + 0.05, y + 0.1), 0.9, 0.8, color=colours(2 * d + p), alpha=0.35)
        )
        ax.text(
            x + 0.5,
            y + 0.5,
            f"rank {rank}\ndp{d} pp{p} tp{t}",
            ha="center",
            va="center",
            fontsize=8,
        )
    for node in range(len(coords) // per_node):
        ax.add_patch(plt.Rectangle((0, 1 - node), per_node, 1, fill=False, lw=2))
        ax.text(per_node + 0.1, 1.5 - node, f"node {node}", va="center", fontsize=9)
    ax.set_xlim(0, per_node + 1.2)
    ax.set_ylim(0, 2)
    ax.axis("off")
    ax.set_title(
        "dp 2 x pp 2 x tp 4 on two 8-GPU nodes (dist.layout): a colour is one (dp, pp) tp group of 4 "
        "neighbours;\npp pairs sit in one node, dp replicas across nodes",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_fused(path):
    plt = _plt()
    kernels, (fwd, bwd) = fused_bytes()
    fig, ax = plt.subplots(figsize=(7.5, 2.4))
    colours = plt.get_cmap("tab10")
    left = 0
    for i, (name, nbytes) in enumerate(kernels):
        ax.barh(1, nbytes, left=left, color=colours(i), alpha=0.5, edgecolor="k")
        ax.text(left + nbytes / 2, 1, name, ha="center", va="center", fontsize=8)
        left += nbytes
    ax.text(left, 1, f"  {left / 1024:.0f} KiB", va="center", fontsize=8)
    for x0, nbytes, name in (
        (0, fwd, "forward: x in, y out"),
        (fwd, bwd, "backward: dy, x in, dx out"),
    ):
        ax.barh(0, nbytes, left=x0, color="tab:green", alpha=0.35, edgecolor="k")
        ax.text(x0 + nbytes / 2, 0, name, ha="center", va="center", fontsize=8)
    ax.text(fwd + bwd, 0, f"  {(fwd + bwd) / 1024:.0f} KiB", va="center", fontsize=8)
    ax.set_yticks([1, 0], ["eager\n(counted)", "fused\n(formula)"])
    ax.set_xlim(0, left * 1.15)
    ax.set_xlabel("bytes read + written, fp32, forward + backward of bias + GeLU on (64, 128)")
    ax.set_title(
        "Eager writes x + b and reads it back; the fused kernel reads each input once", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_young(path):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for c_s, (grid, cost, best) in checkpoint_overhead().items():
        (line,) = ax.plot(grid, [100 * c for c in cost], label=f"save stalls C = {c_s} s")
        ax.axvline(best, color=line.get_color(), ls=":", lw=1)
        ax.text(best, 4.6, f" T* = {best:.2f} h", color=line.get_color(), fontsize=8)
    ax.set_ylim(0, 5)
    ax.set_xlim(0, 8)
    ax.set_xlabel("checkpoint interval T (hours)")
    ax.set_ylabel("time lost (% of the run)")
    ax.set_title(
        "Saving stalls C/T, a failure loses T/2: least at T* = sqrt(2 C M), M = 112 h", fontsize=9
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_chinchilla(path):
    plt = _plt()
    frontier, table3, runs = compute_optimal()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.loglog([n for _, n, _ in frontier], [d for _, _, d in frontier], "k-", lw=1)
    ax.text(frontier[1][1], frontier[1][2] * 1.6, "D = 20 N (compute-optimal)", fontsize=8)
    for c, n, d in frontier:  # the line of equal compute through each budget: 6 N D = C
        ns = [n / 30, n * 30]
        ax.loglog(ns, [c / (6 * x) for x in ns], color="0.8", lw=0.8)
        ax.text(n * 1.1, d * 0.6, f"{c:.0e}", fontsize=7, color="0.5")
    ax.scatter(
        [n for n, _, _ in table3], [d for _, _, d in table3], s=14, label="Chinchilla, Table 3"
    )
    for name, n, d in runs:
        ax.scatter([n], [d], marker="*", s=70, color="tab:red")
        ax.text(n * 1.15, d, name.split(" (")[0], fontsize=7)
    ax.set_xlim(1e8, 3e12)
    ax.set_ylim(1e9, 1e14)
    ax.set_xlabel("parameters N")
    ax.set_ylabel("training tokens D")
    ax.set_title(
        "Grey: budgets C = 6 N D FLOPs; a run above the line has more tokens per parameter",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_allocations(path):
    plt = _plt()
    allocated = list(step_allocations().items())[:10]
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    names = [k.removeprefix("aten::") for k, _ in allocated]
    colours = ["tab:red" if k == "aten::bmm" else "tab:blue" for k, _ in allocated]
    ax.barh(names, [v / 2**20 for _, v in allocated], color=colours, alpha=0.6)
    ax.invert_yaxis()
    ax.set_xlabel("MiB allocated in one forward + backward (profile_memory=True)")
    ax.set_title(
        "Lesson 14's model: which ops allocate the step's memory\n(red: bmm, the attention's s x s scores "
        "and their gradients)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_moe(path):
    plt = _plt()
    experts, weights, seen, _, _ = moe_dispatch()
    tokens, n_experts = experts.shape[0], len(seen)
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    colours = plt.get_cmap("tab10")
    rows, y = {}, 0  # the expert-major buffer: each expert's rows, in token order
    for e in range(n_experts):
        for t in seen[e]:
            rows[t, e] = y
            ax.add_patch(plt.Rectangle((2, y), 1, 0.9, color=colours(e), alpha=0.45))
            ax.text(2.5, y + 0.45, f"t{t} -> e{e}", ha="center", va="center", fontsize=7)
            y += 1
    scale = y / tokens
    for t in range(tokens):
        for col in (0, 5):  # the tokens, before dispatch and after combine
            ax.add_patch(plt.Rectangle((col, t * scale), 1, 0.9 * scale, color="0.85"))
            ax.text(
                col + 0.5, (t + 0.45) * scale, f"token {t}", ha="center", va="center", fontsize=7
            )
        for j, e in enumerate(experts[t].tolist()):
            r = rows[t, e] + 0.45
            ax.plot([1, 2], [(t + 0.45) * scale, r], color=colours(e), lw=1)
            ax.plot([3, 5], [r, (t + 0.45) * scale], color=colours(e), lw=1, ls="--")
            ax.text(3.05, r - 0.1, f"x {weights[t, j]:.2f}", fontsize=6)  # its weight
    ax.text(0.5, -0.5, "route: top-2", ha="center", fontsize=8)
    ax.text(2.5, -0.5, "dispatch: expert-major", ha="center", fontsize=8)
    ax.text(5.5, -0.5, "combine: weighted sum", ha="center", fontsize=8)
    ax.set_xlim(-0.2, 6.2)
    ax.set_ylim(y + 0.2, -1)  # token 0 on top
    ax.axis("off")
    ax.set_title(
        f"MoE, {tokens} tokens, top-2 of {n_experts} experts (ep.dispatch_combine): each expert runs "
        "its rows at once",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_fp8(path):
    plt = _plt()
    x, scales = fp8_scales()
    fig, axes = plt.subplots(len(scales), 1, figsize=(7.5, 5.6), sharex=True)
    low = min(s.min().item() for s in scales.values())
    high = max(s.max().item() for s in scales.values())
    for ax, (name, s) in zip(axes, scales.items()):
        image = ax.imshow(s, aspect="auto", cmap="viridis", vmin=low, vmax=high)
        ax.set_ylabel(name, rotation=0, ha="right", va="center", fontsize=9)
        ax.set_yticks([])
    axes[-1].set_xlabel("channel (channel 0: the outlier, x 2^12); rows: tokens")
    fig.colorbar(image, ax=axes, label="log2 of the scale before the cast")
    fig.suptitle(
        "FP8 scaling (lesson 10): which elements share a scale with an outlier channel", fontsize=10
    )
    fig.savefig(path, dpi=DPI)


def draw_recompute(path):
    plt = _plt()
    trade = recompute_trade()
    modes = list(trade)
    fig, (left, right) = plt.subplots(1, 2, figsize=(7.5, 2.8))
    left.bar(modes, [trade[m][0] / 1024 for m in modes], color="tab:blue")
    left.set_ylabel("KiB kept by one layer")
    right.bar(modes, [trade[m][1] / 1e6 for m in modes], color="tab:orange")
    right.set_ylabel("MFLOP of one step")
    for ax, i in ((left, 0), (right, 1)):
        for x, m in enumerate(modes):
            scale = 1024 if i == 0 else 1e6
            ax.text(x, trade[m][i] / scale, f"{trade[m][i] / scale:,.0f}", ha="center", va="bottom")
    fig.suptitle(
        "Activation recompute (lesson 11): memory kept for backward, traded for FLOPs", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_spacing(path, lr=1e-3):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for name, points in format_spacing().items():
        kept = [(x, g) for x, g in points if g is not None]
        ax.plot([x for x, _ in kept], [g for _, g in kept], marker=".", label=name)
    ax.axhline(2 * lr, color="0.5", ls="--", lw=1)
    ax.text(
        2.0**-29,
        2 * lr * 1.5,
        f"2 x an update of {lr:g}: where a format's line is above, the update is lost",
        fontsize=8,
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("magnitude of the number (a weight)")
    ax.set_ylabel("spacing to the next number")
    ax.legend(fontsize=8)
    ax.set_title(
        "Number formats (lesson 09): bf16 has fp32's range and 2^16 x its spacing;\n"
        "fp16 holds nothing below 2^-24 or above 65,504",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_flops(path):
    plt = _plt()
    parts = flops_by_part()
    fig, ax = plt.subplots(figsize=(7, 2.8))
    names = list(parts)
    ax.barh(names, list(parts.values()), color="tab:blue")
    for y, name in enumerate(names):
        ax.text(parts[name], y, f" {parts[name]:,.0f}", va="center", fontsize=8)
    ax.invert_yaxis()  # the order a token meets them
    ax.set_xlim(0, 1.2 * max(parts.values()))
    ax.set_xlabel("forward FLOPs per token (FlopCounterMode), both layers")
    ax.set_title(
        "Where a GPT's FLOPs go (lesson 01): V = 512, s = 64, L = 2, h = 64; backward = 2 x",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_zeropp(path):
    plt = _plt()
    routes = zeropp_routes()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.6), sharey=True)
    colours = plt.get_cmap("tab10")
    names = list(routes)
    for side, ax in enumerate(axes):
        left = [0.0] * len(names)
        for k, collective in enumerate(COLLECTIVES):
            widths = [routes[s][collective][side] for s in names]
            ax.barh(names, widths, left=left, color=colours(k), label=collective)
            left = [a + b for a, b in zip(left, widths)]
        for y, total in enumerate(left):
            ax.text(total + 0.1, y, f"{total:.2f}", va="center", fontsize=8)
        ax.set_xlim(0, 9.5)
        ax.set_title(("inside a host (NVLink)", "across hosts (the slow link)")[side], fontsize=9)
        ax.set_xlabel("one rank, one micro-batch", fontsize=8)
    axes[0].invert_yaxis()
    axes[1].legend(fontsize=7, loc="lower right")
    fig.suptitle(
        "ZeRO-3 over R = 4 hosts x S = 8 ranks, bf16 weights, fp32 gradients, int8 codes:\n"
        "what crosses which link, bytes per parameter (formulas.zeropp_comm_bytes)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


def draw_onebit(path):
    plt = _plt()
    records, gaps = onebit_feedback()
    fig, axes = plt.subplots(1, 4, figsize=(9, 3.2), gridspec_kw={"width_ratios": [1, 1, 1, 1.6]})
    i = torch.arange(records[0][0].numel())
    for step, ax in enumerate(axes[:3]):
        x, error, sent, carried = records[step]
        ax.bar(i - 0.3, x + error, 0.3, color="0.6", label="x_t + e_t (to send)")
        ax.bar(i, sent, 0.3, color="tab:blue", label="C(.): sign x mean |.|")
        ax.bar(i + 0.3, carried, 0.3, color="tab:red", label="e_t+1: carried on")
        ax.axhline(0, color="k", lw=0.5)
        ax.set_title(f"step {step + 1}" + (" (e = 0)" if step == 0 else ""), fontsize=9)
        ax.set_xticks([])
        ax.set_ylim(-2.6, 2.6)
    axes[0].legend(fontsize=6, loc="lower right")
    steps = range(1, len(gaps) + 1)
    axes[3].plot(steps, [a for a, _ in gaps], label="error carried (feedback)")
    axes[3].plot(steps, [b for _, b in gaps], label="error dropped")
    axes[3].set_xlabel("step")
    axes[3].set_title("|sum sent - sum x_t|", fontsize=9)
    axes[3].legend(fontsize=7)
    fig.suptitle(
        "1-bit compression with error feedback (onebit.compress): what is not sent this step is "
        "added to the next",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)


DIAGRAMS = {
    "diagram_compose.png": draw_compose,
    "diagram_grid.png": draw_grid,
    "diagram_ring.png": draw_ring,
    "diagram_zero.png": draw_zero,
    "diagram_tp.png": draw_tp,
    "diagram_1f1b.png": draw_1f1b,
    "08_timeline_zb-h1_unit_clock.png": draw_zb_h1,
    "08_timeline_dualpipev_unit_clock.png": draw_dualpipev,
    "08_timeline_zb-h2_unit_clock.png": draw_zb_h2,
    "08_timeline_zb-v_unit_clock.png": draw_zb_v,
    "diagram_sp.png": draw_sp,
    "diagram_cp.png": draw_cp,
    "diagram_reshard.png": draw_reshard,
    "diagram_flash.png": draw_flash,
    "diagram_gqa.png": draw_gqa,
    "diagram_fused.png": draw_fused,
    "diagram_young.png": draw_young,
    "diagram_chinchilla.png": draw_chinchilla,
    "diagram_allocations.png": draw_allocations,
    "diagram_moe.png": draw_moe,
    "diagram_fp8.png": draw_fp8,
    "diagram_recompute.png": draw_recompute,
    "diagram_spacing.png": draw_spacing,
    "diagram_flops.png": draw_flops,
    "diagram_plan.png": draw_plan,
    "diagram_capstone.png": draw_capstone,
    "diagram_zeropp.png": draw_zeropp,
    "diagram_onebit.png": draw_onebit,
}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="draw the lessons' diagrams into lessons/figures/")
    p.add_argument("--figure", default=None, help="one diagram's path (default: all of them)")
    args = p.parse_args()
    paths = [Path(args.figure)] if args.figure else [FOLDER / name for name in DIAGRAMS]
    for path in paths:
        if path.name not in DIAGRAMS:
            sys.exit(
                f"lessons/diagrams.py: no diagram {path.name}; choose from {', '.join(DIAGRAMS)}"
            )
        DIAGRAMS[path.name](os.fspath(path))
        print(f"wrote {path}")
