"""FP8 training (--fp8, nanomega/fp8_linear.py): it learns, its GEMMs are the recipe's arithmetic,
and every layout (dp2, pp2, tp2 (+SP), cp2, ep2) equals one process (ep2: one process running the
union of both ranks' micro-batches); ZeRO-3 gathers the weights in FP8 (nanomega/fp8_gather.py:
tensorwise and blockwise, also under tp) and equals ZeRO-2 bitwise.

A layout test keeps the micro-batches of the one-process run (batch 2, 4 micro-batches of the
global batch 8), so every current scale is taken over the same tensor; the fp32 runs of these
layouts are bitwise the one-process run (asserted here), and so the FP8 runs must be too.
GEMM tolerance (derived): the products of fp8 values are exact in fp32 (4 x 4 significant bits),
so a GEMM of K terms differs from the fp32 product of the dequantized operands only by the order
of its fp32 sums (2 gamma(K) relative to sum |terms|) and the scales' products (a few u).
"""

import dataclasses
import shutil

import pytest
import torch
import torch.nn.functional as F

from nanomega import (
    checkpoint,
    dist,
    ep,
    fp8,
    fp8_gather,
    fp8_linear,
    reshard,
    tp,
    train,
    worlds,
    zero3,
)
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT
from test_layouts import curve, flags
from tolerance import gamma, layout_rtol, unit_roundoff

CORPUS_CHARS = 200_000
STEPS = 3
COMMON = [
    "--n-layer",
    "2",
    "--n-head",
    "4",
    "--n-embd",
    "32",
    "--block-size",
    "32",
    "--dropout",
    "0",
    "--max-steps",
    str(STEPS),
    "--warmup",
    "1",
    "--lr",
    "3e-3",
    "--eval-every",
    str(STEPS),
    "--eval-iters",
    "1",
    "--log-every",
    "100",
    "--peak-flops",
    "1e11",
    "--save-every",
    "2",
]
RTOL = layout_rtol(STEPS, vocab=4096, width=128, depth=9)
RECIPES = ["tensorwise", "delayed", "rowwise", "blockwise", "mxfp8"]
ONE = ["--batch-size", "2", "--grad-accum", "4"]
DP2 = ["--zero", "1", "--batch-size", "2", "--grad-accum", "2"]
ZERO2, ZERO3 = (["--zero", z, "--batch-size", "2", "--grad-accum", "2"] for z in "23")
LAYOUTS = [
    ("dp2-zero1", DP2, "tensorwise"),
    ("dp2-zero2", ZERO2, "tensorwise"),
    ("dp2-zero3", ZERO3, "tensorwise"),  # the weights gathered in FP8
    ("dp2-zero1", DP2, "mxfp8"),
    ("pp2", ["--pp", "2", *ONE], "blockwise"),
    ("pp2", ["--pp", "2", *ONE], "rowwise"),
    ("tp2", ["--tp", "2", *ONE], "tensorwise"),
    ("cp2", ["--cp", "2", *ONE], "tensorwise"),  # the amax over cp
    ("cp2", ["--cp", "2", *ONE], "rowwise"),  # dW's rows along the tokens: their amax over cp
    ("tp2", ["--tp", "2", *ONE], "blockwise"),
    ("tp2-sp", ["--tp", "2", "--sequence-parallel", *ONE], "tensorwise"),  # dX, dW by role
    ("tp2-sp", ["--tp", "2", "--sequence-parallel", *ONE], "blockwise"),
]

# ep2 (MoE): an expert's GEMMs hold both ep ranks' tokens, so the reference is one process running
# their union: ep2 at 4 sequences per rank, one micro-batch each (data.py gives rank r sequences
# [4r, 4r + 4) of the step's 8), against one process at one micro-batch of those 8
MOE = ["--arch", "llama", "--n-experts", "4", "--top-k", "2", "--ffn-hidden", "64"]
MOE += ["--shared-experts", "1"]  # a dense MLP inside the MoE layer: its amax over ep
EP2, UNION = (["--batch-size", b, "--grad-accum", "1", *MOE] for b in "48")
EP_RECIPES = ["tensorwise", "rowwise", "blockwise"]
# the Llama MoE block's reductions: q, kv, o, scores, AV, router, gate_up, down per layer (<= 64
# terms: the expert width), 2 layers + head
RTOL_MOE = layout_rtol(STEPS, vocab=4096, width=64, depth=2 * 8 + 1)
# ZeRO-3 with the FP8 gather against ZeRO-2, bitwise: a bf16 model (codes from bf16 shards,
# dequantized into bf16), blockwise (tiles straddling the shards: their amax MAXed), tp2 (a tp
# shard's amax MAXed over tp too; dp 1: the gather's own arithmetic, no reduction around it)
DP2_MB = ["--batch-size", "2", "--grad-accum", "2"]
GATHERS = {
    "bf16": [*DP2_MB, "--dtype", "bf16", "--fp8", "tensorwise"],
    "blockwise": [*DP2_MB, "--fp8", "blockwise", "--fp8-block", "16"],
    "tp2": [*ONE, "--tp", "2", "--fp8", "tensorwise"],
}


def recipe_flags(name):
    return ["--fp8", name, "--fp8-block", "16"] if name != "off" else []


CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("name", RECIPES)
def test_gemms_are_the_recipes_arithmetic(name, device):
    """Forward and both backward GEMMs of the entry = fp32 products of the operands as the recipe
    quantizes them (independently re-quantized here), within the derived bound; and within a few
    percent of the fp32 linear (a wrong scale or a lost tile is off by far more). The cuda case
    (GPU tier, not run in the session that wrote it) runs torch._scaled_mm's CUDA kernels."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 24, 64, generator=g).to(device).requires_grad_()  # M = 48: MX pads to 64
    w = (torch.randn(48, 64, generator=g) * 0.05).to(device).requires_grad_()
    dy = torch.randn(2, 24, 48, generator=g).to(device)
    entry = fp8_linear.FP8(name, block=16)
    for _ in range(2):  # delayed: the second call quantizes with the first's history
        y = entry(x, w)
        dx, dw = torch.autograd.grad(y, (x, w), dy)
    r = entry.recipe

    def q(t, role):  # the recipe's quantization of an operand along its K, by fp8.py
        rows, cols = r.weight if role == "w" else r.act
        t = fp8_linear.pad_to(t, rows, cols)
        fmt = r.grad if role == "dy" else fp8.E4M3
        if r.gemm == "mx":
            return fp8.quantize_mx(t, fmt).dequantize()
        return fp8.quantize(t, fmt, rows, cols, pow2=r.pow2).dequantize()

    x2, dy2 = x.detach().flatten(0, 1), dy.flatten(0, 1)
    wd = w.detach()
    for got, a, b, K in [
        (y.detach().flatten(0, 1), q(x2, "x"), q(wd, "w"), 64),
        (dx.flatten(0, 1), q(dy2, "dy"), q(wd.t(), "w"), 48),
        (dw, q(dy2.t(), "dy"), q(x2.t(), "x"), 48),
    ]:
        M, N = got.shape
        want = (a @ b.t())[:M, :N]
        bound = (2 * gamma(K) + 4 * unit_roundoff(torch.float32)) * (a.abs() @ b.abs().t())[:M, :N]
        assert ((got - want).abs() <= bound).all(), name
    exact = F.linear(x.detach(), wd)
    assert (y - exact).norm() / exact.norm() < 0.1
    assert 0 < (y - exact).norm() / exact.norm()  # it is FP8, not fp32


def same_scales():
    """A weight split over tp (by rows, by columns): each rank's tensorwise scale is the whole
    weight's, and its shard of q the whole q's (the amax all-reduced with MAX over tp)."""
    grid = dist.Grid(1, 1, 2)
    w = torch.randn(8, 6, generator=torch.Generator().manual_seed(0)) * 3
    whole = fp8.quantize(w, fp8.E4M3)
    for dim in (0, 1):
        shard = w.chunk(2, dim)[grid.tp_rank]
        q = fp8_linear.FP8("tensorwise", tp=grid.tp).operand(shard, "w", None)
        assert torch.equal(q.scale_inv, whole.scale_inv)
        assert torch.equal(q.data.float(), whole.data.float().chunk(2, dim)[grid.tp_rank])


def same_scales_over_cp():
    """Tokens split over cp: a tensorwise operand's scale is the whole tensor's (amax MAX over cp),
    and a rowwise dW operand (rows along the tokens, K split over cp) gets each whole row's scale;
    their q are the whole q's shards, bitwise."""
    grid = dist.Grid(1, 1, 1, 2)
    t = torch.randn(6, 8, generator=torch.Generator().manual_seed(1)) * 3
    for name, role, dim, tokens in [("tensorwise", "x", 0, False), ("rowwise", "dy", 1, True)]:
        entry = fp8_linear.FP8(name, cp=grid.cp)
        rows, cols = entry.recipe.act
        whole = fp8.quantize(t, fp8.E4M3, rows, cols, pow2=entry.recipe.pow2)
        q = entry.operand(t.chunk(2, dim)[grid.cp.rank], role, None, tokens=tokens)
        assert torch.equal(q.scale_inv, whole.scale_inv), name
        assert torch.equal(q.data.float(), whole.data.float().chunk(2, dim)[grid.cp.rank]), name


def sequence_parallel_roles():
    """tp2 + SP: the gather-linear's backward GEMMs reach the FP8 entry with their roles (dY as a
    gradient: E5M2 under tensorwise; dW's operands along the tokens), as FP8Function's do."""
    grid, entry, seen = dist.Grid(1, 1, 2), fp8_linear.FP8("tensorwise"), []
    operand = entry.operand
    entry.operand = lambda t, role, w, wt=False, tokens=False: (
        seen.append((role, wt, tokens)) or operand(t, role, w, wt, tokens)
    )
    torch.manual_seed(0)
    w = torch.randn(8, 6, requires_grad=True)
    x = torch.randn(2, 4, 6, requires_grad=True)  # (b, s/t, h)
    tp.LinearWithSequenceGather.apply(x, w, None, grid.tp, entry).sum().backward()
    forward = [("x", False, False), ("w", False, False)]
    dgrad, wgrad = (
        [("dy", False, False), ("w", True, False)],
        [("dy", False, True), ("x", False, True)],
    )
    assert seen == forward + dgrad + wgrad, seen


def same_scales_over_ep():
    """ep2, one MoE layer (routed experts, a shared expert, attention): every FP8 GEMM quantizes
    with the scale one process computes on the union of both ranks' tokens, forward and backward.
    A dense weight's operands hold this rank's tokens: their amax MAX over ep; a routed expert's
    rows came from both ranks already: its own amax (reduced over ep, it would take the other
    rank's experts' amax: wrong). Each weight's scales and codes, in call order, = the union's."""
    grid = dist.Grid(2, ep=2)
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=32, arch="llama")
    # no aux loss: its gradient is a mean over the micro-batch's sequences (2 here, 4 in the union)
    cfg = dataclasses.replace(cfg, n_experts=4, ffn_hidden=32, shared_experts=1, moe_aux_loss=0.0)
    idx = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(2))  # the union
    seen = {}
    for world in ("union", "ep2"):
        model = GPT(cfg, seed=0)
        names = {id(p): k for k, p in model.named_parameters()}
        if world == "ep2":
            ep.apply_expert_parallel(model, grid.ep)
        entry = fp8_linear.apply_fp8(model, "tensorwise", ep=grid.ep if world == "ep2" else None)
        log, operand = seen.setdefault(world, {}), entry.operand

        def record(t, role, w, wt=False, tokens=False, log=log, operand=operand, names=names):
            q = operand(t, role, w, wt, tokens)
            log.setdefault(names[id(w)], []).append((role, q.scale_inv, q.data.view(torch.uint8)))
            return q

        entry.operand = record
        x = idx if world == "union" else idx.chunk(2)[grid.ep.rank]  # (4, 8) or this rank's (2, 8)
        model(x).float().sum().backward()
    union, mine = seen["union"], seen["ep2"]
    assert any(".experts." in k for k in mine) and any(".shared." in k for k in mine)
    for name, calls in mine.items():
        want = union[name]
        assert [r for r, _, _ in calls] == [r for r, _, _ in want], name
        assert all(torch.equal(a[1], b[1]) for a, b in zip(calls, want)), name
        if ".experts." in name:  # the same rows in the same order: the codes too
            assert all(torch.equal(a[2], b[2]) for a, b in zip(calls, want)), name


class Linear(torch.nn.Linear):
    """A linear through an FP8 entry (as seams.Linear through its op table)."""

    def forward(self, x):
        return self.entry(x, self.weight, self.bias)


def gathered_in_fp8(name):
    """ZeRO-3 over dp2 with the FP8 wire, two linears (60 and 40 weight elements: each weight split
    between the ranks; the first's amax only in rank 1's half; blockwise: 4 x 4 tiles, some
    straddling the shards' edge): each weight's gathered codes and scales are one process's
    quantization of the whole weight, bitwise; forward, dX and dW equal the unsharded FP8 module's
    bitwise; the bytes = fp8_gather's formula (1 per element, 4 per tile's amax)."""
    grid, entry = dist.Grid(2), fp8_linear.FP8(name, block=4)
    torch.manual_seed(0)  # the same model and input on both ranks
    model = torch.nn.Sequential(Linear(6, 10), Linear(10, 4))
    for m in model:
        m.entry, m.weight.fp8_weight = entry, True
    with torch.no_grad():
        model[0].weight[-1, -1] = 7.0  # flat offset 59: rank 1's half
    whole = {k: p.detach().clone() for k, p in model.named_parameters()}
    x = torch.randn(3, 6, requires_grad=True)
    ref = model(x)  # unsharded: the entry quantizes each whole weight
    ref_dx, ref_dw = torch.autograd.grad(ref.sum(), (x, model[0].weight))

    wire = fp8_gather.FP8Gather(entry.recipe.weight)
    sharded = zero3.ShardedParameters(model, list(model.named_parameters()), grid.dp, wire=wire)
    grid.log.reset()
    y = model(x)
    assert torch.equal(y, ref), name
    y.sum().backward()
    assert torch.equal(x.grad, ref_dx) and torch.equal(model[0].weight.grad, ref_dw), name
    wired = [g for g in sharded.groups if sharded.wired(g.params[0])]
    assert [g.padded for g in wired] == [60, 40]
    n_tiles = 2 if name == "tensorwise" else 3 * 2 + 1 * 3  # (10, 6) and (4, 10) in 4 x 4 tiles
    counts = {(op, dt): b for (op, _, dt), (_, b) in grid.log.counts.items()}
    assert counts[("all_gather", "uint8")] == 2 * (60 + 40)  # forward and backward: N S bytes
    assert counts[("all_reduce", "float32")] == 2 * n_tiles * 4  # one fp32 amax per tile, gather
    assert counts[("all_gather", "float32")] == 2 * 4 * (10 + 4)  # the biases, in fp32
    assert fp8_gather.step_bytes(sharded)[0] == 2 * (60 + 40) + 2 * n_tiles * 4

    for u, key in [(1, "0.weight"), (2, "1.weight")]:
        sharded.gather(u)
        got, rows, cols = sharded.units[u].weight.fp8_gathered, *entry.recipe.weight
        want = fp8.quantize(fp8_linear.pad_to(whole[key], rows, cols), fp8.E4M3, rows, cols)
        assert torch.equal(got.scale_inv, want.scale_inv), (name, key)
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)), (name, key)
        N, K = whole[key].shape
        assert torch.equal(sharded.units[u].weight.detach(), want.dequantize()[:N, :K]), key
        for g in sharded.unit_groups[u]:
            sharded.release(g)


def run_all(corpus, root):
    """Inside a world of 2: each layout and recipe in turn (one start-up for all)."""
    same_scales()
    same_scales_over_cp()
    sequence_parallel_roles()
    same_scales_over_ep()
    gathered_in_fp8("tensorwise")
    gathered_in_fp8("blockwise")
    for layout, extra, name in LAYOUTS:
        train.main(flags(corpus, root / f"{layout}-{name}", [*extra, *recipe_flags(name)], COMMON))
    for name in EP_RECIPES:
        extra = [*EP2, "--ep", "2", *recipe_flags(name)]
        train.main(flags(corpus, root / f"ep2-{name}", extra, COMMON))
    for kind, extra in GATHERS.items():  # each at ZeRO-2 and ZeRO-3 (the weights in FP8)
        for z in "23":
            train.main(flags(corpus, root / f"zero{z}-{kind}", [*extra, "--zero", z], COMMON))
    return True


@pytest.fixture(scope="module")
def one_process(corpus, tmp_path_factory):
    root = tmp_path_factory.mktemp("one")
    for name in ["off", *RECIPES]:
        train.main(flags(corpus, root / name, [*ONE, *recipe_flags(name)], COMMON))
    for name in EP_RECIPES:  # ep2's reference: one process, the union of its ranks' micro-batches
        train.main(flags(corpus, root / f"union-{name}", [*UNION, *recipe_flags(name)], COMMON))
    return root


def test_every_recipe_learns_near_fp32(one_process):
    """Each recipe's loss falls, and every step's stays within a tenth of fp32's 3-step fall of
    fp32's loss (the bound is set from that fall, not from this CPU's FP8 runs; measured here: < 1e-3
    of a 0.13 fall). A smoke test: it fails on NaN, saturation, no learning or a lost gradient; a
    forward scale off by 1.3x moves the loss only 0.004 at initialization (planted: it passes here),
    which test_gemms_are_the_recipes_arithmetic catches (planted: it fails)."""
    ref, _ = curve(one_process / "off")
    bound = (ref[0] - ref[-1]) / 10
    for name in RECIPES:
        losses, _ = curve(one_process / name)
        assert losses[-1] < losses[0] - 0.05, (name, losses)
        assert max(abs(a - b) for a, b in zip(losses, ref)) < bound, (name, losses, ref)


def test_layouts_equal_one_process(corpus, one_process, tmp_path):
    """pp2 (the same micro-batches): the losses after the first bitwise, the weights within
    test_layouts' tolerance (the gradient norm and the tied embedding's gradient are summed over the
    stages in another order, as in fp32). dp2 sums the ranks' gradients in another order, tp2
    the row-parallel partial sums (+SP: its backward GEMMs through seams.dgrad / wgrad, by role)
    and cp2 attention's and dW's sums over the tokens (their fp32 runs differ in the last bits
    too): losses within
    tolerance.layout_rtol, the fp32 bound, as an FP8 cast turns a small perturbation d into a
    rounding flip of one spacing D with probability about d / D: its mean effect is d, as in fp32.
    ep2 (MoE: tensorwise, rowwise, blockwise) against one process on the union batch: the
    same bound with the MoE block's depth (RTOL_MOE); its scales: same_scales_over_ep.
    ZeRO-3 (the weights gathered in FP8) = ZeRO-2 bitwise, losses and weights (GATHERS: fp32 and
    bf16 tensorwise, blockwise, tp2 tensorwise): their fp32 runs are (both reduce each
    micro-batch's gradients; test_zero.py's bitwise cases), and the gathered codes are the ones
    ZeRO-2's whole weights quantize to (gathered_in_fp8)."""
    worlds.launch(run_all, 2, corpus, tmp_path, timeout=600)
    for kind in ["dp2-tensorwise", *GATHERS]:
        z2, z3 = (
            tmp_path / (f"dp2-zero{z}-tensorwise" if kind[:3] == "dp2" else f"zero{z}-{kind}")
            for z in "23"
        )
        assert curve(z3) == curve(z2), kind
        got, want = (reshard.full_weights(checkpoint.latest(d)) for d in (z3, z2))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    for name in EP_RECIPES:  # ep2 (MoE) against one process running the union batch
        (losses, val), (ref_losses, ref_val) = (
            curve(tmp_path / f"ep2-{name}"),
            curve(one_process / f"union-{name}"),
        )
        assert losses == pytest.approx(ref_losses, rel=RTOL_MOE), ("ep2", name)
        assert val == pytest.approx(ref_val, rel=RTOL_MOE), ("ep2", name)
    for layout, _, name in LAYOUTS:
        out, ref = tmp_path / f"{layout}-{name}", one_process / name
        (losses, val), (ref_losses, ref_val) = curve(out), curve(ref)
        if layout.startswith(("dp2", "tp2", "cp2")):
            assert losses == pytest.approx(ref_losses, rel=RTOL), (layout, name)
            assert val == pytest.approx(ref_val, rel=RTOL), (layout, name)
            continue
        # the first reported loss: a mean of 8 micro-batches' losses, summed in another order
        assert losses[0] == pytest.approx(ref_losses[0], rel=2 * gamma(8)), (layout, name)
        assert losses[1:] == ref_losses[1:] and val == ref_val, (layout, name)
        got, want = (reshard.full_weights(checkpoint.latest(d)) for d in (out, ref))
        assert got.keys() == want.keys()
        for k in want:  # test_layouts' weight tolerance (the norm's sum over stages: another order)
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["blockwise", "mxfp8", "delayed"])
def test_resume_is_bitwise(one_process, tmp_path, corpus, name):
    """A current-scaling recipe keeps no state between steps (every scale is this tensor's): the
    step-2 checkpoint resumed ends bitwise the uninterrupted run (losses and weights). Delayed
    scaling's amax histories (and the last micro-batch's amax not yet in them) are in the
    checkpoint: resumed, it ends bitwise too (without them its scales restart at 1: it differs)."""
    out = tmp_path / "resumed"
    (out / "ckpt").mkdir(parents=True)
    shutil.copytree(one_process / name / "ckpt" / "step_000002", out / "ckpt" / "step_000002")
    (out / "ckpt" / "latest").write_text("step_000002")
    train.main(flags(corpus, out, [*ONE, *recipe_flags(name), "--resume"], COMMON))
    (losses, val), (ref, ref_val) = curve(out), curve(one_process / name)
    assert losses == ref[2:] and val == ref_val
    got, want = (reshard.full_weights(checkpoint.latest(d)) for d in (out, one_process / name))
    for k in want:
        assert torch.equal(got[k], want[k]), k
