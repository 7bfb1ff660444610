"""ZeRO-3's parameters gathered in FP8: each rank quantizes its shard, the ranks gather the bytes.

Idea: under --fp8 tensorwise a weight's matmuls use one scale s = fmax / amax(W) for the whole
weight, so the gathered bf16 weight would only be quantized again. Instead each rank finds the
amax of its pieces of each weight, the ranks take the MAX (the whole weight's amax: the scale one
process computes), quantize their shard with it and all-gather 1-byte E4M3 codes. The FP8 linear
(fp8_linear.py) consumes the gathered codes and scale directly: no re-quantization, so the GEMMs
see bitwise what one process's FP8 run quantizes (forward, and the same codes transposed for dX:
a tensorwise cast commutes with the transpose). The parameter itself, while gathered, holds the
dequantized values (what anything else reading it sees).
    bytes per gather (N ranks, n elements of FP8 weights in a unit, w weights, S = ceil(n / N))
      all-gather  N S x 1 byte (bf16: 2 bytes, fp32: 4)      all-reduce MAX  4 w bytes (amax)
    a step gathers each unit twice (forward, backward): 2 (N S + 4 w) per unit
Megatron-Core (--fp8-param-gather) and torchao (its FSDP float8 all-gather of tensorwise weights)
do the same. Only tensorwise is built: rowwise and mxfp8 quantize W along each GEMM's own K (the
transpose cuts other tiles), delayed takes its scale from a history, blockwise's 128 x 128 tiles
straddle the flat shards' edges; --zero 3 refuses them with --fp8 (fp8_linear.check).
The seam: zero3.ShardedParameters(wire=FP8Gather()) puts the marked weights (fp8_linear marks the
blocks' linear weights it quantizes) in groups of their own and calls `start` / `arrive` /
`release` around its all-gather; nothing else in the engine knows FP8.
Lesson: lessons/20-fp8-training.md
"""

import torch
import torch.distributed as dist

from nanomega.fp8 import E4M3, Quantized, saturate, scale_from_amax


class FP8Gather:
    """The wire format of ZeRO-3's FP8 weights: start (amax MAX, quantize the shard, start the
    all-gather of its bytes), arrive (the codes bound to the weights), release."""

    def __init__(self):
        self.pending = {}  # id(group) -> (gathered codes (N S,) uint8, scales (w,))

    @staticmethod
    def takes(p):
        """Does this parameter travel in FP8 (a weight the FP8 linear quantizes whole)?"""
        return getattr(p, "fp8_weight", False)

    def start(self, g, axis):
        """g's whole-weight amax (MAX over the ranks' pieces), g's shard quantized with it, the
        all-gather of the codes started: returns its Work (None on one rank)."""
        amax = torch.zeros(len(g.params), device=g.device)  # (w,): 0 for a weight not held here
        for i, a, b in g.pieces():
            amax[i] = g.shard[a - g.lo : b - g.lo].float().abs().amax()
        # a NaN piece: inf (one process's NaN amax gives scale 1, as inf does; MAX keeps inf)
        amax = axis.all_reduce(torch.nan_to_num(amax, nan=float("inf")), op=dist.ReduceOp.MAX)
        scale = scale_from_amax(amax, E4M3)  # (w,)

        # this rank's shard: each piece times its weight's scale, cast (padding stays 0); as bytes
        codes = torch.zeros(g.shard_numel, dtype=torch.uint8, device=g.device)  # (S,)
        for i, a, b in g.pieces():
            piece = g.shard[a - g.lo : b - g.lo].float() * scale[i]
            codes[a - g.lo : b - g.lo] = saturate(piece, E4M3).view(torch.uint8)
        full = torch.empty(g.padded, dtype=torch.uint8, device=g.device)  # (N S,)
        self.pending[id(g)] = (full, scale)
        return axis.start("all_gather", full, codes)

    def arrive(self, g):
        """After the all-gather: each weight gets its codes and inverse scale (`fp8_gathered`, read
        by fp8_linear) and g.full the dequantized values the parameters become views of."""
        full, scale = self.pending.pop(id(g))
        codes = full.view(E4M3)
        scale_inv = torch.ones_like(scale) / scale  # as fp8.quantize: a true division
        for i, (p, o, n, shape) in enumerate(zip(g.params, g.offsets, g.sizes, g.shapes)):
            data = codes[o : o + n].view(shape)  # (out, in)
            p.fp8_gathered = Quantized(data, scale_inv[i].reshape(1, 1), tuple(shape))
            g.full[o : o + n] = (data.float() * scale_inv[i]).view(-1).to(g.dtype)

    def release(self, g):
        """The gathered codes dropped with the weights (the shard stays)."""
        self.pending.pop(id(g), None)
        for p in g.params:
            p.fp8_gathered = None


def transposed(q):
    """A tensorwise Quantized of W as the one of W^T (dX = dY W quantizes W along its rows)."""
    return Quantized(q.data.t(), q.scale_inv, q.block[::-1])


def step_bytes(sharded):
    """(FP8, --dtype) bytes one rank's ZeRO-3 moves per micro-batch for the weights it gathers in
    FP8 (zero3.ShardedParameters with this wire): each unit gathered twice (forward, backward),
    2 (N S + 4 w) per unit, against 2 N S x the model dtype's size for the same all-gathers."""
    groups = [g for g in sharded.groups if sharded.wired(g.params[0])]
    fp8 = sum(2 * (g.padded + 4 * len(g.params)) for g in groups)
    return fp8, sum(2 * g.padded * g.full.element_size() for g in groups)
