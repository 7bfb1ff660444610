"""FP8 numbers: two 8-bit formats, a saturating cast, and the scales of each recipe.

Idea: an 8-bit float holds ~2 significant digits over a narrow range, so a tensor is multiplied by
a scale before the cast (its largest magnitude lands near the format's max) and the product of two
quantized operands is multiplied back by both inverse scales. The recipes differ in how many
elements share one scale (granularity) and when the scale is computed:
    format  exp/man  max     smallest normal  smallest subnormal  ulp at 1  non-finite
    E4M3    4 / 3    448     2^-6             2^-9                2^-3      NaN only (fn)
    E5M2    5 / 2    57344   2^-14            2^-16               2^-2      inf and NaN
    E8M0    8 / 0    2^127   2^-127 (scales only: a power of two)                NaN (0xFF)

    recipe      operand x (M, K) shares a scale over        scale s (q = cast(x s), x ~ q / s)
    tensorwise  the whole tensor                            s = fmax / amax, this step's amax
    delayed     the whole tensor                            s = fmax / max(amax history) (TE)
    rowwise     a row: 1 x K                                s = fmax / amax(row)
    blockwise   1 x 128 (activations, gradients),           s = fmax / amax(block) (DeepSeek-V3)
                128 x 128 (weights)
    mxfp8       1 x 32                                      s = 2^-(floor(log2 amax) - 8): E8M0

Rules stated once (quantize): values are rounded to nearest, ties to even (torch's cast); a value
beyond the format's max saturates to +-max (inf too); NaN stays NaN. An amax of 0, inf or NaN gives
s = 1 (and an amax so small that fmax/amax overflows gives fp32's max): inf then saturates, a NaN
block stays NaN. MX: the OCP Microscaling spec v1.0 (sec. 6.3) sets the shared exponent to
floor(log2(amax)) - emax_elem (emax_elem = 8 for E4M3), clamped to E8M0's [-127, 127], elements
cast with saturation; a block whose amax is not finite gets the NaN scale (0xFF).
Lesson: lessons/10-fp8-training.md
"""

from dataclasses import dataclass

import torch

E4M3, E5M2, E8M0 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu
FMAX = {E4M3: 448.0, E5M2: 57344.0}
MX_BLOCK, MX_EMAX = 32, {E4M3: 8, E5M2: 15}  # OCP MX v1.0: 32 elements per scale; emax_elem
FP32_MAX = torch.finfo(torch.float32).max


def saturate(x, fmt):
    """fp32 -> fmt: round to nearest even, |x| > max -> +-max (inf included), NaN stays NaN."""
    m = FMAX[fmt]
    return x.float().clamp(-m, m).to(fmt)


@dataclass
class Quantized:
    """data (R, K) in fp8 and the inverse scales of its tiles: x ~ data * scale_inv, tile by tile.
    block (br, bc): the tile's shape; scale_inv (R/br, K/bc) in fp32 (MX: the E8M0 codes' values)."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple

    def expanded(self):
        """scale_inv spread over the elements: (R, K)."""
        br, bc = self.block
        return self.scale_inv.repeat_interleave(br, 0).repeat_interleave(bc, 1)

    def dequantize(self):
        return self.data.float() * self.expanded()  # (R, K) fp32


def tile(x, rows, cols):
    """The tile shape of a (R, K) operand: rows x cols, 0 meaning the whole dimension; a tile that
    does not divide the operand is refused in one line."""
    R, K = x.shape
    br, bc = rows or R, cols or K
    if R % br or K % bc:
        raise ValueError(f"fp8: a {br} x {bc} tile does not divide a ({R}, {K}) operand")
    return br, bc


def tile_amax(x, block):
    """max |x| over each tile: (R/br, K/bc) in fp32; a NaN in a tile makes its amax NaN."""
    br, bc = block
    R, K = x.shape
    return x.float().abs().view(R // br, br, K // bc, bc).amax(dim=(1, 3))


def scale_from_amax(amax, fmt):
    """s = fmax / amax per tile; amax 0, inf or NaN -> 1; an overflowing s -> fp32's max."""
    # tensor / tensor: a true division (scalar / tensor is a reciprocal times the scalar)
    s = (torch.full_like(amax, FMAX[fmt]) / amax).clamp(max=FP32_MAX)
    return torch.where(torch.isfinite(amax) & (amax > 0), s, torch.ones_like(s))


def quantize(x, fmt, rows=0, cols=0, scale=None, pow2=False):
    """x (R, K) -> Quantized with fmax/amax scales over rows x cols tiles (0: the whole dimension);
    scale: given scales (delayed scaling: from the amax history) instead of this tensor's; pow2:
    each scale rounded down to a power of two (exact inverse; torchao's rowwise recipe)."""
    block = tile(x, rows, cols)
    s = scale_from_amax(tile_amax(x, block), fmt) if scale is None else scale
    s = torch.exp2(torch.floor(torch.log2(s))) if pow2 else s
    s = s.float().expand(x.shape[0] // block[0], x.shape[1] // block[1])
    full = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return Quantized(saturate(x.float() * full, fmt), torch.ones_like(s) / s, block)


def mx_exponent(amax, fmt):
    """OCP MX v1.0: the shared exponent floor(log2 amax) - emax_elem, clamped to [-127, 127];
    frexp gives floor(log2) exactly (amax = m 2^e, m in [0.5, 1): floor = e - 1)."""
    _, e = torch.frexp(amax)
    shared = torch.where(amax > 0, e - 1, torch.full_like(e, -127)) - MX_EMAX[fmt]
    return shared.clamp(-127, 127)


def e8m0(exponent, finite):
    """E8M0 codes of 2^exponent (bias 127); 0xFF (NaN) where the block's amax is not finite."""
    code = torch.where(finite, exponent + 127, torch.full_like(exponent, 255))
    return code.to(torch.uint8).view(E8M0)


def quantize_mx(x, fmt=E4M3):
    """x (R, K) -> Quantized with 1 x 32 tiles and power-of-two scales stored as E8M0: element
    q = saturate(x / 2^e) (the division is exact: a power of two), x ~ q * 2^e."""
    block = tile(x, 1, MX_BLOCK)
    amax = tile_amax(x, block)
    finite = torch.isfinite(amax)
    e = mx_exponent(torch.where(finite, amax, torch.zeros_like(amax)), fmt)
    scales = e8m0(e, finite)  # (R, K/32)
    full = torch.ldexp(torch.ones_like(amax), -e).repeat_interleave(MX_BLOCK, 1)
    data = saturate(x.float() * full, fmt)
    return Quantized(data, scales.float(), block)
