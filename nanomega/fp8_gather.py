"""ZeRO-3's parameters gathered in FP8: each rank quantizes its shard, the ranks gather the bytes.

Idea: under --fp8 tensorwise a weight's matmuls use one scale s = fmax / amax(W) for the whole
weight, so the gathered bf16 weight would only be quantized again. Instead each rank finds the
amax of its pieces of each weight, the ranks take the MAX (the whole weight's amax: the scale one
process computes), quantize their shard with it and all-gather 1-byte E4M3 codes. The FP8 linear
(fp8_linear.py) consumes the gathered codes and scale directly: no re-quantization, so the GEMMs
see bitwise what one process's FP8 run quantizes (forward, and the same codes transposed for dX:
a tensorwise cast commutes with the transpose). The parameter itself, while gathered, holds the
dequantized values (what anything else reading it sees).
Blockwise (DeepSeek-V3) the same, per 128 x 128 tile: a tile straddles the flat shards' edges, so
each rank takes the amax of its elements of every tile and the ranks MAX the tiles' amax (4 bytes
per tile); a square tile of W is one of W^T, so its codes serve dX too. Under --tp a weight is a
tp shard: a tensorwise amax is MAXed over tp as well (blockwise tiles never straddle tp shards:
fp8_linear.check_tensor_parallel).
    bytes per gather (N ranks, n elements of FP8 weights in a unit, T tiles (tensorwise: one per
    weight), S = ceil(n / N))
      all-gather  N S x 1 byte (bf16: 2 bytes, fp32: 4)      all-reduce MAX  4 T bytes (amax)
    a step gathers each unit twice (forward, backward): 2 (N S + 4 T) per unit (+ 2 x 4 T on tp)
Megatron-Core (--fp8-param-gather) and torchao (its FSDP float8 all-gather of tensorwise weights)
do the same. Refused (fp8_linear.check): rowwise and mxfp8 scale W along each GEMM's own K (rows
for the forward, columns for dX = dY W: one gathered copy cannot serve both), delayed takes its
scale from an amax history the forward rolls after the gather.
The seam: zero3.ShardedParameters(wire=FP8Gather(...)) puts the marked weights (fp8_linear marks
the blocks' linear weights it quantizes) in groups of their own and calls `start` / `arrive` /
`release` around its all-gather; nothing else in the engine knows FP8.
Lesson: lessons/10-fp8-training.md
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nanomega.fp8 import E4M3, Quantized, saturate, scale_from_amax


def tiles(shape, tile):
    """(br, bc, tiles down, tiles across) of a (N, K) weight under (rows, cols) tiles (0: whole)."""
    N, K = shape
    br, bc = tile[0] or N, tile[1] or K
    return br, bc, -(-N // br), -(-K // bc)


def tile_of(a, b, shape, tile, device):
    """The tile of each of the weight's flat (row-major) elements [a, b): (b - a,) int64."""
    br, bc, _, across = tiles(shape, tile)
    j = torch.arange(a, b, device=device)
    return (j // shape[1]) // br * across + (j % shape[1]) // bc


class FP8Gather:
    """The wire format of ZeRO-3's FP8 weights: start (tile amax MAX, quantize the shard, start the
    all-gather of its bytes), arrive (the codes bound to the weights), release. tile: the weights'
    (rows, cols) tile (0, 0): tensorwise; tp: the Axis a whole-weight amax is MAXed over too."""

    def __init__(self, tile=(0, 0), tp=None):
        self.tile, self.tp = tuple(tile), tp if tile == (0, 0) else None
        self.pending = {}  # id(group) -> (gathered codes (N S,) uint8, scales (T,), first tiles)

    @staticmethod
    def takes(p):
        """Does this parameter travel in FP8 (a weight the FP8 linear quantizes whole)?"""
        return getattr(p, "fp8_weight", False)

    def first_tiles(self, g):
        """Each weight's first index in g's vector of tiles, and the count: ([w + 1])."""
        counts = [d * a for _, _, d, a in (tiles(s, self.tile) for s in g.shapes)]
        return [sum(counts[:i]) for i in range(len(counts) + 1)]

    def start(self, g, axis):
        """g's tiles' amax (MAX over the ranks' pieces), g's shard quantized with them, the
        all-gather of the codes started: returns its Work (None on one rank)."""
        first = self.first_tiles(g)
        amax = torch.zeros(first[-1], device=g.device)  # (T,): 0 for a tile not held here
        where = {}  # piece -> its elements' tiles in the vector
        for i, a, b in g.pieces():
            o = g.offsets[i]
            where[i] = first[i] + tile_of(a - o, b - o, g.shapes[i], self.tile, g.device)
            # a NaN: inf (one process's NaN amax gives scale 1, as inf does; MAX keeps inf)
            piece = torch.nan_to_num(g.shard[a - g.lo : b - g.lo].float().abs(), nan=float("inf"))
            amax.scatter_reduce_(0, where[i], piece, "amax")
        amax = axis.all_reduce(amax, op=dist.ReduceOp.MAX)
        if self.tp is not None and self.tp.size > 1:  # a tp shard: the whole weight's amax
            amax = self.tp.all_reduce(amax, op=dist.ReduceOp.MAX)
        scale = scale_from_amax(amax, E4M3)  # (T,)

        # this rank's shard: each element times its tile's scale, cast (padding stays 0); as bytes
        codes = torch.zeros(g.shard_numel, dtype=torch.uint8, device=g.device)  # (S,)
        for i, a, b in g.pieces():
            piece = g.shard[a - g.lo : b - g.lo].float() * scale[where[i]]
            codes[a - g.lo : b - g.lo] = saturate(piece, E4M3).view(torch.uint8)
        full = torch.empty(g.padded, dtype=torch.uint8, device=g.device)  # (N S,)
        self.pending[id(g)] = (full, scale, first)
        return axis.start("all_gather", full, codes)

    def arrive(self, g):
        """After the all-gather: each weight gets its codes (zero-padded to whole tiles) and inverse
        scales (`fp8_gathered`, read by fp8_linear) and g.full the dequantized values the
        parameters become views of."""
        full, scale, first = self.pending.pop(id(g))
        scale_inv = torch.ones_like(scale) / scale  # as fp8.quantize: a true division
        for i, (p, o, n, shape) in enumerate(zip(g.params, g.offsets, g.sizes, g.shapes)):
            br, bc, down, across = tiles(shape, self.tile)
            data = full[o : o + n].view(shape)  # (out, in) uint8
            data = F.pad(data, (0, across * bc - shape[1], 0, down * br - shape[0])).view(E4M3)
            inv = scale_inv[first[i] : first[i + 1]].view(down, across)
            p.fp8_gathered = Quantized(data, inv, (br, bc))
            values = p.fp8_gathered.dequantize()[: shape[0], : shape[1]]
            g.full[o : o + n] = values.reshape(-1).to(g.dtype)

    def release(self, g):
        """The gathered codes dropped with the weights (the shard stays)."""
        self.pending.pop(id(g), None)
        for p in g.params:
            p.fp8_gathered = None


def transposed(q):
    """A Quantized of W as the one of W^T, for tiles that commute with the transpose (tensorwise,
    square blocks): dX = dY W quantizes W along its rows."""
    return Quantized(q.data.t(), q.scale_inv.t(), q.block[::-1])


def step_bytes(sharded):
    """(FP8, --dtype) bytes one rank's ZeRO-3 moves per micro-batch for the weights it gathers in
    FP8 (zero3.ShardedParameters with this wire): each unit gathered twice (forward, backward),
    2 (N S + 4 T) per unit (+ 2 x 4 T on tp), against 2 N S x the model dtype's size for the same
    all-gathers."""
    wire = sharded.wire
    groups = [g for g in sharded.groups if sharded.wired(g.params[0])]
    axes = 1 + (wire.tp is not None and wire.tp.size > 1)
    fp8 = sum(2 * (g.padded + 4 * axes * wire.first_tiles(g)[-1]) for g in groups)
    return fp8, sum(2 * g.padded * g.full.element_size() for g in groups)
