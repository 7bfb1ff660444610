"""The lessons' pictures of the ideas (lessons/diagrams.py) show what the code does: each computed
picture is held against the rule its lesson states, so a change in the code that breaks the rule
fails here, and one that keeps it redraws the same picture."""

import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "lessons"))

import diagrams  # noqa: E402

from nanomega import formulas, schedules  # noqa: E402


@pytest.mark.parametrize("n", [2, 4, 5])
def test_ring_sends_2n_minus_2_chunks_and_reduces_one_per_rank(n):
    sends = diagrams.ring_steps(n)
    for rank in range(n):
        mine = [s for s in sends if s[1] == rank]
        assert [s[0] for s in mine] == list(range(2 * (n - 1)))  # 2(n-1) chunks of B/n
        # reduce-scatter: at step t the chunk carries t + 1 ranks' contributions, its own last
        for step, _, chunk, ranks in mine[: n - 1]:
            assert len(ranks) == step + 1 and rank in ranks and chunk == (rank - step) % n
        # all-gather: only finished chunks travel; the first is the one this rank finished
        assert all(len(ranks) == n for _, _, _, ranks in mine[n - 1 :])
        assert mine[n - 1][2] == (rank + 1) % n


def test_zero_bytes_per_parameter_follow_the_stages():
    n = 4
    totals = {stage: sum(parts) for stage, parts in diagrams.zero_memory(n).items()}
    assert totals == {0: 18, 1: 2 + 4 + 12 / n, 2: 2 + (4 + 12) / n, 3: 18 / n}


def test_tp_splits_columns_then_rows():
    h, t = 8, 2
    owners = diagrams.tp_owners(h, t)
    fc, proj = owners["blocks.0.mlp.c_fc.weight"], owners["blocks.0.mlp.c_proj.weight"]
    for rank in range(t):
        rows = slice(rank * 4 * h // t, (rank + 1) * 4 * h // t)
        assert (fc[rows] == rank).all() and (proj[:, rows] == rank).all()


def test_sp_forward_is_gather_then_reduce_scatter_twice_per_layer_and_no_all_reduce():
    t, b, s, h = 2, 2, 16, 32
    trace = diagrams.sp_trace(n_layer=2, t=t, b=b, s=s, h=h)
    split, full = (t * b, s // t, h), (b, s // t, h)  # (b, s/t, h) per rank; t of them stacked
    activations = [op for op in trace if op[0] != "all_reduce"]
    # embedding: reduce-scatter into sequence shards; each layer: gather -> attention -> scatter,
    # gather -> MLP -> scatter; the LM head: one last gather
    want = [("reduce_scatter", split, full)]
    want += [("all_gather", full, split), ("reduce_scatter", split, full)] * 2 * 2
    want += [("all_gather", full, split)]
    assert activations == want
    # the only all-reduces are the vocabulary-parallel loss's few floats per row, not activations
    assert all(op[1][-1] != h or len(op[1]) < 3 for op in trace if op[0] == "all_reduce")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_reshard_pieces_cover_every_parameter_once_at_any_n(n):
    owned = diagrams.shard_pieces(n)
    for name, size in diagrams.RESHARD_PARAMS:
        ranges = sorted((a, b) for pieces in owned.values() for p, a, b in pieces if p == name)
        assert ranges[0][0] == 0 and ranges[-1][1] == size, name
        assert all(b1 == a2 for (_, b1), (a2, _) in zip(ranges, ranges[1:])), (
            name
        )  # no gap, no overlap
    # each rank owns ceil(80 / n) elements of the buffer, the last one what is left
    sizes = [sum(b - a for _, a, b in owned[r]) for r in range(n)]
    assert sizes == [min(-(-80 // n), 80 - r * -(-80 // n)) for r in range(n)]


def test_1f1b_picture_has_the_formula_bubble_and_p_minus_rank_in_flight():
    p, m = 4, 8
    traces = schedules.simulate(p, m, "1f1b")
    assert schedules.bubble_fraction(traces) == pytest.approx((p - 1) / (m + p - 1))
    for rank, trace in enumerate(traces):  # most micro-batches whose backward has not run yet
        live = [e.op == "F" or -1 for e in sorted(trace.events, key=lambda e: e.start)]
        assert max(sum(live[: i + 1]) for i in range(len(live))) == p - rank


def test_cp_ranks_hold_a_head_and_its_mirror_tail_with_equal_work():
    s, n = 16, 4
    held, work = diagrams.cp_chunks(s, n)
    size = s // (2 * n)
    for rank, positions in held.items():
        head, tail = rank, 2 * n - 1 - rank
        assert positions == [
            *range(head * size, (head + 1) * size),
            *range(tail * size, (tail + 1) * size),
        ]
    assert len(set(work.values())) == 1


def test_grid_puts_tp_neighbours_inside_a_node_and_dp_outermost():
    coords, groups = diagrams.grid_groups(dp=2, pp=2, tp=4)
    assert all(group == list(range(group[0], group[0] + 4)) for group in groups["tp"])
    assert all(r // 8 == coords_dp for r, (coords_dp, _, _) in coords.items())  # dp picks the node
    assert coords[5] == (0, 1, 1) and len(groups["pp"]) == 8 and len(groups["dp"]) == 8


def test_compose_order_is_the_lessons_order():
    """Lesson 15's order: tensor parallel -> experts, context parallel -> pipeline stage ->
    recompute -> fused kernels -> precision -> the engine (a new technique may add a step between)."""
    order = diagrams.compose_order()
    lesson = [
        "tp.apply_tensor_parallel",
        "ep.apply_expert_parallel",
        "cp.apply_context_parallel",
        "pp.build_stage",
        "recompute.apply_recompute",
        "fused.apply_fused",
        "precision.cast_model",
        "zero.ZeroEngine",
    ]
    assert [step for step in order if step in lesson] == lesson, order


def test_causal_tiles_are_the_lower_triangle():
    computed, t = diagrams.causal_tiles()
    assert len(computed) == t * (t + 1) // 2 and all(j <= i for i, j in computed)


def test_gqa_query_heads_read_their_group():
    assert diagrams.gqa_groups(8, 2) == [h // 4 for h in range(8)]
    assert diagrams.gqa_groups(6, 3) == [h // 2 for h in range(6)]


def test_fp8_picture_shares_scales_by_each_recipes_tile():
    """Lesson 10's rule, element by element: the scale is fmax / amax of the element's tile, the
    whole tensor (tensorwise), its row rounded down to a power of two (rowwise), its 1 x 16 tile
    (blockwise at the picture's block) and, for MXFP8, 2^-(floor(log2 amax) - 8) over 1 x 32."""
    x, scales = diagrams.fp8_scales(block=16)
    fmax = {"tensorwise": 448.0, "rowwise": 448.0, "blockwise": 448.0}  # E4M3 forward operands

    def tiles_amax(width):  # each element's tile's amax, 1 x width tiles
        r, k = x.shape
        amax = x.abs().view(r, k // width, width).amax(-1)
        return amax.repeat_interleave(width, 1)

    want = {
        "tensorwise": torch.log2(fmax["tensorwise"] / x.abs().amax()).expand_as(x),
        "rowwise": torch.floor(torch.log2(fmax["rowwise"] / x.abs().amax(1, keepdim=True))),
        "blockwise": torch.log2(fmax["blockwise"] / tiles_amax(16)),
        "mxfp8": -(torch.floor(torch.log2(tiles_amax(32))) - 8),
    }
    for name, got in scales.items():
        torch.testing.assert_close(got, want[name].expand_as(got), rtol=0, atol=1e-5, msg=name)
    # the outlier's tile: the whole tensor, every row, only 16 (32) channels of each row
    assert (scales["blockwise"][:, 16:] > scales["blockwise"][:, :1]).all()


def test_recompute_picture_keeps_the_input_and_pays_a_forward():
    """Lesson 11's rule on the picture's fp32 model: full recompute keeps only the block's input
    (4 b s h bytes) and adds one forward of every layer (24 b s h^2 + 4 b s^2 h matmul FLOPs);
    selective keeps less than none and adds QK^T's rerun (2 b s^2 h; P V is not rerun: lesson 11)."""
    s, b, h, n_layer = 64, 2, 32, 2
    trade = diagrams.recompute_trade(s, b, h, 4, n_layer, 128)
    forward = 24 * b * s * h * h + 4 * b * s * s * h
    assert trade["full"][0] == 4 * b * s * h
    assert trade["full"][1] - trade["none"][1] == n_layer * forward
    assert trade["selective"][1] - trade["none"][1] == n_layer * 2 * b * s * s * h
    assert trade["full"][0] < trade["selective"][0] < trade["none"][0]


def test_spacing_picture_follows_the_formats_bits():
    """Lesson 09's formats: the spacing at 2^k is 2^(k - m) (m stored mantissa bits: 7 bf16, 10
    fp16, 23 fp32) where the number is normal; fp16's subnormals are 2^-24 apart from 2^-24 to
    2^-14, and it holds no 2^k below 2^-24 or above 2^15."""
    mantissa = {"bfloat16": 7, "float16": 10, "float32": 23}
    for name, points in diagrams.format_spacing(range(-30, 18)).items():
        for x, gap in points:
            k = round(math.log2(x))
            if name == "float16" and not -24 <= k <= 15:
                assert gap is None, (name, k)
            elif name == "float16" and k < -14:
                assert gap == 2.0**-24, (name, k, gap)
            else:
                assert gap == 2.0 ** (k - mantissa[name]), (name, k, gap)


def test_flops_picture_is_lesson_01s_count():
    """Forward FLOPs per token, each part by lesson 01's formula: 2 x the weights a token multiplies
    (6 h^2 q, k, v; 2 h^2 the output; 8 h^2 each MLP matmul; 2 V h the head) and 4 s h for the two
    s x s products (every key counted: the causal half is not skipped by an eager matmul), x L."""
    V, s, L, h = 256, 16, 2, 32
    parts = diagrams.flops_by_part(V, s, L, h, 4, 4)
    assert parts == {
        "q, k, v": L * 6 * h * h,
        "QK^T, PV": L * 4 * s * h,
        "attention out": L * 2 * h * h,
        "MLP up": L * 8 * h * h,
        "MLP down": L * 8 * h * h,
        "LM head": 2 * V * h,
    }


def test_plan_picture_picks_the_fastest_layout_that_fits():
    """Lesson 21's picture: the pick fits in the usable memory and no layout that fits is faster;
    layouts beyond the memory line are drawn as not fitting."""
    ests, usable = diagrams.plan_points()
    fitting = [e for e in ests if e.fits]
    assert fitting and ests[0] in fitting
    assert ests[0].step_s == min(e.step_s for e in fitting)
    assert all(e.memory <= usable for e in fitting)
    assert any(not e.fits for e in ests) and all(e.memory > usable for e in ests if not e.fits)


def test_capstone_picture_places_experts_and_replicas_as_the_layout_does():
    """Lesson 23's picture: cp pairs share a dp index, ep pairs a cp index; an expert's replicas (edp)
    are the ranks that hold it, dp/ep x cp = 2 of them; each cp pair holds every token of a sequence
    once, head and mirrored tail (lesson 07); dense weights replicate over all 4."""
    ranks, groups = diagrams.capstone_groups()
    assert all(len({ranks[r][0] for r in g}) == 1 for g in groups["cp"])
    assert all(len({ranks[r][1] for r in g}) == 1 for g in groups["ep"])
    assert all(len({ranks[r][3] for r in g}) == 1 and len(g) == 2 for g in groups["edp"])
    held = sorted(e for g in groups["ep"] for r in g for e in ranks[r][3])
    assert held == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(sorted(ranks[a][2] + ranks[b][2]) == list(range(32)) for a, b in groups["cp"])
    assert ranks[0][2] == [*range(8), *range(24, 32)]
    assert groups["dp_cp"] == [[0, 1, 2, 3]]


def test_every_diagram_draws(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) draws the diagrams")
    for name, draw in diagrams.DIAGRAMS.items():
        draw(str(tmp_path / name))
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_fused_picture_counts_eager_bias_gelu_kernel_by_kernel():
    """Lesson 13's table: add 2n (+h), gelu 2n, gelu_backward 3n, the bias's sum n (+h), 8n + 2h in
    all, against the fused kernel's 5n."""
    rows, width = 64, 128
    kernels, (fwd, bwd) = diagrams.fused_bytes(rows, width)
    n, h = rows * width, width
    assert kernels == [
        ("add", 4 * (2 * n + h)),
        ("gelu", 4 * 2 * n),
        ("gelu_backward", 4 * 3 * n),
        ("sum", 4 * (n + h)),
    ]
    assert (fwd, bwd) == (4 * 2 * n, 4 * 3 * n)


def test_young_curve_is_least_at_sqrt_2_c_m():
    curves = diagrams.checkpoint_overhead(mtbf_h=112.0, saves_s=(120, 40))
    for c_s, (grid, cost, best) in curves.items():
        step = grid[1] - grid[0]
        assert abs(best - (2 * c_s / 3600 * 112.0) ** 0.5) <= step, c_s
        assert min(cost) == pytest.approx((2 * c_s / 3600 / 112.0) ** 0.5, rel=1e-4)
    assert round(curves[120][2], 2) == 2.73  # lesson 20's check line


def test_chinchilla_frontier_spends_each_budget_at_20_tokens_per_parameter():
    frontier, table3, runs = diagrams.compute_optimal()
    for c, n, d in frontier:
        assert 6 * n * d == pytest.approx(c) and d / n == pytest.approx(20)
    # the runs the picture places: GPT-3 under the line (1.7 tokens/parameter), Llama 3 8B above
    ratio = {name.split(" (")[0]: d / n for name, n, d in runs}
    assert ratio["GPT-3 175B"] < 20 < ratio["Llama 3 8B"]
    assert len(table3) == 7


def test_allocations_picture_shows_the_attention_bmm_bytes_of_lesson_19():
    lesson = diagrams.lesson_script("14_profiling.py")
    L, b, a, s, hd = lesson.L, lesson.B, lesson.A, lesson.S, lesson.H // lesson.A
    allocated = diagrams.step_allocations()
    assert allocated["aten::bmm"] == L * 4 * b * a * (2 * s * s + 4 * s * hd)
    assert list(allocated.values()) == sorted(allocated.values(), reverse=True)


def test_moe_dispatch_sends_each_expert_its_tokens_in_order_and_combines_by_weight():
    experts, weights, seen, x, y = diagrams.moe_dispatch(tokens=8, k=2, n_experts=4)
    for e, got in seen.items():  # expert-major, token order inside
        assert got == [t for t in range(8) if e in experts[t].tolist()], e
    # expert e multiplies by e + 1: token t's output is x_t sum_j w_tj (e_tj + 1)
    want = x * (weights * (experts + 1)).sum(-1, keepdim=True)
    assert torch.allclose(y, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("n", [3, 4])
def test_ring_all_reduce_is_the_sum_on_every_rank(n):
    """Lesson 03's ring (the `ring` exercise's function) on n threads: every rank ends with the sum
    of all ranks' tensors. Integers in float64: every order of the additions gives the same bits."""
    lesson = diagrams.lesson_script("03_collectives.py")
    g = torch.Generator().manual_seed(n)
    inputs = [torch.randint(-8, 8, (5 * n,), generator=g).double() for _ in range(n)]
    boxes, outs = [diagrams.queue.Queue() for _ in range(n)], {}

    def rank_main(r):
        outs[r] = lesson.ring_all_reduce(diagrams.ThreadRing(r, boxes), inputs[r].clone())

    diagrams.on_threads(n, rank_main)
    want = sum(inputs)
    for r in range(n):
        assert torch.equal(outs[r], want), (
            f"ring n={n} rank={r}: got {outs[r].tolist()}, want {want.tolist()}"
        )


def test_zeropp_routes_sum_to_the_formulas_and_follow_lesson_17s_table():
    S, R, b, bits, unit = 8, 4, 2, 8, 2**20
    N, routes = S * R, diagrams.zeropp_routes(S, R, b, bits, unit)
    P = N * unit
    totals = {
        s: [P * sum(c[side] for c in v.values()) for side in (0, 1)] for s, v in routes.items()
    }
    flags = {
        "plain ZeRO-3": {},
        f"qwZ int{bits}": dict(qwz=bits),
        "hpZ": dict(hpz=True),
        f"qgZ int{bits}": dict(qgz=bits),
        "all three": dict(qwz=bits, hpz=True, qgz=bits),
    }
    for scheme, kw in flags.items():  # each scheme's links, collective by collective, = the formula
        want = formulas.zeropp_comm_bytes([P], S, R, b, **kw)
        assert totals[scheme] == pytest.approx(list(want), rel=1e-12), scheme
    want = formulas.hybrid_comm_bytes(P, 3, S, R, 4, param_bytes=b)
    assert totals["hybrid, shard S"] == pytest.approx(list(want), rel=1e-12)
    # the table's rules: plain crosses with everything; hpZ moves exactly the backward gather inside;
    # hybrid sends no gather across; qwZ's gather is bits/8 bytes + a 4-byte scale per block
    plain, hpz, hybrid = routes["plain ZeRO-3"], routes["hpZ"], routes["hybrid, shard S"]
    assert all(inside == 0 for inside, _ in plain.values())
    assert (
        hpz["backward gather"] == ((S - 1) / S * b, 0)
        and hpz["forward gather"] == plain["forward gather"]
    )
    assert hybrid["forward gather"][1] == hybrid["backward gather"][1] == 0
    block = formulas.quant_block(unit)
    qwz = routes[f"qwZ int{bits}"]["forward gather"][1]
    assert qwz == pytest.approx((N - 1) / N * (bits / 8 + 4 / block), rel=1e-12)


def test_onebit_picture_carries_the_error_and_its_sum_telescopes():
    records, gaps = diagrams.onebit_feedback(n=8, steps=40)
    true = sent_sum = 0
    for x, error, sent, carried in records:
        send = x + error
        # C: every element +-s, s = mean |x + e| (fp32, rounded once), with x + e's sign
        s = send.abs().mean()
        assert torch.allclose(sent.abs(), s.expand(8), rtol=2**-23, atol=0)
        assert torch.equal(sent > 0, send >= 0)
        # the contraction of lesson 18's formula: |e'|^2 = |x + e|^2 - |x + e|_1^2 / n
        want = send.norm() ** 2 - send.abs().sum() ** 2 / 8
        assert carried.norm() ** 2 == pytest.approx(want.item(), rel=1e-5, abs=1e-6)
        true, sent_sum = true + x, sent_sum + sent
    # error feedback: sum of what was sent = sum of x_t - the error still carried (fp64 sums)
    assert torch.allclose(sent_sum, true - records[-1][3], rtol=0, atol=1e-12)
    # the picture's claim, for its seed: the carried error stays small, the dropped one grows
    assert gaps[-1][0] < 0.2 * gaps[-1][1]
