"""Muon (--optimizer muon) in the layouts against one process: dp2 under ZeRO-1 and ZeRO-3, tp2
(GPT-2's fused qkv and Llama's q/kv/gate-up: each matrix gathered over tp and orthogonalized whole,
ZeRO-0 and ZeRO-1, sequence parallel too), pp2 and ep2 (a mixture of experts: each expert's
matrices orthogonalized alone), built by compose.build as train.py builds them; and a state
saved at dp2 under ZeRO-1 resumed in one process (resharding across layouts, by name).

Each layout sums its gradients in another order than one process, so the losses agree to
rounding: tolerance.layout_rtol over STEPS steps. Muon passes those differences on the way AdamW
does -- the orthogonalized update is a smooth function of the momentum, whose relative change is the
gradients' -- and its steps 2+ use the updated weights, so a wrong piece, owner or matrix shows as a
difference of the order of lr (checked: tp shards orthogonalized alone, without the gather, fail).
Tolerance: layout_rtol with V = 256, width = the model's widest sum, depth 2 x blocks + 1.
"""

import dataclasses
import io

import pytest
import torch

from nanomega import compose, dist, reshard, train, worlds
from nanomega.job import flags
from tolerance import layout_rtol

STEPS, SEQ, GLOBAL, VOCAB = 3, 16, 8, 256
COMMON = ["--n-layer", "2", "--n-head", "4", "--n-embd", "32", "--block-size", str(SEQ)]
COMMON += ["--attention", "eager", "--lr", "3e-3", "--device", "cpu", "--optimizer", "muon"]
DENSE = COMMON
LLAMA = COMMON + ["--arch", "llama", "--ffn-hidden", "64"]
EXPERTS = LLAMA + ["--n-experts", "4", "--top-k", "2"]
RTOL = layout_rtol(STEPS, vocab=VOCAB, width=64, depth=5)
# (name, flags, dp, pp, tp, ep, zero)
LAYOUTS = [
    ("tp2-zero0", DENSE, 1, 1, 2, 1, 0),
    ("tp2-sp-zero1", DENSE + ["--sequence-parallel"], 1, 1, 2, 1, 1),
    ("llama-tp2-zero1", LLAMA, 1, 1, 2, 1, 1),
    ("dp2-zero1", DENSE, 2, 1, 1, 1, 1),
    ("dp2-zero3", DENSE, 2, 1, 1, 1, 3),
    ("pp2-zero1", DENSE, 1, 2, 1, 1, 1),
    ("ep2-zero1", EXPERTS, 2, 1, 1, 2, 1),
]


def batch():
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (GLOBAL, SEQ + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def run(argv, dp, pp, tp, ep, zero, steps=STEPS, state=None):
    """`steps` steps of one layout on this rank -> losses, norms, whether this is the last stage,
    and the full state after them (reshard.full_state, as bytes). state: a full state to start
    from (reshard.import_by_name: saved in any layout)."""
    b = GLOBAL // dp // 2  # two micro-batches per step
    argv = argv + ["--pp", str(pp), "--tp", str(tp), "--ep", str(ep), "--zero", str(zero)]
    config = flags.parse(argv + ["--batch-size", str(b), "--grad-accum", "2"])
    config = dataclasses.replace(config, dp=dp, vocab_size=VOCAB)
    grid = dist.Grid(dp, pp, tp, ep=ep)
    model, engine, _ = compose.build(config, grid)
    if state is not None:
        reshard.import_by_name(engine, *torch.load(io.BytesIO(state)))
    x, y = batch()
    mine = slice(grid.dp_rank * GLOBAL // dp, (grid.dp_rank + 1) * GLOBAL // dp)
    batches = [(x[mine][i : i + b], y[mine][i : i + b]) for i in range(0, GLOBAL // dp, b)]
    out = dict(losses=[], norms=[], last=grid.last_stage, owners=engine.owners.table())
    for _ in range(steps):
        engine.set_lr(config.lr)
        loss = train.forward_backward(model, engine, grid, batches, config)
        loss = grid.dp.all_reduce(torch.as_tensor(loss, dtype=torch.float64).reshape(1)).item() / dp
        out["norms"].append(engine.step(clip_norm=1.0)["grad_norm"])
        out["losses"].append(loss)
    buf = io.BytesIO()
    torch.save(reshard.full_state(engine), buf)
    out["state"] = buf.getvalue()
    return out


def references():
    return dict(
        dense=run(DENSE, 1, 1, 1, 1, 0),
        experts=run(EXPERTS, 1, 1, 1, 1, 0),
        llama=run(LLAMA, 1, 1, 1, 1, 0),
    )


def layouts():
    return {name: run(argv, *rest) for name, argv, *rest in LAYOUTS}


@pytest.fixture(scope="module")
def runs():
    return worlds.launch(references, 1)[0], worlds.launch(layouts, 2)


@pytest.mark.parametrize("name", [name for name, *_ in LAYOUTS])
def test_muon_layout_equals_one_process(runs, name):
    ref, results = runs
    res = [r[name] for r in results if r[name]["last"]][0]
    want = ref["experts" if "ep2" in name else "llama" if "llama" in name else "dense"]
    for key in ("losses", "norms"):
        for got, w in zip(res[key], want[key]):
            assert abs(got - w) <= RTOL * abs(w), f"{name} {key}: {res[key]} vs {want[key]}"
    print(name, res["owners"] or "(no sharded matrix)")


def test_muon_state_saved_at_dp2_zero1_resumes_in_one_process(runs):
    """Resharding across layouts: STEPS - 1 steps at dp2 under ZeRO-1 (each matrix's momentum cut
    across the two ranks' shards), the full state by name, then the last step in one process: its
    loss, norm and weights within the layout tolerance of one process's uninterrupted run (the
    module's dense reference: run(DENSE, 1, 1, 1, 1, 0), STEPS steps)."""
    dp2 = worlds.launch(run, 2, DENSE, 2, 1, 1, 1, 1, STEPS - 1)[0]
    alone = worlds.launch(run, 1, DENSE, 1, 1, 1, 1, 0, 1, dp2["state"])[0]
    whole = runs[0]["dense"]
    assert abs(alone["losses"][0] - whole["losses"][-1]) <= RTOL * abs(whole["losses"][-1])
    assert abs(alone["norms"][0] - whole["norms"][-1]) <= RTOL * abs(whole["norms"][-1])
    got, want = (torch.load(io.BytesIO(r["state"]))[0] for r in (alone, whole))
    for k in want:
        a, b = got[k], want[k]
        if k.endswith("c_attn.bias"):  # keep q and v: the key bias's exact gradient is 0 (softmax
            a, b = a.view(3, -1)[0::2], b.view(3, -1)[0::2]  # ignores it), AdamW steps on noise
        # each step moves a weight by about lr (3e-3), a relative difference RTOL passing into it
        # unamplified (tests/test_tp.py); a lost or misplaced momentum moves it by about lr
        assert torch.allclose(a, b, rtol=RTOL, atol=RTOL * 3e-3), k


@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "gpt3-1.3b", "--pp", "2", "--world", "8", "--zero", "1"],
        ["--model", "mixtral-8x7b", "--pp", "2", "--world", "16", "--ep", "4", "--zero", "1"],
    ],
    ids=["gpt3-1.3b-pp2-dp4", "mixtral-pp2-dp8-ep4"],
)
def test_planner_counts_one_buffer_for_muon_matrices(argv):
    """The dry run (a rank built on meta, one step taken for the optimizer's state) against the
    planner. AdamW: equal up to each flat group's padding (< dp elements) and Adam's 4-byte step per
    piece (tests/test_meta.py's check). Muon saves 4 bytes per matrix element this rank steps; the
    planner says 1/dp of the stage's matrices, but ZeRO cuts the flat buffers by position, not by
    kind, so a rank's slice may hold up to all of the stage's other elements (norms, biases,
    embeddings) in place of matrix elements: |engine - planner| <= 4 x those (from the planner's
    own counts: 12 bytes per element under AdamW in bf16, 4 per matrix element saved)."""
    base = argv + ["--dtype", "bf16", "--grad-accum", "2", "--dry-run"]
    world = int(argv[argv.index("--world") + 1])
    for rank in (0, world - 1):
        adamw, muon_ = (
            train.main(base + ["--rank", str(rank), "--optimizer", name])
            for name in ("adamw", "muon")
        )
        engine, plan, slack = adamw["engine"], adamw["planner"], adamw["groups"] * adamw["dp"]
        assert abs(engine["optimizer"] - 4 * adamw["pieces"] - plan["optimizer"]) <= 12 * slack
        assert muon_["engine"]["params"] == engine["params"]
        assert muon_["engine"]["grads"] == engine["grads"]
        saved = engine["optimizer"] - muon_["engine"]["optimizer"]
        planned = plan["optimizer"] - muon_["planner"]["optimizer"]
        others = (plan["optimizer"] / 12 - planned / 4) * adamw["dp"]
        assert planned > 0.5 * plan["optimizer"] / 3  # most of a block is its matrices
        assert abs(saved - planned) <= 4 * others + 4 * adamw["pieces"] + 12 * slack
