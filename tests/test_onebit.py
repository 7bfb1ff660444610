"""1-bit Adam (nanomega/onebit.py): the compressor, error feedback, the bytes, and the dp2 engine
against a one-process simulation of the same algorithm.

Bitwise where the math guarantees it: the sign codes (a comparison and bit packing), the decoded
signs times a scale (exact), and the dp2 run against the simulation: every sum across ranks has two
terms (exact in either order), /2 is exact, and the rest is the same per-element arithmetic. A
scale is a fp64 sum rounded once to fp32: two fp64 sums in other orders differ by << 2^-24
relative, so the fp32 results are within 1 ulp (the test allows exactly that).
"""

import math

import numpy as np
import pytest
import torch
import torch.nn as nn

from nanomega import dist, onebit, worlds
from nanomega.tools import cost_link
from nanomega.tools.cost_link import Scheme
from nanomega.zero import ZeroEngine
from nanomega import zero_rules
from nanomega.zero_rules import weight_decay_groups

WARMUP, STEPS = 2, 5
OPTIM = dict(weight_decay=0.1, lr=1e-2, betas=(0.9, 0.95), warmup=WARMUP)


def _reference_compress(x, chunks):
    """numpy: signs packed little-endian, per chunk the exactly rounded mean |x| (math.fsum)."""
    a = x.numpy()
    codes = np.packbits(a >= 0, bitorder="little")
    rows = a.reshape(chunks, -1).astype(np.float64)
    scales = [np.float32(math.fsum(np.abs(r)) / r.size) for r in rows]
    return torch.from_numpy(codes), torch.tensor(scales)


def test_compressor_equals_an_independent_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * 8 * 37, generator=g)
    x[:5] = 0.0  # zero counts as +
    codes, scales = onebit.compress(x, 4)
    ref_codes, ref_scales = _reference_compress(x, 4)
    assert codes.dtype == torch.uint8 and codes.numel() == x.numel() // 8
    assert torch.equal(codes, ref_codes)
    ulp = torch.finfo(torch.float32).eps * ref_scales.abs()
    assert ((scales - ref_scales).abs() <= ulp).all()
    signs = torch.where(x >= 0, 1.0, -1.0)
    expected = (signs.view(4, -1) * scales.unsqueeze(1)).view(-1)
    assert torch.equal(onebit.decompress(codes, scales), expected)


def test_error_feedback_keeps_the_running_sum_within_the_derived_bound():
    """Error feedback: c_t = C(x_t + e_t), e_{t+1} = x_t + e_t - c_t, so sum c = sum x - e_T
    (telescoping). With mean-|v| scaling |v - C(v)|^2 = (1 - d(v)) |v|^2, d(v) = |v|_1^2 / (n
    |v|^2); with d >= d_min over the run, |e_{t+1}| <= q (|x_t| + |e_t|), q = sqrt(1 - d_min),
    so |e_T| <= q / (1 - q) max |x_t|: a bound independent of T. Without feedback the gap is the
    sum of T errors: with x_t = a fixed drift + noise (a momentum's shape) it grows with T."""
    g = torch.Generator().manual_seed(1)
    n, steps = 8 * 64, 300
    drift = torch.randn(n, generator=g) * 0.3
    xs = [drift + torch.randn(n, generator=g) for _ in range(steps)]

    def run(feedback):
        e, total, d_min = torch.zeros(n), torch.zeros(n, dtype=torch.float64), 1.0
        for x in xs:
            v = x + e if feedback else x
            d_min = min(d_min, float(v.abs().sum() ** 2 / (n * v.square().sum())))
            c = onebit.decompress(*onebit.compress(v, 1))
            e = v - c
            total += c.double()
        gap = (total - torch.stack(xs).double().sum(0)).norm().item()
        return gap, d_min

    gap, d_min = run(feedback=True)
    q = math.sqrt(1 - d_min)
    bound = q / (1 - q) * max(x.norm().item() for x in xs)
    assert gap <= bound, (gap, bound)
    planted, _ = run(feedback=False)  # no feedback: the test can fail
    assert planted > 3 * bound, (planted, bound)


def test_compressed_mean_on_one_rank_is_the_compressed_tensor():
    """One rank: the worker compresses per chunk (1 chunk), the server compresses again: the
    result is C(C(x)) = C(x) (signs kept, the mean |.| of +-s is s)."""
    axis = dist.Axis("dp", None, [0], 0, dist.CommLog())
    x = torch.randn(8 * 5)
    mean = onebit.CompressedMean(axis, x.numel())
    assert torch.equal(mean(x), onebit.decompress(*onebit.compress(x, 1)))
    assert onebit.wire_bytes(x.numel(), 1) == 0.0


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 5))


ONEBIT = Scheme(0, onebit=True)


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 7, generator=g), torch.randn(6, 5, generator=g)


def _loss(model, step, rank):
    x, y = _batch(step, rank)
    return (model(x) - y).square().mean()


def _dp2(world):
    """STEPS steps of OneBitAdam at dp2, stage 0: weights, per-step wire bytes on dp, the order of
    the optimizer's parameters (the flat momentum's order)."""
    grid, model = dist.Grid(world, 1, 1), _model()
    engine = ZeroEngine(model, onebit.OneBitAdam, weight_decay_groups(**OPTIM), grid, 0)
    names = {id(p.master): p.name for p in engine.pieces}
    order = [names[id(p)] for g in engine.optimizer.param_groups for p in g["params"]]
    wire = []
    for step in range(STEPS):
        grid.log.reset()
        _loss(model, step, grid.dp.rank).backward()
        engine.step()
        wire.append(grid.log.wire_bytes("dp"))
    return dict(
        weights={k: v.detach().numpy().copy() for k, v in model.named_parameters()},
        wire=wire,
        order=order,
        sizes=[g.padded for g in engine.groups],
    )


def _simulate(order):
    """One process, two workers, the algorithm written out: warm-up steps average the gradients
    (AdamW), later ones keep each worker's momentum, averaged through the compressed mean with
    both errors (the test's own compressor)."""
    model, world = _model(), 2
    params = dict(model.named_parameters())
    decay = {k: OPTIM["weight_decay"] if params[k].dim() >= 2 else 0.0 for k in params}
    lr, (b1, b2), eps = OPTIM["lr"], OPTIM["betas"], 1e-8
    n = sum(p.numel() for p in params.values())
    pad = onebit.padded(n, world)
    m = [{k: torch.zeros_like(p) for k, p in params.items()} for _ in range(world)]
    v = {k: torch.zeros_like(p) for k, p in params.items()}
    e_w, e_s = [torch.zeros(pad) for _ in range(world)], [torch.zeros(pad // 2) for _ in range(2)]

    def c(x, chunks):
        codes, scales = _reference_compress(x, chunks)
        signs = torch.from_numpy(np.unpackbits(codes.numpy(), bitorder="little")).float() * 2 - 1
        return (signs.view(chunks, -1) * scales.unsqueeze(1)).view(-1)

    for step in range(STEPS):
        grads = []
        for r in range(world):
            model.zero_grad()
            _loss(model, step, r).backward()
            grads.append({k: p.grad.clone() for k, p in params.items()})
        t, frozen = step + 1, step >= WARMUP
        with torch.no_grad():
            if not frozen:
                g = {k: (grads[0][k] + grads[1][k]) / world for k in params}
                for r in range(world):
                    for k in params:
                        m[r][k].lerp_(g[k], 1 - b1)
                for k in params:
                    v[k].mul_(b2).addcmul_(g[k], g[k], value=1 - b2)
            else:
                sent = []
                for r in range(world):
                    for k in params:
                        m[r][k].lerp_(grads[r][k], 1 - b1)
                    flat = torch.cat([m[r][k].reshape(-1) for k in order])
                    x = torch.nn.functional.pad(flat, (0, pad - n)) + e_w[r]
                    cx = c(x, world)
                    e_w[r] = x - cx
                    sent.append(cx.view(world, -1))
                mean = []
                for s in range(world):  # server s: chunk s of every worker
                    y = (sent[0][s] + sent[1][s]) / world + e_s[s]
                    cy = c(y, 1)
                    e_s[s] = y - cy
                    mean.append(cy)
                flat = torch.cat(mean)[:n].split([params[k].numel() for k in order])
                for r in range(world):
                    for k, f in zip(order, flat):
                        m[r][k].copy_(f.view_as(m[r][k]))
            bc1, bc2 = 1 - b1**t, 1 - b2 ** min(t, WARMUP)
            for k, p in params.items():
                p.mul_(1 - lr * decay[k])
                p.addcdiv_(m[0][k], (v[k].sqrt() / math.sqrt(bc2)).add_(eps), value=-lr / bc1)
    return {k: p.detach().clone() for k, p in params.items()}


class NoFeedback(onebit.OneBitAdam):
    """A planted error: the compression errors dropped after every step (no error feedback)."""

    def step(self, closure=None):
        super().step()
        if self.mean is not None:
            self.mean.worker_error.zero_()
            self.mean.server_error.zero_()


RUN, RUN_WARMUP, EVAL = 120, 15, 10  # steps, 1-bit Adam's warm-up, held-out loss every EVAL


def _teacher_batch(step, rank, rows=32):
    """A fixed random teacher tanh(x A) B plus noise; step -1: the held-out set (2048 rows)."""
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(16, 32, generator=g) / 4, torch.randn(32, 4, generator=g) / 5
    g = torch.Generator().manual_seed(1000 * step + rank if step >= 0 else 10**6)
    x = torch.randn(rows, 16, generator=g)
    return x, torch.tanh(x @ a) @ b + 0.01 * torch.randn(rows, 4, generator=g)


def _convergence(grid):
    """RUN steps at dp2 of AdamW, 1-bit Adam and the planted NoFeedback: held-out losses."""
    held, curves = _teacher_batch(-1, 0, 2048), {}
    for name, cls in (("adamw", torch.optim.AdamW), ("onebit", onebit.OneBitAdam)) + (
        ("planted", NoFeedback),
    ):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
        options = dict(weight_decay=0.0, lr=1e-2, betas=(0.9, 0.95))
        options.update({} if cls is torch.optim.AdamW else dict(warmup=RUN_WARMUP))
        engine = ZeroEngine(model, cls, weight_decay_groups(**options), grid, 0)
        curves[name] = []
        for step in range(RUN):
            x, y = _teacher_batch(step, grid.dp.rank)
            (model(x) - y).square().mean().backward()
            engine.step()
            if step % EVAL == EVAL - 1 or step == RUN_WARMUP - 1:  # [0]: the warm-up's end
                with torch.no_grad():
                    curves[name].append((model(held[0]) - held[1]).square().mean().item())
    return curves


def _world2(world):
    return dict(_dp2(world), curves=_convergence(dist.Grid(world, 1, 1)))


@pytest.fixture(scope="module")
def world2():
    return worlds.launch(_world2, 2, 2)


def test_one_bit_adam_converges_as_adamw_and_without_feedback_it_does_not(world2):
    """Tang et al. 2021 claim 1-bit Adam converges as Adam does, sample for sample. The bound,
    stated: after RUN steps (the mean of the last 3 held-out losses), 1-bit Adam's loss is above
    AdamW's by at most 20% of what AdamW gained after the warm-up (where the three runs are still
    one; seen on AMD AVX2: 11.8%). The planted NoFeedback (the same compressor, errors dropped)
    must fail it (seen: 27.3%)."""
    curves = world2[0]["curves"]
    final = {k: sum(c[-3:]) / 3 for k, c in curves.items()}
    assert curves["onebit"][0] == curves["planted"][0] == curves["adamw"][0]  # the warm-up: AdamW
    gained = curves["adamw"][0] - final["adamw"]
    gap = {k: (final[k] - final["adamw"]) / gained for k in ("onebit", "planted")}
    assert gained > 0.3 * curves["adamw"][0], curves["adamw"]  # it learned after the warm-up
    assert gap["onebit"] <= 0.2, (gap, curves)
    assert gap["planted"] > 0.2, (gap, curves)


def test_dp2_equals_the_one_process_simulation_bitwise(world2):
    expected = _simulate(world2[0]["order"])
    for rank in (0, 1):
        for k, w in world2[rank]["weights"].items():
            w = torch.from_numpy(w)  # (numpy across the queue: a tensor would travel by fd)
            assert torch.equal(w, expected[k]), (rank, k, (w - expected[k]).abs().max())


def test_bytes_after_the_warmup_are_the_formula(world2):
    """Warm-up steps: the fp32 gradients all-reduced (2 (N-1)/N 4n); after it the compressed
    mean's signs and scales only (onebit.wire_bytes), 32x fewer up to the scales and padding."""
    n = sum(p.numel() for p in _model().parameters())
    for rank in (0, 1):
        wire = world2[rank]["wire"]
        assert wire[:WARMUP] == [2 * (2 - 1) / 2 * 4 * n] * WARMUP
        assert wire[WARMUP:] == [onebit.wire_bytes(n, 2)] * (STEPS - WARMUP)
    assert onebit.wire_bytes(n, 2) == 1 / 2 * onebit.padded(n, 2) / 8 * 2 + 8


def test_the_planner_prices_both_phases_as_counted(world2):
    """tools/cost_link.link_bytes, 2 hosts x 1 rank: AdamW's all-reduce over the engine's buffers
    (the warm-up) and 1-bit Adam's compressed mean (after it) = the Axis counts of the run; a planner
    that omits the optimizer (prices 1-bit as AdamW) is 32x off and fails."""
    n = sum(p.numel() for p in _model().parameters())
    for rank in (0, 1):
        wire, sizes = world2[rank]["wire"], world2[rank]["sizes"]
        price = [cost_link.link_bytes(s, sizes, n, 2, 1, 4) for s in (Scheme(0), ONEBIT)]
        assert price == [(0.0, wire[0]), (0.0, wire[-1])]
        assert cost_link.link_bytes(Scheme(0), sizes, n, 2, 1, 4) != (0.0, wire[-1])  # planted


def test_what_it_cannot_take_is_refused_in_one_line():
    with pytest.raises(ValueError, match="--zero 0 without --offload"):
        zero_rules.check_config(1, onebit.OneBitAdam)
    assert "--zero 0" in onebit.check(2, 0.0, 1, 1, "fp32")
    assert "--pp" in onebit.check(0, 0.0, 1, 2, "fp32")
    assert "bf16" in onebit.check(0, 0.0, 1, 1, "fp16")
    assert onebit.check(0, 0.0, 1, 1, "bf16") is None
