"""Muon (nanomega/muon.py) and its owner-compute under ZeRO (nanomega/owners.py).

Newton-Schulz against the SVD: in exact arithmetic the iteration acts on each singular value alone,
s <- a s + b s^3 + c s^5, so U diag(p^5(s / |G|_F)) V^T (fp64 SVD) is its exact result. The bound is
a first-order one: iteration k adds its own rounding delta_k (its three matmuls, Frobenius norms,
gamma(n) each: Higham's Lemma 3.1 on every dot product) and passes the error before it through the
polynomial's Frechet derivative, whose gain on the matrix's spectrum s_k is at most L_k = the
largest divided difference |p(s_i) -+ p(s_j)| / |s_i -+ s_j| (and p(s)/s on a rectangle's
complement):
    |X_5 - X*|_F <= sum_k delta_k prod_{j>k} L_j
In fp64 that bound is ~1e-9, and a wrong coefficient (b + 1e-3: ~2e-2) or step count (~2) is far
outside it. In fp32 (what the engine runs) the same bound, with likely(n) for gamma(n), is ~0.5 --
too loose to be a test of the math, so fp32 is checked for what it must give: singular values in
p^5's band.

Distributed (2 gloo ranks, a GPT with a tied embedding, 4 steps of ACCUM micro-batches, clipping):
each ZeRO stage's gradients are summed in the order the same-stage AdamW tests state
(tests/test_zero.py: stages 0-1 a rank's micro-batches first, 2-3 the ranks of a micro-batch first),
and a + b is exact in either operand order at 2 ranks; the momentum and the decay are element-wise
and the orthogonalization runs on the same whole matrix: so ZeRO-1/2/3 equal ZeRO-0 bitwise (with
one micro-batch per step, all four orders are one), and equal one process summing in its order.
"""

import contextlib
import io

import pytest
import torch

from nanomega import dist, muon, reshard, worlds
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT
from nanomega.owners import balance
from nanomega.zero import ZeroEngine
from nanomega.zero_rules import check_config
from tolerance import gamma, layout_rtol, likely

A, B, C = muon.COEFFICIENTS
STEPS, CLIP, LR, WD = 4, 0.5, 1e-2, 0.1
SHAPES = [(48, 48), (192, 48), (48, 192), (144, 48)]
CONFIG = dict(vocab_size=100, block_size=16, n_layer=2, n_head=2, n_embd=48)


def _p(s):
    return A * s + B * s**3 + C * s**5


def _svd_reference(g, steps=muon.STEPS):
    """U diag(p^steps(s / |G|_F)) V^T in fp64: the iteration's exact result."""
    u, s, vh = torch.linalg.svd(g.double(), full_matrices=False)
    s = s / (g.double().norm() + 1e-7)
    for _ in range(steps):
        s = _p(s)
    return u @ torch.diag(s) @ vh


def _bound(g, dtype, err):
    """sum_k delta_k prod_{j>k} L_j (module docstring), Frobenius; err(n, dtype): gamma, likely."""
    s = torch.linalg.svdvals(g.double()) / (g.double().norm() + 1e-7)
    r, n, rect = min(g.shape), max(g.shape), g.shape[0] != g.shape[1]
    u = torch.finfo(dtype).eps / 2
    total = (err(n, dtype) + u) * s.norm().item()  # the normalization
    for _ in range(muon.STEPS):
        x, gram, poly = s.norm().item(), (s**2).norm().item(), (B * s**2 + C * s**4).norm().item()
        # gram = X X^T (n terms), gram @ gram (r terms), (b gram + c gram^2) @ X (r terms), a X + .
        delta = err(n, dtype) * x * x * (abs(B) + 2 * abs(C) * gram) * x
        delta += err(r, dtype) * (abs(C) * gram * gram + poly) * x
        delta += 3 * u * (abs(A) * x + (B * s**3 + C * s**5).norm().item() + _p(s).norm().item())
        si, sj = s[:, None], s[None, :]
        close = (si - sj).abs() < 1e-12
        diff = torch.where(close, A + 3 * B * si**2 + 5 * C * si**4, (_p(si) - _p(sj)) / (si - sj))
        gain = max(diff.abs().max().item(), ((_p(si) + _p(sj)) / (si + sj)).abs().max().item())
        if rect:
            gain = max(gain, (_p(s) / s).abs().max().item())
        total = gain * total + delta
        s = _p(s)
    return total


@pytest.mark.parametrize("shape", SHAPES)
def test_newton_schulz_is_the_polynomial_on_the_singular_values(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    want = _svd_reference(g)
    got = muon.newton_schulz(g, dtype=torch.float64)
    bound = _bound(g, torch.float64, gamma)
    err = (got - want).norm().item()
    assert err <= bound < 1e-6, (err, bound)
    # a planted error is far outside the bound: one step fewer, a coefficient off by 1e-3
    assert (muon.newton_schulz(g, 4, dtype=torch.float64) - want).norm() > 1e3 * bound
    wrong = _svd_reference(g, muon.STEPS - 1)
    assert (got - wrong).norm() > 1e3 * bound

    # fp32 (the engine's): within its (loose) bound, singular values in p^5's band of (0, 1]
    got32 = muon.newton_schulz(g)
    assert (got32.double() - want).norm().item() <= _bound(g, torch.float32, likely)
    band = _p(_p(_p(_p(_p(torch.linspace(1e-3, 1, 10001, dtype=torch.float64))))))
    sv = torch.linalg.svdvals(got32.double())
    u32 = torch.finfo(torch.float32).eps
    assert band.min() - 1e3 * u32 <= sv.min() and sv.max() <= band.max() + 1e3 * u32, sv


def _plain_muon_step(model, state, lr, wd):
    """Muon written again, plainly (Keller Jordan's muon_update, Moonlight's scale), on the hidden
    matrices whose .grad is set; returns the names it stepped."""
    done = []
    for name, p in model.named_parameters():
        if not muon.is_hidden_matrix(name, p):
            continue
        g = p.grad
        buf = state.setdefault(name, torch.zeros_like(p))
        buf.lerp_(g, 1 - 0.95)
        update = g.lerp(buf, 0.95)
        x = update.mT if update.size(0) > update.size(1) else update
        x = x / (x.norm() + 1e-7)
        for _ in range(5):
            gram = x @ x.mT
            x = A * x + (B * gram + C * gram @ gram) @ x
        x = x.mT if update.size(0) > update.size(1) else x
        with torch.no_grad():
            p.mul_(1 - lr * wd)
            p.add_(x * (0.2 * max(p.shape) ** 0.5), alpha=-lr)
        done.append(name)
    return done


def _batch(step, rank, micro):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return (torch.randint(0, 100, (2, 16), generator=g) for _ in range(2))


def test_one_process_step_equals_a_plain_reimplementation():
    torch.manual_seed(0)
    model, ref = GPT(GPTConfig(**CONFIG)), GPT(GPTConfig(**CONFIG))
    ref.load_state_dict(model.state_dict())
    named = list(model.named_parameters())
    groups = muon.param_groups(WD, lr=LR, betas=(0.9, 0.95))(named)
    by_name = dict(named)
    opt = muon.Muon([dict(g, params=[by_name[k] for k in g["params"]]) for g in groups])
    ref_named = dict(ref.named_parameters())
    rest = [dict(g, params=[ref_named[k] for k in g["params"]]) for g in groups[1:]]
    ref_adam, state = torch.optim.AdamW(rest), {}
    for step in range(3):
        x, y = _batch(step, 0, 0)
        for m in (model, ref):
            m.zero_grad()
            m(x, y).backward()
        opt.step()
        stepped = _plain_muon_step(ref, state, LR, WD)
        ref_adam.step()
    assert len(stepped) == 8 and len(groups[0]["params"]) == 8
    differ = [k for k, v in ref.state_dict().items() if not torch.equal(v, model.state_dict()[k])]
    assert differ == []


def test_owners_balance_greedy_largest_first():
    owner, load = balance([10, 40, 30, 20, 5], 2)
    # 40 -> 0, 30 -> 1, 20 -> 1 (30 < 40), 10 -> 0 (40 < 50), 5 -> 0 (ties: the lowest)
    assert owner == [0, 0, 1, 1, 0] and load == [55, 50]


def test_muon_refused_where_the_engine_cannot_run_it():
    with pytest.raises(ValueError, match="--offload"):
        check_config(1, muon.Muon, offload=0.5)

    class NotElementwise(torch.optim.SGD):
        elementwise = False

    with pytest.raises(ValueError, match="cannot be sharded"):
        check_config(1, NotElementwise)
    check_config(3, muon.Muon)  # the seam: accepted at every stage


def _engine(grid, stage, seed=0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**CONFIG))
    groups = muon.param_groups(WD, lr=LR, betas=(0.9, 0.95))
    return ZeroEngine(model, muon.Muon, groups, grid, stage, bucket_mb=0.02)


def _train(engine, first, steps, accum):
    """Steps of `accum` micro-batches; -> losses, all-to-all bytes per step."""
    grid, losses, sent = engine.grid, [], []
    for step in range(first, first + steps):
        grid.log.reset()
        total = 0.0
        for m in range(accum):
            x, y = _batch(step, grid.dp_rank, m)
            with engine.no_sync() if m < accum - 1 else contextlib.nullcontext():
                loss = engine.module(x, y) / accum
                loss.backward()
            total += loss.item()
        engine.step(clip_norm=CLIP)
        losses.append(total)
        sent.append(grid.log.bytes("all_to_all"))
    return losses, sent


def _reference(world, accum, order):
    """One process: the same global batches, gradients summed in `order` (None: one forward over
    the whole batch), clipped, Muon; -> weights, losses (the mean over ranks of theirs)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG))
    named = [(k, p) for k, p in model.named_parameters()]
    by_name, params = dict(named), [p for _, p in named]
    groups = muon.param_groups(WD, lr=LR, betas=(0.9, 0.95))(named)
    opt = muon.Muon([dict(g, params=[by_name[k] for k in g["params"]]) for g in groups])
    losses = []
    for step in range(STEPS):
        mbs = [[tuple(_batch(step, r, m)) for m in range(accum)] for r in range(world)]
        if order is None:
            x, y = (torch.cat([mb[i] for rank in mbs for mb in rank]) for i in (0, 1))
            loss = model(x, y)
            grads, losses = torch.autograd.grad(loss, params), losses + [loss.item()]
        else:
            g = [[torch.autograd.grad(model(x, y) / accum, params) for x, y in r] for r in mbs]
            g = list(zip(*g)) if order == "mb_last" else g
            total = None
            for outer in g:
                part = outer[0]
                for inner in outer[1:]:
                    part = [a + b for a, b in zip(part, inner)]
                total = part if total is None else [a + b for a, b in zip(total, part)]
            grads = [t / world for t in total]
        for p, t in zip(params, grads):
            p.grad = t
        norm = sum(t.double().square().sum() for t in grads).sqrt().item()
        if CLIP / (norm + 1e-6) < 1:
            for t in grads:
                t.mul_(CLIP / (norm + 1e-6))
        opt.step()
    return {k: p.detach().clone() for k, p in named}, losses


def _world(world):
    grid, res = dist.Grid(world, 1, 1), {}
    for accum in (1, 2):
        for stage in range(4):
            engine = _engine(grid, stage)
            losses, sent = _train(engine, 0, STEPS - 1, accum)
            saved = reshard.full_state(engine)
            more, sent_last = _train(engine, STEPS - 1, 1, accum)
            weights = reshard.full_state(engine)[0]
            r = res[stage, accum] = dict(
                losses=losses + more,
                weights=weights,
                sent=sent + sent_last,
                formula=engine.owners.bytes_sent(),
                table=engine.owners.table(),
            )
            if accum == 2:  # resumed in the same layout, and resharded into the next stage
                for other in (stage, {0: 1, 1: 0, 2: 3, 3: 2}[stage]):
                    resumed = _engine(grid, other, seed=1)
                    reshard.import_by_name(resumed, *saved)
                    _train(resumed, STEPS - 1, 1, accum)
                    r["resumed", other] = reshard.full_state(resumed)[0]
    if grid.rank == 0:
        for accum in (1, 2):
            for order in ("ranks_last", "mb_last", None):
                res["reference", accum, order] = _reference(world, accum, order)
    buf = io.BytesIO()  # tensors come back as bytes (a queue would pass them by shared memory)
    torch.save(res, buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def world2():
    return [torch.load(io.BytesIO(r)) for r in worlds.launch(_world, 2, 2, timeout=300)]


def _differ(a, b):
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharded_muon_equals_zero0_bitwise(world2, stage):
    r = world2[0]
    for accum in (1, 2) if stage == 1 else (1,):
        got, want = r[stage, accum], r[0, accum]
        assert got["losses"] == want["losses"]
        assert _differ(got["weights"], want["weights"]) == []
    if stage == 3:  # ZeRO-2 and -3 sum the micro-batches alike
        assert _differ(r[3, 2]["weights"], r[2, 2]["weights"]) == []


@pytest.mark.parametrize("stage", range(4))
def test_muon_at_dp2_equals_one_process(world2, stage):
    """Bitwise against one process summing in the stage's order; the losses within the layout
    tolerance of one process running the whole batch in one forward."""
    r = world2[0]
    for accum in (1, 2):
        order = "ranks_last" if stage < 2 or accum == 1 else "mb_last"
        ref, _ = r["reference", accum, order]
        assert _differ(r[stage, accum]["weights"], ref) == [], (stage, accum)
        _, whole = r["reference", accum, None]
        # a step's loss: the mean over the ranks of their micro-batches' means
        got = [sum(rank[stage, accum]["losses"][k] for rank in world2) / 2 for k in range(STEPS)]
        rtol = layout_rtol(STEPS, 100, 48, 2)
        assert all(abs(a - b) <= rtol * b for a, b in zip(got, whole)), (got, whole, rtol)


@pytest.mark.parametrize("stage", range(4))
def test_owner_exchange_bytes_are_the_formula(world2, stage):
    for rank in world2:
        r = rank[stage, 2]
        assert r["sent"] == [r["formula"]] * STEPS
        assert (r["formula"] == 0) == (stage == 0)
    print(f"ZeRO-{stage}:", world2[0][stage, 2]["table"] or "no sharded matrix")


@pytest.mark.parametrize("stage", range(4))
def test_muon_resumes_bitwise_and_reshards(world2, stage):
    r = world2[0][stage, 2]
    assert _differ(r["resumed", stage], r["weights"]) == []
    # into the stage summing in the same order (0 <-> 1, 2 <-> 3): the same arithmetic
    assert _differ(r["resumed", {0: 1, 1: 0, 2: 3, 3: 2}[stage]], r["weights"]) == []
