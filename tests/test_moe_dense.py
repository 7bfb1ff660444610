"""DeepSeek-V3's dense blocks before MoE ones (--first-k-dense): 2 dense + 2 MoE blocks, laid out
dp2 x ep2 x pp2 (stage 0 holds only the dense blocks: it still joins the step's routing statistics)
and dp2 x ep2 x tp2, against one process.

Claims:
    build    blocks 0-1 hold one SwiGLU of --dense-ffn-hidden (or (k + shared) f), blocks 2-3 the
             router and experts; every rank's pieces are the dense model's values (by name)
    layouts  the expert loads of every MoE layer at every step equal exactly (every routing
             decision agrees), the dense layers' rows stay zero; losses and gradient norms within
             tolerance.layout_rtol (test_moe's bound, depth 4 x 4 + 1)
    planner  cost.stage_params per pipeline stage = the parameters the stage holds
Tolerance: layout_rtol with V = 256, width 64, depth 17, test_moe.STEPS steps.
"""

import pytest

from nanomega.model import GPT

from nanomega import worlds
from nanomega.tools import cost
from nanomega.gpt_config import SHAPE_KEYS
from nanomega.job import flags
from tolerance import layout_rtol

import test_moe

RTOL = layout_rtol(test_moe.STEPS, vocab=test_moe.VOCAB, width=64, depth=17)
DENSE = test_moe.BASE + ["--n-layer", "4", "--first-k-dense", "2", "--shared-experts", "1"]
# (name, dp, pp, tp, ep, batch-size, grad-accum, zero)
LAYOUTS = [("dp2-ep2-pp2", 2, 2, 1, 2, 2, 2, 1), ("dp2-ep2-tp2", 2, 1, 2, 2, 2, 2, 0)]


def layouts():
    return {name: test_moe.run(DENSE, *layout) for name, *layout in LAYOUTS}


@pytest.fixture(scope="module")
def runs():
    ref = worlds.launch(test_moe.run, 1, DENSE, 1, 1, 1, 1, test_moe.GLOBAL, 1, 0)[0]
    return ref, worlds.launch(layouts, 4)


def test_dense_blocks_before_moe_ones():
    cfg = flags.model_config(flags.parse(DENSE + ["--dense-ffn-hidden", "96"]))
    model = GPT(cfg, seed=0)
    kinds = [type(b.mlp).__name__ for b in model.blocks.values()]
    assert kinds == ["GatedMLP", "GatedMLP", "MoE", "MoE"], kinds
    assert model.blocks["1"].mlp.gate_up.weight.shape == (2 * 96, 32)
    default = flags.model_config(flags.parse(DENSE))
    assert default.dense_ffn == (2 + 1) * 64  # an MoE block's active width: top-2 + 1 shared

    # the planner's per-stage parameters are the model's (dense stages and MoE ones differ)
    shape = cost.Model.from_shape({k: getattr(cfg, k) for k in SHAPE_KEYS})
    per_stage = [
        sum(p.numel() for n, p in model.named_parameters() if n.split(".")[1] in "01"),
        sum(p.numel() for n, p in model.named_parameters() if n.split(".")[1] in "23"),
    ]
    embed, head = cfg.padded_vocab_size * 32, 32 + cfg.padded_vocab_size * 32  # pp2: a head copy
    assert cost.stage_params(shape, pp=2) == [per_stage[0] + embed, per_stage[1] + head]


def test_layouts_equal_one_process(runs):
    ref, results = runs
    for name, *_ in LAYOUTS:
        res = [r[name] for r in results if r[name]["last"]][0]
        assert all(r[name]["same"] for r in results), f"{name}: a rank's values differ"
        for step, (got, want) in enumerate(zip(res["loads"], ref["loads"])):
            assert got == want, f"{name} step {step + 1}: loads {got} != {want}"
            assert got[0] == got[1] == [0.0] * 4 and all(sum(row) > 0 for row in got[2:])
        for key in ("losses", "norms"):
            for got, want in zip(res[key], ref[key]):
                assert abs(got - want) <= RTOL * abs(want), (name, key, res[key], ref[key])


def test_deepseek_v3_dry_run_at_its_published_layout():
    """The deepseek-v3 preset at DeepSeek-V3's own layout (arXiv 2412.19437 Sec. 3.2: 16-way
    pipeline, 64-way expert parallelism, ZeRO-1 data parallelism on 2,048 H800s; no tp), ranks 0
    and 2047 built on paper: the planner's bytes are the engine's (the first stage holds the 3
    dense blocks and 1 MoE block, the last 3 MoE blocks and the head: 61 = 13 x 4 + 3 x 3)."""
    from test_meta import assert_planner_is_engine, dry_run

    base = ["--model", "deepseek-v3", "--router", "deepseek_v3", "--n-group", "8"]
    base += ["--topk-group", "4", "--routed-scaling", "2.5", "--pp", "16", "--ep", "64"]
    base += ["--world", "2048", "--zero", "1", "--dtype", "bf16", "--grad-accum", "16"]
    for rank in (0, 2047):
        res = dry_run([*base, "--rank", str(rank)])
        assert_planner_is_engine(res)
        # 4 of each MoE block's 256 experts: rank 0 holds 3.1e9 parameters (6.2 GB in bf16: its
        # dense blocks and the embedding); one MoE block's 256 experts alone would be 22.5 GB
        assert res["engine"]["params"] < 8e9
