"""The fused CPU Adam/AdamW (nanomega/cpu_adam.py, csrc/cpu_adam.cpp) against its reference and
torch.optim.

Bitwise: the kernel rounds after every operation in the order cpu_adam.reference_step writes them as
PyTorch ops (PyTorch's +, -, *, / on fp32 tensors are correctly rounded IEEE operations on every
ISA; its sqrt is not -- MKL's vsSqrt -- so the reference rounds square roots itself,
cpu_adam.sqrt_rounded), so on every ISA path this CPU runs the two agree to the bit, tails included
(sizes 1, 7, 17, 1000003 are not multiples of 8 or 16).

Against torch.optim.AdamW / Adam (for-loop and foreach): the same math, other roundings. The bound
(error_bound) is derived, not measured. For each implementation, against the exact update in real
arithmetic (fp64 here) from the same fp32 gradients and start, per element, u = 2^-24, first order
in u; each fp32 coefficient (b1, 1 - b1, lr / bc1, sqrt(bc2), eps, 1 - lr wd, wd) is one rounding of
its exact value; b1 >= 1/2 (torch's lerp then forms m + w (g - m): its roundings are within those
counted below):
    Adam (L2)  g' = g + wd p           Eg = wd Ep + 3u (|g| + wd |p|)      coefficient, product, sum (AdamW: 0)
    m = b1 m + (1-b1) g'               Em <- b1 Em + (1-b1) Eg + 4u (b1 |m| + (1-b1) |g'|)
               torch: coefficient, g - m, product, sum: 4u L (L: the bracket); kernel: each term's coefficient
               and product, the sum: 3u L
    v = b2 v + (1-b2) g'^2             Ev <- b2 Ev + (1-b2)(2 |g'| Eg + Eg^2) + 4u v_new
               b2 v: coefficient + product; (1-b2) g'^2: coefficient + 2 products; the sum: at most 4u v_new
    d = sqrt(v) / sqrt(bc2) + eps      Es = |sqrt(v^) - sqrt(v)| <= min(Ev / (sqrt(v) + sqrt(v - Ev)), sqrt(Ev))
                                       Ed = Es / sqrt(bc2) + 6u d     sqrt (2u = 1 ulp: torch.sqrt is MKL's
                                       vsSqrt, documented < 1 ulp in its high-accuracy mode, not IEEE's 1/2;
                                       0.75 ulp seen on an AMD EPYC), coefficient, division, eps, sum
    U = (lr / bc1) m / d               EU = s Em / (d - Ed) + |U| Ed / (d - Ed) + 3u |U|   (s = lr / bc1;
                                       coefficient, product, division)
    AdamW  p = p (1 - lr wd) - U       Ep <- (1 - lr wd) Ep + 2u |p| (1 - lr wd) + EU + u |p_new|
    Adam   p = p - U                   Ep <- Ep + EU + u |p_new|
Two implementations then differ by at most 2 Ep (and 2 Em, 2 Ev in the state). The terms dropped are
products of two roundings: relative to the bound < (rounding count ~ 30 a step x steps) u < 1e-4;
SECOND_ORDER = 1.001 covers them. The bound holds whichever implementation took which step, so it
also bounds a run that switches optimizer through a state dict. A wrong formula (step off by one,
eps inside the sqrt) breaks it (tested); a legitimate other order (DeepSpeed's multiplication by
1/sqrt(bc2)) stays within it.
"""

import pytest
import torch
import torch.nn as nn

from nanomega import cpu_adam, extension
from nanomega.cpu_adam import CPUAdamW
from nanomega.zero import ZeroEngine
from nanomega.zero_rules import check_config, weight_decay_groups
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT
from nanomega import reshard
from tolerance import unit_roundoff

ISAS = ("avx512", "avx2", "scalar")
SIZES = (1, 7, 17, 1000003)
STEPS = 5
SECOND_ORDER = 1.001
HYPER = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)


@pytest.fixture(scope="module")
def ext():
    """The one cached build (extension.build_dir()); a build failure is a failure here, not a
    skip."""
    return extension.load_extension()


def gradients(shape, steps, seed):
    """Gradients over five decades of magnitude, a few exactly 0 (m, v and the update stay 0
    there)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        g = torch.randn(shape, generator=gen) * 10 ** (4 * torch.rand(shape, generator=gen) - 3)
        out.append(g * (torch.rand(shape, generator=gen) > 0.02))
    return out


def bits(t):
    return t.view(torch.int32)


# ---- (a) kernel == reference_step, bit for bit, on every path this CPU runs ----


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam-l2"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_kernel_equals_reference_bitwise(ext, isa, decoupled, wd):
    if isa not in ext.adam_isas():
        pytest.skip(f"this CPU cannot run the {isa} path ({extension.cpu_summary()})")
    assert ext.adam_isa(isa) == isa
    for n in SIZES:
        p = torch.randn(n, generator=torch.Generator().manual_seed(n))
        state = [p.clone(), torch.zeros(n), torch.zeros(n)]  # param, exp_avg, exp_avg_sq
        ref = [t.clone() for t in state]
        for step, g in enumerate(gradients(n, 4, seed=n + 1), 1):
            hyper = dict(
                lr=1e-3 * step,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=wd,
                step=step,
                decoupled=decoupled,
            )
            assert (
                ext.adam_step(
                    state[0],
                    g,
                    state[1],
                    state[2],
                    hyper["lr"],
                    0.9,
                    0.999,
                    1e-8,
                    wd,
                    step,
                    decoupled,
                    isa,
                )
                == isa
            )
            cpu_adam.reference_step(ref[0], g, ref[1], ref[2], **hyper)
            for name, got, want in zip(("param", "exp_avg", "exp_avg_sq"), state, ref):
                same = bits(got) == bits(want)
                assert same.all(), (
                    f"{isa} n={n} step {step} {name}: {(~same).sum().item()} elements differ "
                    f"from reference_step"
                )


@pytest.mark.parametrize("isa", ISAS)
def test_offload_step_scale_and_bf16_out_equal_reference_bitwise(ext, isa):
    """ZeRO-Offload's host step in one pass: the clip coefficient applied to the gradient and the
    new weights rounded into a bf16 buffer by the kernel equal reference_step's separate ops (grad *
    c; .copy_ into bf16), bit for bit, on every path; the bf16 rounding is to nearest EVEN (the ties
    below: an fp32 whose low 16 bits are 0x8000 rounds to the even neighbour), and a NaN stays a
    NaN."""
    if isa not in ext.adam_isas():
        pytest.skip(f"this CPU cannot run the {isa} path ({extension.cpu_summary()})")
    n = 100003
    ties = torch.tensor([0x3F808000, 0x3F818000, -0x40800000 + 0x8000], dtype=torch.int32).view(
        torch.float32
    )
    for decoupled in (True, False):
        p = torch.randn(n, generator=torch.Generator().manual_seed(7))
        state, ref = (
            [p, torch.zeros(n), torch.zeros(n)],
            [p.clone(), torch.zeros(n), torch.zeros(n)],
        )
        out, want = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
        for step, g in enumerate(gradients(n, 3, seed=8), 1):
            hyper = dict(
                lr=1e-3,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=0.1,
                step=step,
                decoupled=decoupled,
            )
            ext.adam_step(
                *state[:1],
                g,
                *state[1:],
                1e-3,
                0.9,
                0.999,
                1e-8,
                0.1,
                step,
                decoupled,
                isa,
                0.37,
                out,
            )
            cpu_adam.reference_step(ref[0], g, ref[1], ref[2], **hyper, grad_scale=0.37, out=want)
            for name, got, exp in zip(
                ("param", "exp_avg", "exp_avg_sq", "out"), [*state, out], [*ref, want]
            ):
                same = got.view(
                    torch.int16 if got.dtype == torch.bfloat16 else torch.int32
                ) == exp.view(torch.int16 if exp.dtype == torch.bfloat16 else torch.int32)
                assert same.all(), (
                    f"{isa} step {step} {name}: {(~same).sum().item()} elements differ"
                )
    # ties and a NaN through the kernel: lr 0 and wd 0 leave p as it was, so out is p rounded
    p = torch.cat([ties, torch.tensor([float("nan"), 1.0])])
    out = torch.empty(len(p), dtype=torch.bfloat16)
    ext.adam_step(
        p,
        torch.zeros_like(p),
        torch.zeros_like(p),
        torch.zeros_like(p),
        0.0,
        0.9,
        0.999,
        1e-8,
        0.0,
        1,
        True,
        isa,
        1.0,
        out,
    )
    assert (
        out[:3].view(torch.int16).tolist() == [0x3F80, 0x3F82, -0x4080]
        and out[3].isnan()
        and out[4] == 1
    )


def test_bitwise_check_sees_one_rounding(ext):
    """The bitwise test can fail: DeepSpeed's order, sqrt(v) times a rounded 1/sqrt(bc2) instead of
    divided by sqrt(bc2) (one rounding moved, the rest as reference_step), differs from the kernel
    in some elements."""
    n, g = 1000003, gradients(1000003, 1, seed=5)[0]
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    start = p.clone()
    ext.adam_step(p, g, m, v, 1e-3, 0.9, 0.999, 1e-8, 0.1, 1, True, "")
    c = cpu_adam.coefficients(1e-3, 0.9, 0.999, 1e-8, 0.1, 1)
    inverse = torch.tensor(1 / (1 - 0.999) ** 0.5, dtype=torch.float32).item()
    denom = cpu_adam.sqrt_rounded(v) * inverse + c["eps"]
    other = start * c["decay"] - (c["step_size"] * m) / denom
    assert torch.equal(v, c["one_minus_beta2"] * (g * g)) and (bits(other) != bits(p)).any()


def test_threads_do_not_change_bits(ext):
    """The chunks a thread takes depend on the thread count; the bits must not (elements never
    interact)."""
    n, g = 1000003, gradients(1000003, 1, seed=6)[0]
    out, threads = [], torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            p, m, v = torch.ones(n), torch.zeros(n), torch.zeros(n)
            ext.adam_step(p, g, m, v, 1e-3, 0.9, 0.999, 1e-8, 0.1, 1, True, "")
            out.append(torch.cat([p, m, v]))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(bits(out[0]), bits(out[1]))


def test_sqrt_rounded_is_ieee():
    """reference_step's square root is IEEE's: the correctly rounded fp64 root (Python's math.sqrt)
    rounded to fp32 (a double rounding that cannot err for a square root: 53 >= 2 * 24 + 2 bits),
    over normal, subnormal and special values. torch.sqrt is not (MKL), which is why the reference
    does not call it."""
    import math

    v = torch.cat(
        [
            torch.rand(100000) * 10 ** (torch.rand(100000) * 76 - 38),
            torch.rand(1000) * 1e-39,
            torch.tensor([0.0, 1.0, 2.0, 4.0, float("inf"), torch.finfo(torch.float32).max]),
        ]
    )
    want = torch.tensor([math.sqrt(x) for x in v.tolist()], dtype=torch.float64).float()
    assert torch.equal(bits(cpu_adam.sqrt_rounded(v)), bits(want))


def test_isa_forced_by_environment(ext, monkeypatch):
    paths = ext.adam_isas()
    # fastest first; the default is the fastest
    assert paths[-1] == "scalar" and ext.adam_isa() == paths[0]
    for isa in paths:
        monkeypatch.setenv("NANOMEGA_ADAM_ISA", isa)
        assert ext.adam_isa() == isa == cpu_adam.isa()
    monkeypatch.setenv("NANOMEGA_ADAM_ISA", "sse9")
    with pytest.raises(
        RuntimeError, match="ISA path 'sse9' .* is not one this CPU runs; it runs: "
    ) as e:
        ext.adam_isa()
    assert "\n" not in str(e.value).strip()


# ---- (b) within the derived bound of torch.optim.AdamW / Adam ----


def error_bound(p0, grads, lr, betas, eps, weight_decay, decoupled=True):
    """-> (Ep, Em, Ev): one implementation's largest error against the exact run, per element
    (module docstring)."""
    u = unit_roundoff(torch.float32)
    (b1, b2), wd = betas, weight_decay
    assert b1 >= 0.5, "the lerp bound assumes b1 >= 1/2"
    p = p0.double()
    m, v, Ep, Em, Ev = (torch.zeros_like(p) for _ in range(5))
    for t, g in enumerate(grads, 1):
        g = g.double()
        if decoupled:
            Eg = torch.zeros_like(p)
        else:
            Eg = wd * Ep + 3 * u * (g.abs() + wd * p.abs())
            g = g + wd * p
        Em = b1 * Em + (1 - b1) * Eg + 4 * u * (b1 * m.abs() + (1 - b1) * g.abs())
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        Ev = b2 * Ev + (1 - b2) * (2 * g.abs() * Eg + Eg * Eg) + 4 * u * v
        sbc2, s = (1 - b2**t) ** 0.5, lr / (1 - b1**t)
        d = v.sqrt() / sbc2 + eps
        Es = torch.where(
            Ev > 0, torch.minimum(Ev / (v.sqrt() + (v - Ev).clamp_min(0).sqrt()), Ev.sqrt()), 0.0
        )
        Ed = Es / sbc2 + 6 * u * d
        assert (Ed < d).all(), "the bound is void: the denominator's error reaches its size"
        U = s * m / d
        EU = s * Em / (d - Ed) + U.abs() * Ed / (d - Ed) + 3 * u * U.abs()
        if decoupled:
            decay = 1 - lr * wd
            p_new = p * decay - U
            Ep = decay * Ep + 2 * u * p.abs() * decay + EU + u * p_new.abs()
        else:
            p_new = p - U
            Ep = Ep + EU + u * p_new.abs()
        p = p_new
    return Ep, Em, Ev


SHAPES = [(300, 301), (1001,), (7,)]


def problem(seed):
    start = [
        torch.randn(s, generator=torch.Generator().manual_seed(seed + i))
        for i, s in enumerate(SHAPES)
    ]
    # [param][step]
    grads = [gradients(s, STEPS, seed=100 * seed + i) for i, s in enumerate(SHAPES)]
    return start, grads


def run(make, start, grads, steps=range(STEPS), params=None, optimizer=None):
    """Steps `steps` of make(params) (a fresh copy of start unless given) with the given
    gradients."""
    params = params or [nn.Parameter(t.clone()) for t in start]
    optimizer = optimizer or make(params)
    for k in steps:
        for p, g in zip(params, grads):
            p.grad = g[k].clone()
        optimizer.step()
    return params, optimizer


def assert_within_bound(got, want, start, grads, hyper, decoupled, steps=STEPS):
    worst = 0.0
    for a, b, p0, g in zip(got, want, start, grads):
        Ep, Em, Ev = error_bound(
            p0,
            g[:steps],
            hyper["lr"],
            hyper["betas"],
            hyper["eps"],
            hyper["weight_decay"],
            decoupled,
        )
        for name, x, y, e in (
            ("param", a[0], b[0], Ep),
            ("exp_avg", a[1], b[1], Em),
            ("exp_avg_sq", a[2], b[2], Ev),
        ):
            diff = (x.double() - y.double()).abs()
            bound = 2 * SECOND_ORDER * e
            assert (diff <= bound).all(), (
                f"{tuple(p0.shape)} {name}: |diff| up to {diff.max().item():.3g}, "
                f"{(diff / bound.clamp_min(1e-300)).max().item():.3g}x the bound"
            )
            worst = max(worst, (diff / bound.clamp_min(1e-300)).max().item())
    return worst


def tensors(params, optimizer):
    return [
        (p.detach(), optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"])
        for p in params
    ]


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam-l2"])
@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
def test_within_derived_bound_of_torch(ext, decoupled, foreach):
    start, grads = problem(seed=1)
    hyper = dict(HYPER, weight_decay=0.1)
    theirs = torch.optim.AdamW if decoupled else torch.optim.Adam
    got = tensors(
        *run(lambda ps: CPUAdamW(ps, decoupled_weight_decay=decoupled, **hyper), start, grads)
    )
    want = tensors(*run(lambda ps: theirs(ps, foreach=foreach, **hyper), start, grads))
    assert_within_bound(got, want, start, grads, hyper, decoupled)


def variant(start, grads, hyper, change):
    """AdamW in fp32 PyTorch ops with one change: "deepspeed" multiplies sqrt(v) by a rounded
    1/sqrt(bc2) (a legitimate order: the same roundings counted), "step+1" counts steps from 2 (bias
    corrections off by one), "eps-in-sqrt" forms sqrt(v / bc2 + eps). -> [(param, exp_avg,
    exp_avg_sq)]."""
    lr, (b1, b2), eps, wd = hyper["lr"], hyper["betas"], hyper["eps"], hyper["weight_decay"]
    out = []
    for p0, g in zip(start, grads):
        p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
        for k in range(STEPS):
            t = k + 2 if change == "step+1" else k + 1
            bc1, bc2 = 1 - b1**t, 1 - b2**t
            p.mul_(1 - lr * wd)
            m.mul_(b1).add_(g[k], alpha=1 - b1)
            v.mul_(b2).addcmul_(g[k], g[k], value=1 - b2)
            if change == "eps-in-sqrt":
                denom = (v / bc2 + eps).sqrt()
            elif change == "deepspeed":
                denom = v.sqrt() * (1 / bc2**0.5) + eps
            else:
                denom = v.sqrt() / bc2**0.5 + eps
            p.sub_(lr / bc1 * m / denom)
        out.append((p, m, v))
    return out


@pytest.mark.parametrize("change", ["step+1", "eps-in-sqrt", "deepspeed"])
def test_bound_catches_a_wrong_formula(change):
    """The bound can fail: bias corrections off by one step, or eps under the square root, break it;
    DeepSpeed's order of the same math stays within it (it is not tighter than the roundings
    allow)."""
    start, grads = problem(seed=2)
    hyper = dict(HYPER, weight_decay=0.1)
    want = tensors(*run(lambda ps: torch.optim.AdamW(ps, **hyper), start, grads))
    got = variant(start, grads, hyper, change)
    if change == "deepspeed":
        assert_within_bound(got, want, start, grads, hyper, True)
    else:
        with pytest.raises(AssertionError, match="the bound"):
            assert_within_bound(got, want, start, grads, hyper, True)


# ---- (c) optimizer state dicts interchange with torch.optim.AdamW, both ways ----


@pytest.mark.parametrize("first", ["cpu_adam", "torch"])
def test_state_dict_interchange(ext, first):
    """3 steps of one optimizer, its state_dict loaded into the other, 2 more steps: the same state
    keys, shapes and dtypes on both sides, the state carried over exactly, and the weights within
    the derived bound of 5 steps of torch.optim.AdamW alone (the bound does not care which
    implementation took which step)."""
    start, grads = problem(seed=3)
    hyper = dict(HYPER, weight_decay=0.1)
    make = {
        "cpu_adam": lambda ps: CPUAdamW(ps, **hyper),
        "torch": lambda ps: torch.optim.AdamW(ps, **hyper),
    }
    second = "torch" if first == "cpu_adam" else "cpu_adam"
    params, opt = run(make[first], start, grads, steps=range(3))
    saved = opt.state_dict()
    resumed = make[second](params)
    resumed.load_state_dict(saved)
    for p in params:
        a, b = opt.state[p], resumed.state[p]
        assert {k: (v.shape, v.dtype, v.device) for k, v in a.items()} == {
            k: (v.shape, v.dtype, v.device) for k, v in b.items()
        }
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.state_dict()["param_groups"][0]["lr"] == hyper["lr"]
    run(None, start, grads, steps=range(3, STEPS), params=params, optimizer=resumed)
    want = tensors(*run(make["torch"], start, grads))
    assert_within_bound(tensors(params, resumed), want, start, grads, hyper, True)
    assert [s["step"].item() for s in resumed.state.values()] == [STEPS] * len(params)


def test_torch_adam_state_dict_keeps_its_l2_mode(ext):
    """torch.optim.Adam's groups say decoupled_weight_decay=False: loaded into CPUAdamW, the steps
    stay Adam's."""
    start, grads = problem(seed=4)
    hyper = dict(HYPER, weight_decay=0.1)
    params, opt = run(lambda ps: torch.optim.Adam(ps, **hyper), start, grads, steps=range(2))
    resumed = CPUAdamW(params, **hyper)
    resumed.load_state_dict(opt.state_dict())
    assert resumed.param_groups[0]["decoupled_weight_decay"] is False
    run(None, start, grads, steps=range(2, STEPS), params=params, optimizer=resumed)
    want = tensors(*run(lambda ps: torch.optim.Adam(ps, **hyper), start, grads))
    assert_within_bound(tensors(params, resumed), want, start, grads, hyper, False)


# ---- (d) the optimizer of a ZeroEngine (one rank), against torch.optim.AdamW on the plain model
# ----


class Linear(nn.Module):
    """loss = sum(w * a) + sum(b * c): the gradients are the data (a, c) whatever the weights, so
    the engine and the reference see the same gradients at every step and the bound above applies
    unchanged (a model whose gradients depend on the weights would add its own sensitivity to the
    optimizers' roundings)."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(37, 29, generator=gen))  # weight decay (>= 2-D)
        self.b = nn.Parameter(torch.randn(101, generator=gen))  # none

    def forward(self, a, c):
        return (self.w * a).sum() + (self.b * c).sum()


GROUPS = dict(weight_decay=0.1, lr=1e-2, betas=(0.9, 0.95))


def reference_adamw(model, named):
    by_name = dict(named)
    return torch.optim.AdamW(
        [
            dict(s, params=[by_name[k] for k in s["params"]])
            for s in weight_decay_groups(**GROUPS)(named)
        ]
    )


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_drop_in_optimizer_of_zero_engine(grid, one_thread, stage):
    check_config(stage, CPUAdamW)  # element-wise: any stage may shard it (CPUAdamW.elementwise)
    engine = ZeroEngine(
        Linear(), CPUAdamW, weight_decay_groups(**GROUPS), grid, stage, bucket_mb=0.001
    )
    assert isinstance(engine.optimizer, CPUAdamW)
    ref = Linear()
    named = list(ref.named_parameters())
    opt = reference_adamw(ref, named)
    data = {k: gradients(p.shape, STEPS, seed=7 + i) for i, (k, p) in enumerate(named)}
    for step in range(STEPS):
        for model in (engine.module, ref):
            model(data["w"][step], data["b"][step]).backward()
        engine.step()
        opt.step()
        opt.zero_grad()
    weights, state = reshard.full_state(engine)
    for k, p in named:
        wd = GROUPS["weight_decay"] if p.dim() >= 2 else 0.0
        Ep, _, _ = error_bound(
            Linear().get_parameter(k).detach(), data[k], GROUPS["lr"], GROUPS["betas"], 1e-8, wd
        )
        diff = (weights[k].double() - p.detach().double()).abs()
        assert (diff <= 2 * SECOND_ORDER * Ep).all(), f"stage {stage} {k}: {diff.max().item():.3g}"
        assert state[k]["step"].item() == STEPS and state[k]["exp_avg"].numel() == p.numel()


def test_drop_in_on_a_gpt_one_step(grid, one_thread):
    """A GPT (tied embedding, decay and no-decay groups) under ZeRO-1: one step from the same
    weights and batch takes the same gradients in both (checked: the losses are bitwise equal), so
    the one-step bound applies."""
    cfg = GPTConfig(vocab_size=100, block_size=16, n_layer=2, n_head=2, n_embd=48)
    torch.manual_seed(0)
    engine = ZeroEngine(GPT(cfg), CPUAdamW, weight_decay_groups(**GROUPS), grid, 1, bucket_mb=0.05)
    torch.manual_seed(0)
    ref = GPT(cfg)
    named = [(k, p) for k, p in ref.named_parameters() if p.requires_grad]
    start = {k: p.detach().clone() for k, p in named}
    opt = reference_adamw(ref, named)
    x, y = (
        torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(s)) for s in (1, 2)
    )
    losses = [model(x, y) for model in (engine.module, ref)]
    assert torch.equal(losses[0], losses[1])
    for loss in losses:
        loss.backward()
    grads = {k: p.grad.clone() for k, p in named}
    engine.step()
    opt.step()
    weights = reshard.full_state(engine)[0]
    decayed = {k for k in weight_decay_groups(**GROUPS)(named)[0]["params"]}
    for k, p in named:
        wd = GROUPS["weight_decay"] if k in decayed else 0.0
        Ep, _, _ = error_bound(start[k], [grads[k]], GROUPS["lr"], GROUPS["betas"], 1e-8, wd)
        diff = (weights[k].double() - p.detach().double()).abs()
        assert (diff <= 2 * SECOND_ORDER * Ep).all(), f"{k}: {diff.max().item():.3g}"


# ---- (e) one-line errors; (f) the PyTorch fallback ----


def bad_params():
    yield "meta", nn.Parameter(torch.empty(3, 4, device="meta")), "is a meta torch.float32 tensor"
    if torch.cuda.is_available():
        yield (
            "cuda",
            nn.Parameter(torch.zeros(3, 4, device="cuda")),
            "is a cuda:0 torch.float32 tensor",
        )
    yield (
        "bf16",
        nn.Parameter(torch.zeros(3, 4, dtype=torch.bfloat16)),
        "is a cpu torch.bfloat16 tensor",
    )
    yield (
        "fp64",
        nn.Parameter(torch.zeros(3, 4, dtype=torch.float64)),
        "is a cpu torch.float64 tensor",
    )
    yield (
        "transposed",
        nn.Parameter(torch.zeros(4, 3).t()),
        "is a cpu torch.float32 non-contiguous tensor",
    )
    yield (
        "strided",
        nn.Parameter(torch.zeros(3, 8)[:, ::2]),
        "is a cpu torch.float32 non-contiguous tensor",
    )


@pytest.mark.parametrize(
    "what, param, message", list(bad_params()), ids=[c[0] for c in bad_params()]
)
def test_bad_parameter_one_line_error(what, param, message):
    """A device other than the CPU (meta stands in for cuda where there is no GPU: the same check),
    a dtype other than fp32, a non-contiguous layout: refused when the group is built, in one
    line."""
    good = nn.Parameter(torch.zeros(5))
    with pytest.raises(
        ValueError, match=f"CPUAdamW: parameter 1 of group 0 {message} of shape"
    ) as e:
        CPUAdamW([good, param])
    assert "\n" not in str(e.value)
    opt = CPUAdamW([good])
    with pytest.raises(ValueError, match=f"parameter 0 of group 1 {message}"):
        opt.add_param_group(dict(params=[param]))
    assert len(opt.param_groups) == 1
    # torch's named parameters
    with pytest.raises(ValueError, match=f"parameter 1 of group 0 {message}"):
        CPUAdamW([("good", good), ("bad", param)])
    assert CPUAdamW([("good", good)]).param_groups[0]["param_names"] == ["good"]


def test_bad_gradient_and_state_one_line_errors(ext):
    p = nn.Parameter(torch.zeros(5))
    p.grad = torch.zeros(5).to_sparse()
    with pytest.raises(
        ValueError, match="gradient of parameter 0 of group 0 is a cpu torch.float32 sparse tensor"
    ):
        CPUAdamW([p]).step()
    p.grad_dtype = None  # torch refuses a gradient of another dtype unless told to accept one
    p.grad = torch.zeros(5, dtype=torch.bfloat16)
    with pytest.raises(
        ValueError, match="gradient of parameter 0 of group 0 is a cpu torch.bfloat16 tensor"
    ):
        CPUAdamW([p]).step()
    with pytest.raises(ValueError, match=r"invalid betas\[1\] 1.0"):
        CPUAdamW([p], betas=(0.9, 1.0))
    amsgrad = torch.optim.AdamW([p], amsgrad=True).state_dict()
    opt = CPUAdamW([p])
    opt.load_state_dict(amsgrad)
    p.grad = torch.zeros(5)
    with pytest.raises(ValueError, match="group 0 asks for amsgrad or maximize"):
        opt.step()
    with pytest.raises(
        RuntimeError,
        match="cpu adam: exp_avg must be a contiguous float32 CPU tensor, got cpu Double",
    ):
        ext.adam_step(
            torch.zeros(4),
            torch.zeros(4),
            torch.zeros(4).double(),
            torch.zeros(4),
            1e-3,
            0.9,
            0.999,
            1e-8,
            0.0,
            1,
            True,
            "",
        )


def test_pytorch_fallback_is_the_kernel_bitwise(ext, monkeypatch):
    """Without the extension (extension.extension() is None: no compiler) CPUAdamW steps with
    reference_step, and so gives the kernel's bits."""
    start, grads = problem(seed=5)
    hyper = dict(HYPER, weight_decay=0.1)
    kernel = tensors(*run(lambda ps: CPUAdamW(ps, **hyper), start, grads))
    monkeypatch.setattr(extension, "extension", lambda: None)
    assert cpu_adam.isa() == "pytorch" and cpu_adam.isas() == []
    fallback = tensors(*run(lambda ps: CPUAdamW(ps, **hyper), start, grads))
    for a, b in zip(kernel, fallback):
        assert all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b))
