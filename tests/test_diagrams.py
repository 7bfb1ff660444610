"""The lessons' pictures of the ideas (lessons/diagrams.py) show what the code does: each computed
picture is held against the rule its lesson states, so a change in the code that breaks the rule
fails here, and one that keeps it redraws the same picture."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "lessons"))

import diagrams  # noqa: E402

from nanomega import schedules  # noqa: E402


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
    """Lesson 09's order: tensor parallel -> experts, context parallel -> pipeline stage ->
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


def test_every_diagram_draws(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot extra (matplotlib) draws the diagrams")
    for name, draw in diagrams.DIAGRAMS.items():
        draw(str(tmp_path / name))
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
