"""Mixed precision (nanomega/precision.py): casting, fp32 softmax/loss, loss scaling, bf16 against
fp32.

Training goes through zero.ZeroEngine on a world of one (the composition train.py uses): the 16-bit
model runs forward/backward, each 16-bit gradient is accumulated into an fp32 buffer, the engine
unscales, skips the step on inf/nan, runs AdamW on the fp32 master weights and writes them back into
the model.
"""

import contextlib
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from nanomega import data
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT
from nanomega.precision import LossScaler, cast_model, check_dtype_supported, parse_dtype, set_tf32
from nanomega.zero import ZeroEngine
from tolerance import unit_roundoff


pytestmark = pytest.mark.usefixtures("one_thread")


def small_gpt(**kw):
    torch.manual_seed(0)
    return GPT(
        GPTConfig(**{**dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32), **kw})
    )


def engine_for(model, dtype, grid, lr):
    """Cast, then let the engine take its fp32 master copy (as train.py composes them)."""
    return ZeroEngine(
        cast_model(model, dtype),
        torch.optim.AdamW,
        dict(lr=lr, betas=(0.9, 0.95), weight_decay=0.1),
        grid,
    )


def mixed_step(engine, micro_batches, scaler):
    """One optimizer step over the micro-batches; returns (mean loss, skipped)."""
    total = 0.0
    for i, (x, y) in enumerate(micro_batches):
        with engine.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            loss = engine.module(x, y) / len(micro_batches)
            scaler.scale_loss(loss).backward()
        total += loss.item()
    return total, not engine.step(scaler=scaler)["stepped"]


# ---------------------------------------------------------------- bad input
def test_bad_dtype_and_unsupported_device_give_one_line(monkeypatch):
    with pytest.raises(ValueError, match="--dtype 'fp8'"):
        parse_dtype("fp8")
    assert parse_dtype("bf16") is torch.bfloat16
    # the truth on this torch (2.13, CPU): fp16 and bf16 matmul + backward run on CPU, so both are
    # allowed
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        check_dtype_supported(dtype, "cpu")

    def missing_kernel(a, b):  # what torch < 2.1 said for an fp16 matmul on CPU
        raise RuntimeError("\"addmm_impl_cpu_\" not implemented for 'Half'")

    monkeypatch.setattr(torch.Tensor, "__matmul__", missing_kernel)
    with pytest.raises(ValueError) as err:
        check_dtype_supported(torch.float16, "cpu")
    msg = str(err.value)
    assert "--dtype fp16" in msg and "cpu" in msg and "use --dtype bf16" in msg and "\n" not in msg


# ---------------------------------------------------------------- cast_model
class LegacyWarns:
    """torch 2.9's cuBLAS settings: both APIs, the legacy setter warns (this torch's no longer
    does)."""

    fp32_precision = "none"

    def __setattr__(self, name, value):
        if name == "allow_tf32":
            warnings.warn(
                "Please use the new API settings to control TF32 behavior (torch 2.9)",
                UserWarning,
                stacklevel=2,
            )
        object.__setattr__(self, name, value)


@pytest.mark.skipif(
    not hasattr(torch.backends.cuda.matmul, "fp32_precision"), reason="torch < 2.9: legacy only"
)
def test_tf32_is_set_through_the_new_settings_without_a_warning(monkeypatch):
    """set_tf32 uses fp32_precision where torch has it: the legacy allow_tf32 setters warned on
    every rank (torch 2.9), and mixing the two APIs raises on newer torch. The flags are
    process-wide: no GPU needed."""
    flags = (torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn)
    saved = [f.fp32_precision for f in flags]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            set_tf32("cpu", False)  # the CPU: nothing to set
            assert [f.fp32_precision for f in flags] == saved
            for enabled, mode in ((False, "ieee"), (True, "tf32")):
                set_tf32(torch.device("cuda"), enabled)
                assert [f.fp32_precision for f in flags] == [mode] * 3
            legacy = LegacyWarns()
            monkeypatch.setattr(torch.backends.cuda, "matmul", legacy)
            set_tf32("cuda", False)
            assert legacy.fp32_precision == "ieee"
        assert [str(w.message) for w in caught] == []
    finally:
        monkeypatch.undo()
        for f, value in zip(flags, saved):
            f.fp32_precision = value


def test_cast_model_keeps_parameters_ties_and_tags():
    model = small_gpt(alibi=True, embed_layernorm=True)
    ids = {name: id(p) for name, p in model.named_parameters()}
    model.blocks["0"].attn.c_attn.weight.tensor_parallel = True  # a tag another module would set
    cast_model(model, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(b.dtype == torch.bfloat16 for b in model.buffers() if b.is_floating_point())
    assert {name: id(p) for name, p in model.named_parameters()} == ids
    assert model.head.lm_head.weight is model.embed.wte.weight
    assert model.blocks["0"].attn.c_attn.weight.tensor_parallel
    with pytest.raises(ValueError, match="floating"):
        cast_model(model, torch.int8)


class OpDtypes(TorchDispatchMode):
    """Records (op name, dtypes of its tensor arguments) of every aten op run under it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(
            (func.overloadpacket.__name__, {a.dtype for a in args if isinstance(a, torch.Tensor)})
        )
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matmuls_in_half_softmax_and_loss_in_fp32(dtype):
    model = cast_model(small_gpt(dropout=0.1, alibi=True), dtype)
    x = torch.randint(0, 256, (2, 32))
    with OpDtypes() as rec:
        loss = model(x, x.roll(1, 1))
        loss.backward()
    assert loss.dtype == torch.float32
    fp32_ops = {
        "_softmax",
        "_softmax_backward_data",
        "_log_softmax",
        "_log_softmax_backward_data",
        "nll_loss_forward",
        "nll_loss_backward",
    }
    seen = {name for name, _ in rec.ops}
    assert fp32_ops <= seen
    for name, dtypes in rec.ops:
        if name in fp32_ops:
            assert dtypes <= {torch.float32, torch.int64}, (name, dtypes)
        if name in ("mm", "bmm", "addmm"):
            assert dtypes == {dtype}, (name, dtypes)


# ---------------------------------------------------------------- loss scaling
def test_loss_scaler_backs_off_grows_and_round_trips():
    s = LossScaler(init_scale=2.0**4, growth_interval=3, min_scale=4.0)
    scales = []
    for found in [False, False, False, True, False, True, True, True, False, False, False]:
        s.update(found)
        scales.append(s.scale)
    assert scales == [16, 16, 32, 16, 16, 8, 4, 4, 4, 4, 8]
    assert s.skipped == 4 and s.good_steps == 0
    fresh = LossScaler()
    fresh.load_state_dict(s.state_dict())
    assert fresh.state_dict() == s.state_dict()
    assert s.scale_loss(torch.tensor(0.5)).item() == 4.0

    static = LossScaler.for_dtype(torch.bfloat16)
    loss = torch.tensor(2.0)
    assert static.scale == 1.0 and static.scale_loss(loss) is loss
    static.update(True)
    assert static.scale == 1.0 and static.skipped == 1
    assert LossScaler.for_dtype(torch.float16).scale == 2.0**16
    with pytest.raises(ValueError, match="growth_factor"):
        LossScaler(backoff_factor=2.0)


def test_fp16_skips_an_overflowing_step_and_recovers(grid):
    """A real fp16 overflow: one step's loss is multiplied by 2^20 on top of the scale (2^10), so
    the 16-bit gradients overflow to inf. That step must leave the fp32 masters and the Adam state
    untouched and halve the scale; three clean steps later the scale is back, and training goes
    on."""
    engine = engine_for(small_gpt(), torch.float16, grid, lr=3e-3)
    scaler = LossScaler(init_scale=2.0**10, growth_interval=3)
    gen = torch.Generator().manual_seed(0)
    # 64 symbols: learnable within a few steps
    ids = torch.randint(0, 64, (12, 4, 33), generator=gen)
    log = []
    for step in range(12):
        batch = [(ids[step, :, :-1], ids[step, :, 1:])]
        if step == 4:
            masters = [g.master.clone() for g in engine.groups]
            adam = [{k: v.clone() for k, v in st.items()} for st in engine.optimizer.state.values()]
            scaler.scale *= 2.0**20  # the injected overflow
        loss, skipped = mixed_step(engine, batch, scaler)
        if step == 4:
            scaler.scale /= 2.0**20
            assert all(torch.equal(a, g.master) for a, g in zip(masters, engine.groups))
            assert all(
                torch.equal(a[k], b[k])
                for a, b in zip(adam, engine.optimizer.state.values())
                for k in a
            )
        log.append((skipped, scaler.scale, loss))
    assert [s for s, _, _ in log] == [False] * 4 + [True] + [False] * 7
    assert [s for _, s, _ in log] == [
        1024,
        1024,
        2048,
        2048,
        1024,
        1024,
        1024,
        2048,
        2048,
        2048,
        4096,
        4096,
    ]
    assert all(torch.isfinite(torch.tensor(loss)) for _, _, loss in log)
    assert log[-1][2] < log[0][2] - 0.3  # still learning after the skipped step
    assert scaler.skipped == 1


# ---------------------------------------------------------------- bf16 against fp32 on the corpus
def test_bf16_tracks_fp32_for_50_steps_with_fp32_masters(grid):
    """50 AdamW steps (2 micro-batches each) on the Shakespeare corpus, fp32 and bf16 compute from
    the same initial weights (rounded to bf16 for both) and batches. Tokens are the text's bytes
    (vocab 256), which keeps the LM head small enough for the test budget. Band, from the arithmetic
    (tests/tolerance.py): bf16 rounds every activation to u = 2^-8 relative; on the path to the loss
    lie DEPTH = 10 such roundings (2 blocks x qkv, attention, proj, MLP; embedding; head), whose
    independent errors add in quadrature, and the mean over 512 tokens only shrinks them: every
    step's loss within BAND = sqrt(DEPTH) u = 1.2% of fp32's, and the last 10 steps' mean difference
    within BAND of their mean (the fp32 masters keep the trajectories from drifting apart; at lr
    2e-3 the two runs take different loss spikes and the comparison measures chaos, not precision,
    hence lr 1e-3). Measured here (AMD EPYC, AVX2): at most 0.13% apart, last 10 steps 0.0021 nats.
    Both must have learned (loss down > 1.5 nats).
    Throughout, the model is bf16 and the masters, the gradient buffers and the Adam state are
    fp32."""
    ids = torch.tensor(list(data.read_corpus(data.DEFAULT_CORPUS)[:200_000].encode()))
    T, mb = 64, 4
    gen = torch.Generator().manual_seed(0)
    starts = torch.randint(0, len(ids) - T - 1, (50, 2, mb), generator=gen)
    batches = [
        [
            (
                torch.stack([ids[i : i + T] for i in row]),
                torch.stack([ids[i + 1 : i + T + 1] for i in row]),
            )
            for row in step
        ]
        for step in starts
    ]
    curves = {}
    for dtype in (torch.float32, torch.bfloat16):
        # the same start
        model = cast_model(small_gpt(block_size=T, n_embd=64, n_head=4), torch.bfloat16)
        engine = engine_for(model, dtype, grid, lr=1e-3)
        scaler = LossScaler.for_dtype(dtype)
        curves[dtype] = torch.tensor([mixed_step(engine, mbs, scaler)[0] for mbs in batches])
        assert {p.dtype for p in model.parameters()} == {dtype}
        state = [v for st in engine.optimizer.state.values() for k, v in st.items() if k != "step"]
        assert {
            t.dtype
            for t in [g.master for g in engine.groups]
            + [g.grad for g in engine.groups if g.grad is not None]
            + state
        } == {torch.float32}
    fp32, bf16 = curves[torch.float32], curves[torch.bfloat16]
    assert fp32[0] - fp32[-10:].mean() > 1.5 and bf16[0] - bf16[-10:].mean() > 1.5
    band = 10**0.5 * unit_roundoff(torch.bfloat16)
    assert ((bf16 - fp32).abs() / fp32).max() < band, (fp32, bf16)
    assert (bf16 - fp32)[-10:].abs().mean() < band * fp32[-10:].mean(), (fp32, bf16)
