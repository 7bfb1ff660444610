"""ZeRO++ (Wang et al. 2023, arXiv 2306.10209): ZeRO-3 with less traffic on the slow links.

ZeRO-3 moves 3 (N-1)/N Psi per step over all N dp ranks: an all-gather of the weights before each
unit's forward, another before its backward, a reduce-scatter of the gradients. When the ranks sit
on H hosts of S (N = S R), every one of those rings crosses the slow inter-host link. ZeRO++ cuts
each of the three:
    qwZ  the forward all-gather of int8 (or int4) codes, blockwise: each rank quantizes its own
         shard in blocks of B elements, one fp32 scale (amax / q) each; dequantized after the gather
    hpZ  a secondary copy of the gathered weights, sharded over the host's S ranks (kept from the
         forward to the backward): the backward all-gather stays inside the host
    qgZ  the gradient reduce-scatter replaced by two all-to-alls of quantized blocks: inside the
         host (each rank gets, for every host, the chunk of its own index s: R c elements), summed
         in fp32, quantized again and sent across (each rank gets its own chunk from every host)
    quantize x (blocks of B): q = 2^(bits-1) - 1, scale = amax(block) / q,
              code = round(x / scale) in [-q, q]; x' = code x scale, |x' - x| <= scale / 2
    bytes per rank per step, a group of P padded elements, c = P / N, m micro-batches
    (formulas.zeropp_comm_bytes; "across": an axis whose ranks span hosts, whose ring the slow
    link paces)
      forward gather   plain (N-1)/N P b      qwZ (N-1) row(c)
      backward gather  as forward             hpZ (S-1)/S P b, inside
      reduce-scatter   plain (N-1)/N P 4      qgZ inside (S-1) row(R c), across (R-1) row(c),
                                              row(k) = blocks(k) B bits/8 + 4 blocks(k)
    memory  hpZ holds 2 Psi / S more (the secondary copy, in the model's dtype) from forward to
            backward
The seams: qwZ is zero3.ShardedParameters' `wire` (start / arrive / release, as fp8_gather.py);
hpZ its `secondary` axis; qgZ zero_buckets.ShardBuckets' `scatter`. ZeroEngine(zeropp=Plan(...)).
Lesson: lessons/17-communication-compression.md
"""

import dataclasses

import torch
import torch.nn.functional as F

from .formulas import quant_block

BLOCK = 2048  # elements per scale (DeepSpeed's ZeRO++ quantizer targets groups of a few thousand)
BITS = (4, 8)


def levels(bits):
    """The largest code of a symmetric `bits`-bit quantizer: 127 (int8), 7 (int4)."""
    return 2 ** (bits - 1) - 1


def quantize(x, bits=8, block=BLOCK):
    """x (rows, k) -> (codes (rows, blocks x B x bits / 8) uint8, scales (rows, blocks) fp32).
    int8: the codes' two's complement bytes; int4: code + 8 in a nibble, element 2i low, 2i + 1
    high. A zero block gets scale 1 (its codes are 0)."""
    rows, k = x.shape
    b = quant_block(k, block)
    blocks = -(-k // b)
    x = F.pad(x.float(), (0, blocks * b - k)).view(rows, blocks, b)  # (rows, blocks, B)
    q = levels(bits)
    scale = x.abs().amax(-1) / q  # (rows, blocks)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(x / scale[..., None]).clamp_(-q, q).to(torch.int8)  # (rows, blocks, B)
    if bits == 8:
        return codes.view(torch.uint8).view(rows, -1), scale
    nibbles = (codes + 8).to(torch.uint8).view(rows, -1)  # (rows, blocks B) in [1, 15]
    return nibbles[:, 0::2] | (nibbles[:, 1::2] << 4), scale


def dequantize(codes, scale, k, bits=8):
    """quantize's inverse: (rows, k) fp32, each code times its block's scale."""
    rows, blocks = scale.shape
    if bits == 8:
        values = codes.view(torch.int8)
    else:  # the nibbles back in order: low (element 2i), high (2i + 1)
        pairs = torch.stack([codes & 15, codes >> 4], dim=-1).view(rows, -1)
        values = pairs.to(torch.int8) - 8
    values = values.view(rows, blocks, -1).float() * scale[..., None]  # (rows, blocks, B)
    return values.view(rows, -1)[:, :k]


class Works:
    """Several running collectives as one Work (None: done already)."""

    def __init__(self, works):
        self.works = [w for w in works if w is not None]

    def wait(self):
        for w in self.works:
            w.wait()


class QuantizedGather:
    """qwZ, the wire of ZeRO-3's all-gather (zero3.ShardedParameters(wire=...)): each rank's shard
    quantized blockwise, the codes and scales gathered, every rank dequantizing the same bytes
    (so the replicas see the same weights; the fp32 masters stay exact)."""

    def __init__(self, bits=8, block=BLOCK):
        self.bits, self.block = bits, block
        self.pending = {}  # id(group) -> (codes (N, row), scales (N, blocks))

    @staticmethod
    def takes(p):
        return p.is_floating_point()

    def start(self, g, axis):
        codes, scale = quantize(g.shard.view(1, -1), self.bits, self.block)  # (1, row), (1, blocks)
        full = codes.new_empty(axis.size, codes.shape[1])  # (N, row)
        scales = scale.new_empty(axis.size, scale.shape[1])  # (N, blocks)
        self.pending[id(g)] = (full, scales)
        return Works(
            [
                axis.start("all_gather", full.view(-1), codes[0]),
                axis.start("all_gather", scales.view(-1), scale[0]),
            ]
        )

    def arrive(self, g):
        full, scales = self.pending.pop(id(g))
        values = dequantize(full, scales, g.shard_numel, self.bits)  # (N, S)
        g.full.copy_(values.reshape(-1).to(g.dtype))

    def release(self, g):
        self.pending.pop(id(g), None)


def exchange(rows, axis, bits, block=BLOCK):
    """rows (n, k): row i quantized and sent to rank i of `axis` (an all-to-all of the codes, one
    of the scales); -> (n, k) fp32, row i dequantized from rank i."""
    codes, scale = quantize(rows, bits, block)
    codes_in, scale_in = torch.empty_like(codes), torch.empty_like(scale)
    axis.all_to_all(codes_in, codes)
    axis.all_to_all(scale_in, scale)
    return dequantize(codes_in, scale_in, rows.shape[1], bits)


def reduce_scatter(out, t, inside, across, bits, block=BLOCK):
    """qgZ: out (c,) := the sum over the N = S R ranks of chunk d of t (N c,), d = r S + s this
    rank's index on the dp axis (r: its host, s: its index inside). Two quantized all-to-alls,
    summed in fp32 after each; returns None (done: the caller's reduce-scatter Work slot)."""
    S, R = inside.size, across.size
    c = out.numel()
    # inside the host: to rank s' of the host, the chunks r' S + s' of every host r'
    rows = t.view(R, S, c).transpose(0, 1).reshape(S, R * c)  # (S, R c)
    host = exchange(rows, inside, bits, block).sum(0)  # (R c,): this host's sums of chunks r' S + s
    # across the hosts: to host r', its chunk r' S + s
    out.copy_(exchange(host.view(R, c), across, bits, block).sum(0))  # (c,)
    return None


@dataclasses.dataclass(frozen=True)
class Plan:
    """What ZeRO++ changes in one engine (zero.ZeroEngine(zeropp=...)): qwz / qgz bits (0: off),
    hpz on or off; inside: the host's ranks (grid.dp_shard), across: the same index on every host
    (grid.dp_rep)."""

    qwz: int = 0
    hpz: bool = False
    qgz: int = 0
    inside: object = None  # dist.Axis
    across: object = None  # dist.Axis
    block: int = BLOCK

    def wire(self):
        """ZeRO-3's all-gather format: quantized (qwZ) or None (the model's dtype)."""
        return QuantizedGather(self.qwz, self.block) if self.qwz else None

    @property
    def secondary(self):
        """hpZ: the axis the backward all-gather runs over (None: the primary's)."""
        return self.inside if self.hpz else None

    def scatter(self):
        """qgZ: the reduce-scatter of ZeRO's gradient buckets, (out, t) -> None; None: plain."""
        if not self.qgz:
            return None
        return lambda out, t: reduce_scatter(out, t, self.inside, self.across, self.qgz, self.block)


def error(qwz, hpz, qgz, zero, dp, dp_shard, fp8="off", cp=1, ep=1, pp=1, offload=0.0):
    """Why these ZeRO++ flags cannot run, or None: one line each."""
    if not (qwz or hpz or qgz):
        return None
    names = " ".join(
        f for f, on in (("--zeropp-qwz", qwz), ("--zeropp-hpz", hpz), ("--zeropp-qgz", qgz)) if on
    )
    for flag, bits in (("--zeropp-qwz", qwz), ("--zeropp-qgz", qgz)):
        if bits and bits not in BITS:
            return f"{flag} {bits}: the quantizer's bits are 4 or 8 (0: off)"
    if zero != 3:
        return f"{names} with --zero {zero}: ZeRO++ changes ZeRO-3's collectives; use --zero 3"
    if (hpz or qgz) and dp_shard in (0, dp):
        return (
            f"{names}: hpZ and qgZ need the host size, --dp-shard S (S ranks per host, S < dp "
            f"{dp}, dividing it): the backward gather / first gradient exchange stay inside it"
        )
    if qwz and fp8 != "off":
        return f"--zeropp-qwz with --fp8 {fp8}: --fp8 gathers its weights in FP8 already; pick one"
    if max(cp, ep, pp) > 1 or offload:
        return (
            f"{names} with --cp {cp} / --ep {ep} / --pp {pp} / --offload {offload}: ZeRO++ is "
            f"built and tested for tp x dp layouts only so far (issue 46); leave it out"
        )
    return None
