"""FP8 quantization (nanomega/fp8.py) against an independent reference, bitwise.

The reference decodes every 8-bit code by the formats' definitions (sign, biased exponent, mantissa,
subnormals, NaN/inf codes), then rounds each fp32 value to the nearest decoded value by search, a
tie to the even code; saturation and NaN as fp8.py states them. Scales are recomputed in numpy
float32 (fmax / amax), MX's shared exponent from math.frexp (the OCP MX v1.0 floor rule). Nothing
in it calls torch's float8 casts.
"""

import json
import math

import numpy as np
import pytest
import torch

from nanomega import fp8, fp8_linear, train
from nanomega.job import flags
from nanomega.tools import cost_time, plan

MOE = ["--arch", "llama", "--n-experts", "4"]
FORMATS = {fp8.E4M3: (4, 3, 7), fp8.E5M2: (5, 2, 15)}  # exponent bits, mantissa bits, bias


def decode(code, fmt):
    """The value of an 8-bit code, by the format's definition (Micikevicius et al. 2022, OCP)."""
    ebits, mbits, bias = FORMATS[fmt]
    sign = -1.0 if code >> 7 else 1.0
    e, m = (code >> mbits) & ((1 << ebits) - 1), code & ((1 << mbits) - 1)
    if fmt == fp8.E4M3 and e == 15 and m == 7:
        return math.nan  # E4M3fn: S.1111.111 is NaN, no inf
    if fmt == fp8.E5M2 and e == 31:
        return sign * math.inf if m == 0 else math.nan
    if e == 0:  # subnormal
        return sign * m / (1 << mbits) * 2.0 ** (1 - bias)
    return sign * (1 + m / (1 << mbits)) * 2.0 ** (e - bias)


def table(fmt):
    """(codes, values) of the non-negative finite numbers, in increasing order."""
    pairs = [(c, decode(c, fmt)) for c in range(128)]
    pairs = [(c, v) for c, v in pairs if math.isfinite(v)]
    return np.array([c for c, _ in pairs]), np.array([v for _, v in pairs])


def round_ref(values, fmt):
    """fp32 values -> the nearest representable, ties to the even code, |v| > max -> max, NaN NaN."""
    codes, grid = table(fmt)
    out = []
    for v in np.asarray(values, dtype=np.float32).astype(np.float64):
        if math.isnan(v):
            out.append(math.nan)
            continue
        a = min(abs(v), grid[-1])
        i = int(np.searchsorted(grid, a))
        if i < len(grid) and grid[i] == a:
            r = a
        else:
            lo, hi = grid[i - 1], grid[i]
            r = lo if a - lo < hi - a or (a - lo == hi - a and codes[i - 1] % 2 == 0) else hi
        out.append(math.copysign(r, v))
    return np.array(out, dtype=np.float32)


def probes(fmt):
    """Every representable value, the midpoints between neighbours (ties) and one fp32 ulp either
    side, subnormals, values past the max, +-inf, NaN, and a random spread over the range."""
    _, grid = table(fmt)
    mid = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)
    near = np.concatenate([np.nextafter(mid, np.float32(0)), np.nextafter(mid, np.float32(1e9))])
    beyond = np.array([grid[-1] * 1.01, grid[-1] * 2, 1e30, math.inf, math.nan], dtype=np.float32)
    spread = np.random.default_rng(0).lognormal(0, 6, 2000).astype(np.float32)
    v = np.concatenate([grid, mid, near, beyond, spread, [grid[1] / 4, grid[1] * 0.75]])
    v = v.astype(np.float32)
    return np.concatenate([v, -v])


def same_bits(got, want):
    """Bitwise equal as fp32 (NaN == NaN, -0 != +0)."""
    got = np.asarray(got, dtype=np.float32)
    want = np.asarray(want, dtype=np.float32)
    both_nan = np.isnan(got) & np.isnan(want)
    bad = ~both_nan & (got.view(np.int32) != want.view(np.int32))
    assert not bad.any(), f"{bad.sum()} differ, e.g. {want[bad][:4]} -> {got[bad][:4]}"


@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2], ids=["e4m3", "e5m2"])
def test_cast_rounds_to_nearest_even_saturates_and_keeps_nan(fmt):
    v = probes(fmt)
    got = fp8.saturate(torch.from_numpy(v), fmt).float().numpy()
    same_bits(got, round_ref(v, fmt))


def test_reference_is_strict():
    """The reference itself: a tie goes to the even neighbour (0.5 ulp above 1 stays 1, above 1.125
    goes to 1.25), the smallest subnormal's half goes to 0, past the max saturates."""
    r = round_ref([1.0625, 1.1875, 2.0**-10, 1000.0, -math.inf], fp8.E4M3)
    assert list(r) == [1.0, 1.25, 0.0, 448.0, -448.0]


def tiles_ref(x, br, bc, fmt):
    """Per tile: s = fmax / amax in float32 (1 for amax 0 or non-finite), q, 1 / s."""
    R, K = x.shape
    q, inv = np.empty_like(x), np.empty((R // br, K // bc), dtype=np.float32)
    for i in range(R // br):
        for j in range(K // bc):
            t = x[i * br : (i + 1) * br, j * bc : (j + 1) * bc]
            amax = np.float32(np.max(np.abs(t)))
            ok = np.isfinite(amax) and amax > 0
            s = np.float32(np.float32(fp8.FMAX[fmt]) / amax) if ok else np.float32(1)
            q[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = round_ref(
                (t * s).ravel(), fmt
            ).reshape(t.shape)
            inv[i, j] = np.float32(1) / s
    return q, inv


@pytest.mark.parametrize(
    "tile", [(0, 0), (1, 0), (1, 16), (16, 16)], ids=["tensorwise", "rowwise", "1x16", "16x16"]
)
@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2], ids=["e4m3", "e5m2"])
def test_quantize_tiles(tile, fmt):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((32, 48)) * np.exp(rng.uniform(-8, 8, (32, 1)))).astype(np.float32)
    x[3, 5], x[7, :16] = 3e4, 0.0  # an outlier; an all-zero tile (amax 0: scale 1)
    q = fp8.quantize(torch.from_numpy(x), fmt, *tile)
    br, bc = tile[0] or 32, tile[1] or 48
    want_q, want_inv = tiles_ref(x, br, bc, fmt)
    same_bits(q.data.float().numpy(), want_q)
    same_bits(q.scale_inv.numpy(), want_inv)
    deq = want_q * np.repeat(np.repeat(want_inv, br, 0), bc, 1)
    same_bits(q.dequantize().numpy(), deq)


def test_quantize_non_finite():
    """inf saturates under scale 1 (amax inf), NaN stays NaN; an overflowing scale is fp32's max."""
    x = torch.tensor([[math.inf, -1.0, 2.0, math.nan]])
    q = fp8.quantize(x, fp8.E4M3)
    assert q.scale_inv.item() == 1.0
    got = q.data.float()
    assert got[0, :3].tolist() == [448.0, -1.0, 2.0] and got[0, 3].isnan()
    tiny = fp8.quantize(torch.tensor([[1e-45]]), fp8.E4M3)
    assert tiny.scale_inv.item() == np.float32(1) / np.finfo(np.float32).max


def mx_ref(x):
    """OCP MX v1.0 sec. 6.3: shared exponent floor(log2 amax) - 8 (E4M3), clamped to [-127, 127];
    element x / 2^e rounded with saturation; scale code e + 127 (0xFF for a non-finite block)."""
    R, K = x.shape
    q, codes = np.empty_like(x), np.empty((R, K // 32), dtype=np.uint8)
    for i in range(R):
        for j in range(K // 32):
            t = x[i, j * 32 : (j + 1) * 32]
            amax = float(np.max(np.abs(t)))
            if not math.isfinite(amax):
                codes[i, j], q[i, j * 32 : (j + 1) * 32] = 255, np.nan
                continue
            e = math.frexp(amax)[1] - 1 - 8 if amax > 0 else -127 - 8
            e = max(-127, min(127, e))
            codes[i, j] = e + 127
            q[i, j * 32 : (j + 1) * 32] = round_ref(t * np.float32(2.0**-e), fp8.E4M3)
    return q, codes


def test_mx_e8m0_scales():
    """The floor rule at its edges: amax just below and at a power of two, 448 x 2^k, a block whose
    amax/2^e reaches 511 (saturates to 448: the floor rule's known clamp), zero, tiny and huge."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    edges = [np.nextafter(np.float32(4), np.float32(0)), 4.0, 448 * 2.0**-5, 511.0, 1e-30, 3e36]
    for i, amax in enumerate(edges):
        x[i, :32] = x[i, :32] / np.abs(x[i, :32]).max() * np.float32(amax)
    x[6, 32:] = 0.0
    x[7, 32:40] = np.float32(2.0**-140)  # subnormal fp32: the exponent clamps at -127
    q = fp8.quantize_mx(torch.from_numpy(x))
    want_q, want_codes = mx_ref(x)
    same_bits(q.data.float().numpy(), want_q)
    codes = torch.from_numpy(np.ascontiguousarray(want_codes)).view(fp8.E8M0).float().numpy()
    same_bits(q.scale_inv.numpy(), codes)
    assert want_codes[1, 0] - want_codes[0, 0] == 1  # 4 is one binade above 4^-
    assert want_q[3, :32].max() == 448 or want_q[3, :32].min() == -448  # 511 saturated


def test_mx_non_finite_block_is_nan():
    x = torch.ones(1, 64)
    x[0, 3] = math.inf
    q = fp8.quantize_mx(x)
    assert q.scale_inv[0, 0].isnan() and q.scale_inv[0, 1].item() == 2.0**-8
    assert q.dequantize()[0, :32].isnan().all() and (q.dequantize()[0, 32:] == 1).all()


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--fp8", "mxfp8", "--cp", "2", "--block-size", "64"], "32-token tiles"),
        (
            ["--fp8", "mxfp8", "--ep", "2", *MOE, "--batch-size", "1", "--block-size", "48"],
            "--ep 2",
        ),
        (["--fp8", "rowwise", "--zero", "3"], "--zero 3"),
        (["--fp8", "mxfp8", "--zero", "3"], "columns for dX"),
        (["--fp8", "delayed", "--zero", "3"], "amax history"),
        (["--fp8", "tensorwise", "--zero", "3", "--offload-params"], "--offload-params"),
        (["--fp8", "mxfp8", "--dtype", "fp16"], "--dtype fp16"),
        (["--fp8", "tensorwise", "--compile"], "--compile"),
        (["--fp8", "tensorwise", "--pp", "2", "--schedule", "zb-h1"], "--schedule zb-h1"),
        (["--fp8", "delayed", "--recompute", "full"], "--recompute full"),
        (["--fp8", "delayed", "--tp", "2", "--sequence-parallel"], "--tp 2"),
        (["--fp8", "rowwise", "--tp", "2"], "--tp 2"),
        (["--fp8", "mxfp8", "--tp", "2", "--n-embd", "32"], "32-wide tiles"),
    ],
)
def test_bad_combinations_get_one_line(argv, says):
    c = flags.parse(argv)
    with pytest.raises(ValueError) as e:
        fp8_linear.check(c, flags.model_config(c, 4096))
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_good_combinations_pass():
    for argv in (
        ["--fp8", "off", "--tp", "2", "--sequence-parallel"],
        ["--fp8", "mxfp8", "--tp", "2"],
        ["--fp8", "tensorwise", "--zero", "3"],
        ["--fp8", "tensorwise", "--zero", "3", "--tp", "2"],
        ["--fp8", "blockwise", "--fp8-block", "16", "--zero", "3", "--tp", "2"],
        ["--fp8", "blockwise", "--fp8-block", "16", "--tp", "2", "--sequence-parallel"],
        ["--fp8", "rowwise", "--cp", "2"],
        ["--fp8", "mxfp8", "--cp", "2", "--block-size", "128"],
        ["--fp8", "tensorwise", "--ep", "2", *MOE, "--batch-size", "1", "--block-size", "48"],
        ["--fp8", "mxfp8", "--ep", "2", *MOE, "--batch-size", "2", "--block-size", "48"],
    ):
        c = flags.parse(argv)
        fp8_linear.check(c, flags.model_config(c, 4096))


def test_dry_run_shows_the_fp8_gather_bytes():
    """--dry-run at --fp8 tensorwise --zero 3 (bf16, dp 2): the bytes its FP8 weights' all-gathers
    move per micro-batch = the formula from the model's shape, independently: per block, its four
    weights (c_attn 3h x h, c_proj h x h, c_fc 4h x h, the MLP's c_proj h x 4h: 12 h^2 elements,
    padded to a multiple of dp) gathered twice, 1 byte each plus 4 bytes of amax per weight; bf16's:
    2 bytes each. A unit gathered once, or codes of 2 bytes, is off by a factor: this fails."""
    L, h, dp = 2, 64, 2
    argv = ["--n-layer", str(L), "--n-embd", str(h), "--n-head", "4", "--world", str(dp)]
    res = train.main([*argv, "--zero", "3", "--dtype", "bf16", "--fp8", "tensorwise", "--dry-run"])
    padded = -(-12 * h * h // dp) * dp
    assert res["fp8_gather"] == (2 * L * (padded + 4 * 4), 2 * L * 2 * padded)


def test_planner_prices_the_fp8_gemms_at_the_datasheet_peak(capsys):
    """--dry-run at --fp8: for each GPU preset with an FP8 peak, the planner's one-layer time
    without and with FP8 differs by the block's GEMM FLOPs priced at the bf16 and at the FP8 peak,
    computed here independently (GPT-2 block: 12 h^2 weights, 2 b s FLOPs per weight and pass, 3
    passes, recompute none; both at MATMUL's fraction of peak); the peaks are the datasheets'
    (H100/H200 SXM: 3,958 sparse = 1,979 dense FP8 TFLOP/s). The planner's command line takes
    --fp8 (a shorter step on an H100) and refuses it in one line on an A100 (no FP8 units)."""
    L, h, b, s = 2, 64, 4, 128
    argv = ["--n-layer", str(L), "--n-embd", str(h), "--n-head", "4", "--block-size", str(s)]
    argv += ["--batch-size", str(b), "--dtype", "bf16", "--attention", "eager"]
    res = train.main([*argv, "--fp8", "tensorwise", "--dry-run"])
    times = res["fp8_times"]
    assert times["h100-sxm"][:2] == (1979e12, 989e12) and times["h200"][0] == 1979e12
    assert times["h100-pcie"][0] == 1513e12 and "a100-80gb" not in times
    for name, (fp8_peak, peak, base, fast) in times.items():
        gemm = 2 * b * s * 12 * h * h * 3
        saved = gemm / (peak * cost_time.TIME.matmul) - gemm / (fp8_peak * cost_time.TIME.matmul)
        assert base - fast == pytest.approx(saved, rel=1e-9), name
    assert "1,979 TFLOP/s FP8" in capsys.readouterr().out

    plan_argv = ["--model", "gpt2-1.5b", "--gpus", "8", "--tp", "1", "--pp", "1", "--zero", "1"]
    plan_argv += ["--json"]
    steps = []
    for extra in ([], ["--fp8"]):
        plan.main([*plan_argv, "--gpu", "h100-sxm", *extra])
        steps.append(json.loads(capsys.readouterr().out)["estimates"][0]["step_s"])
    assert steps[1] < steps[0]
    with pytest.raises(SystemExit) as e:
        plan.main([*plan_argv, "--gpu", "a100-80gb", "--fp8"])
    assert str(e.value).startswith("plan: --fp8") and "\n" not in str(e.value)
