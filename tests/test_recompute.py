"""Activation recompute (nanomega/recompute.py): bitwise equal to no recompute, the saved bytes and
FLOPs its formulas give, on a dense model, a pipeline stage, a tensor-parallel model and under ZeRO
0-3 with a bf16 model (one spawned world of 2 holding the tp, pp and dp grids).

Saved-bytes assumptions (CPU torch 2.13, dropout > 0, stated in
formulas.activation_bytes_per_layer): activations `act` bytes (4 fp32, 2 bf16); dropout masks kept
by CPU dropout as a tensor of the activation dtype (mask = act; a CUDA bool mask would be 1 byte, as
in the paper); softmax output saved in fp32 by model.causal_softmax (probs = 4). Small terms the
formula leaves out: LayerNorm mean and rstd (2 x 2 sb floats) and the causal mask (s^2 bools) --
together < 1% here, the asserted band is 10%.
"""

import contextlib
import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from nanomega import dist, pp, recompute, tp, worlds
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT
from nanomega.precision import cast_model
from nanomega.formulas import activation_bytes_per_layer
from nanomega.recompute import apply_recompute, saved_bytes_per_layer
from nanomega.rng import model_parallel_seed
from nanomega.zero import ZeroEngine

pytestmark = pytest.mark.usefixtures("one_thread")
CASES = [
    ("none", None),
    ("full", None),
    ("selective", None),
    ("full", 2),
    ("selective", 1),
    ("full", 0),
]


def recomputed_layers(model) -> dict:
    """{layer name: "full" | "selective"} for the blocks whose table apply_recompute changed: the
    `layer` entry checkpointed (full) or the `core` entry (selective)."""
    out = {}
    for key, block in model.blocks.items():
        if isinstance(block.ops.layer, recompute.Checkpointed):
            out[key] = "full"
        elif isinstance(block.ops.core, recompute.Checkpointed):
            out[key] = "selective"
    return out


def gpt(**kw):
    torch.manual_seed(0)
    return GPT(
        GPTConfig(
            **{
                **dict(vocab_size=256, block_size=32, n_layer=3, n_head=4, n_embd=32, dropout=0.1),
                **kw,
            }
        )
    )


def train(model, mode, layers, steps=2, seed=5):
    """Recompute mode applied to a copy; AdamW steps; losses and every gradient of every step."""
    model = apply_recompute(copy.deepcopy(model), mode, layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen, out = torch.Generator().manual_seed(seed), []
    torch.manual_seed(seed)  # the dropout stream: the same for every mode
    for _ in range(steps):
        x = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.block_size), generator=gen)
        loss = model(x, x.roll(1, 1))
        loss.backward()
        out += [loss.detach()] + [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
    return out


def bitwise(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------- correctness
@pytest.mark.parametrize(
    "kw", [{}, dict(alibi=True, embed_layernorm=True)], ids=["learned", "alibi"]
)
def test_every_mode_is_bitwise_no_recompute(kw):
    """fp32, dropout on, two AdamW steps: the second step checks that after a recomputing backward
    the dropout stream is where it would be without recompute."""
    model = gpt(**kw)
    ref = train(model, "none", None)
    for mode, k in CASES[1:]:
        assert bitwise(train(model, mode, k), ref), (mode, k)


def test_restoring_the_rng_is_what_makes_it_bitwise(monkeypatch):
    """The negative control: with the RNG not restored, recompute draws other dropout masks."""
    real = recompute.checkpoint
    monkeypatch.setattr(
        recompute,
        "checkpoint",
        lambda fn, *a, **kw: real(fn, *a, **{**kw, "preserve_rng_state": False}),
    )
    model = gpt()
    ref = train(model, "none", None)
    assert not bitwise(train(model, "full", None), ref)
    assert not bitwise(train(model, "selective", None), ref)


def test_modes_replace_each_other_and_names_stay():
    model = gpt()
    names = [n for n, _ in model.named_parameters()]
    apply_recompute(model, "full", 2)
    assert recomputed_layers(model) == {"0": "full", "1": "full"}
    apply_recompute(model, "selective")
    assert recomputed_layers(model) == {"0": "selective", "1": "selective", "2": "selective"}
    apply_recompute(model, "none")
    assert recomputed_layers(model) == {} and [n for n, _ in model.named_parameters()] == names
    assert all(
        "forward" not in b.__dict__ and "core" not in b.attn.__dict__ for b in model.blocks.values()
    )
    with torch.no_grad():  # eval under recompute runs the plain forward
        apply_recompute(model, "full")
        assert model(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 256)


@pytest.mark.parametrize(
    "mode,layers,flag",
    [
        ("partial", None, "--recompute 'partial'"),
        ("full", 4, "--recompute-layers 4"),
        ("selective", -1, "--recompute-layers -1"),
    ],
)
def test_bad_input_one_line(mode, layers, flag):
    with pytest.raises(ValueError) as err:
        apply_recompute(gpt(), mode, layers)
    assert flag in str(err.value) and "\n" not in str(err.value)


def test_pipeline_stage_recomputes_its_own_first_k():
    """A stage holding layers 2 and 3 of 4 (as pp.build_stage leaves it): k counts the layers it
    holds; k = 3 <= n_layer is allowed and recomputes both; hidden states in, bitwise the same
    gradients."""
    dense = gpt(n_layer=4)
    stage = copy.deepcopy(dense)
    for key in ("0", "1"):
        del stage.blocks[key]
    stage.embed = stage.head = None
    apply_recompute(stage, "full", 1)
    assert recomputed_layers(stage) == {"2": "full"}
    apply_recompute(stage, "selective", 3)
    assert recomputed_layers(stage) == {"2": "selective", "3": "selective"}
    h = torch.randn(2, 32, 32)

    def grads(mode, k):
        s = apply_recompute(copy.deepcopy(stage), mode, k)
        torch.manual_seed(3)
        s(h).square().mean().backward()
        return [p.grad for p in s.parameters()]

    ref = grads("none", None)
    assert bitwise(grads("full", 1), ref) and bitwise(grads("selective", None), ref)


# ---------------------------------------------------------------- memory and compute formulas
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_saved_bytes_per_layer_match_the_formula(dtype):
    s, b, h, a = 128, 2, 64, 4
    model = cast_model(gpt(block_size=s, n_embd=h, n_head=a), dtype)
    act = dtype.itemsize
    x = torch.randint(0, 256, (b, s))
    for mode, k in CASES:
        apply_recompute(model, mode, k)
        measured = saved_bytes_per_layer(model, lambda: model(x, x))
        for i, got in enumerate(measured.values()):
            layer_mode = mode if k is None or i < k else "none"
            want = activation_bytes_per_layer(
                s, b, h, a, recompute=layer_mode, act=act, mask=act, probs=4
            )
            assert abs(got - want) <= 0.10 * want, (dtype, mode, k, i, got, want)
    # the ratios the formulas promise, with the paper's bytes (2, 1, 2): sbh(34 + 5as/h) -> 34 sbh
    # -> 2 sbh
    paper = {
        m: activation_bytes_per_layer(s, b, h, a, recompute=m)
        for m in ("none", "selective", "full")
    }
    assert paper == {
        "none": s * b * h * (34 + 5 * a * s / h),
        "selective": 34 * s * b * h,
        "full": 2 * s * b * h,
    }


def test_recompute_flops_equal_the_formula():
    """Matmul FLOPs of one training step (FlopCounterMode). Per layer: forward 24bsh^2 + 4bs^2h,
    backward twice; full reruns the forward; selective reruns QK^T only (checkpoint stops before AV:
    its inputs are already rebuilt). The LM head adds 3 x 2bshV."""
    L, s, b, h, V = 3, 32, 2, 32, 256
    model = gpt(n_layer=L, block_size=s, n_embd=h)
    fwd = 24 * b * s * h * h + 4 * b * s * s * h
    base = 3 * (L * fwd + 2 * b * s * h * V)
    x = torch.randint(0, V, (b, s))
    for mode, k in CASES:
        m = apply_recompute(copy.deepcopy(model), mode, k)
        with FlopCounterMode(display=False) as counter:
            m(x, x).backward()
        n = L if k is None else k
        extra = {"none": 0, "full": n * fwd, "selective": n * 2 * b * s * s * h}[mode]
        assert counter.get_total_flops() == base + extra, (mode, k)


# ---------------------------------------------------------------- under TP and PP (one world of 2)
def _tp_case(grid, sp, dtype):
    """TP model (dropout, tracked RNG), one step per mode: {mode: (loss and grads bitwise those of
    no recompute, tp bytes moved)}. Plain values only: tensors cannot outlive the spawned rank."""
    cfg = GPTConfig(
        vocab_size=200,
        block_size=16,
        n_layer=2,
        n_head=4,
        n_embd=32,
        dropout=0.1,
        make_vocab_size_divisible_by=256,
    )
    out, ref = {}, None  # CASES starts with "none": the reference
    for mode, k in CASES:
        torch.manual_seed(1)
        model = GPT(cfg)
        rng = model_parallel_seed(7, grid)
        tp.apply_tensor_parallel(model, grid.tp, sp, rng=rng)
        cast_model(apply_recompute(model, mode, k), dtype)
        idx = torch.randint(
            cfg.vocab_size, (2, cfg.block_size), generator=torch.Generator().manual_seed(3)
        )
        grid.log.reset()
        loss = model(idx, idx.roll(1, 1))
        loss.backward()
        got = [loss.detach()] + [p.grad.clone() for p in model.parameters()]
        ref = got if mode == "none" else ref
        out[(mode, k)] = (
            bitwise(got, ref),
            grid.log.bytes("all_reduce", "tp") + grid.log.bytes("all_gather", "tp"),
        )
    return out


def _pp_case(grid, dtype):
    """Pipeline stage (1F1B, 3 micro-batches, dropout): {mode: (loss and this stage's grads bitwise
    those of no recompute, loss finite)}."""
    torch.manual_seed(0)
    dense = GPT(
        GPTConfig(vocab_size=96, block_size=16, n_layer=5, n_head=2, n_embd=32, dropout=0.1)
    )
    gen = torch.Generator().manual_seed(4)
    batches = [
        tuple(torch.randint(0, 96, (2, 16), generator=gen) for _ in range(2)) for _ in range(3)
    ]
    out, ref = {}, None  # CASES starts with "none": the reference
    for mode, k in CASES:
        stage = cast_model(
            apply_recompute(pp.build_stage(copy.deepcopy(dense), grid), mode, k), dtype
        )
        torch.manual_seed(11 + grid.pp_rank)
        loss = pp.train_step(stage, grid, batches, "1f1b")
        got = [torch.tensor(loss)] + [p.grad.clone() for p in stage.parameters()]
        ref = got if mode == "none" else ref
        out[(mode, k)] = (bitwise(got, ref), bool(torch.isfinite(got[0])))
    return out


def _zero_case(grid):
    """bf16 model, fp32 masters sharded by ZeRO over dp=2 (2 micro-batches per step, different data
    per rank), every stage x recompute mode: {(stage, mode): (losses of 3 steps bitwise those of
    stage 0 without recompute, masters + Adam state all fp32)}."""
    cfg = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1)
    out, ref = {}, None
    for stage in (0, 1, 2, 3):
        for mode in ("none", "full", "selective"):
            torch.manual_seed(0)
            model = cast_model(apply_recompute(GPT(cfg), mode), torch.bfloat16)
            engine = ZeroEngine(model, torch.optim.AdamW, dict(lr=1e-2), grid, stage)
            gen, losses = torch.Generator().manual_seed(10 + grid.dp_rank), []
            torch.manual_seed(20 + grid.dp_rank)
            for _ in range(3):
                for m in range(2):
                    x = torch.randint(0, 96, (2, 16), generator=gen)
                    with engine.no_sync() if m == 0 else contextlib.nullcontext():
                        loss = model(x, x.roll(1, 1)) / 2
                        loss.backward()
                    losses.append(loss.detach())
                engine.step(clip_norm=1.0)
            ref = losses if ref is None else ref
            state = (
                [g.master for g in engine.groups]
                + [g.grad for g in engine.groups if g.grad is not None]
                + [v for st in engine.optimizer.state.values() for v in st.values()]
            )
            out[(stage, mode)] = (bitwise(losses, ref), {t.dtype for t in state} == {torch.float32})
    return out


def _world():
    g_tp, g_pp, g_dp = dist.Grid(1, 1, 2), dist.Grid(1, 2, 1), dist.Grid(2, 1, 1)
    return dict(
        tp={
            (sp, dt): _tp_case(g_tp, sp, dt)
            for sp in (False, True)
            for dt in (torch.float32, torch.bfloat16)
        },
        pp={dt: _pp_case(g_pp, dt) for dt in (torch.float32, torch.bfloat16)},
        zero=_zero_case(g_dp),
    )


@pytest.fixture(scope="module")
def world():
    return worlds.launch(_world, 2, timeout=240)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel_bitwise_and_full_recompute_repeats_forward_comm(world, sp, dtype):
    """Under TP (+SP) every mode gives the no-recompute loss and grads bitwise (also in bf16: the
    same ops in the same order). Full recompute reruns each recomputed layer's forward collectives
    in backward: a layer's forward moves 2 all-reduces (TP) or 2 all-gathers (SP) of (b, s, h), so
    tp bytes grow by 2 * b*s*h*bytes per recomputed layer (all-gathers counted by their output);
    selective adds none."""
    per_layer = 2 * 2 * 16 * 32 * dtype.itemsize
    for rank in world:
        res = rank["tp"][(sp, dtype)]
        ref_bytes = res[("none", None)][1]
        for (mode, k), (same, moved) in res.items():
            assert same, (mode, k)
            n = 0 if mode != "full" else (2 if k is None else k)
            assert moved == ref_bytes + n * per_layer, (mode, k, moved, ref_bytes)


def test_zero_stages_shard_fp32_masters_of_a_bf16_model_under_recompute(world):
    """Mixed precision composes with ZeRO: the same bf16 losses for every stage and recompute mode,
    with the fp32 masters, gradient buffers and Adam state sharded (all fp32)."""
    for rank in world:
        for case, (same, fp32) in rank["zero"].items():
            assert same and fp32, case


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pipeline_bitwise(world, dtype):
    """5 layers on 2 stages (3 + 2): "first k" is per stage; every mode matches no recompute
    bitwise."""
    for rank in world:
        for case, (same, finite) in rank["pp"][dtype].items():
            assert same and finite, case
