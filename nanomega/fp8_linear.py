"""The FP8 linear: the op table's `linear` entry with its three GEMMs in FP8, one recipe each.

Idea: Y = X W^T (forward), dX = dY W and dW = dY^T X (backward) each take two operands quantized
along their contraction dimension K (fp8.py), multiply them in 8 bits, accumulate in fp32 and
return the model's dtype. Weights and activations are E4M3; gradients E5M2 under tensorwise and
delayed scaling (Transformer Engine's HYBRID format), E4M3 under rowwise (torchao's rowwise recipe,
its scales rounded down to a power of two), blockwise (DeepSeek-V3: E4M3 on all tensors) and MX.
Which arithmetic computes each product:
    tensorwise, delayed, rowwise   torch._scaled_mm (fp8 inputs, fp32 accumulation and output;
                                   run on this CPU; the CUDA path is the same call, unverified here)
    blockwise                      emulated: per 128-wide chunk of K an fp32 product of the fp8
                                   values, multiplied by both chunks' scales and added in fp32
                                   (DeepSeek-V3's promotion of the partial sums every 128 along K)
    mxfp8                          emulated: both operands dequantized (exact: power-of-two scales)
                                   and multiplied in fp32
A tile that does not divide a dimension is padded with zeros (the amax and the product unchanged):
the tokens routed to an expert need not be a multiple of 32. Delayed scaling (TE's DelayedScaling:
amax_history_len 1024, amax_compute_algo "max", margin 0) keeps per weight an amax history of X, W
and dY; a GEMM quantizes with s = fmax / max(history) and its amax enters the history when the same
weight's next forward starts (per micro-batch: TE updates once per step; so delayed is refused at
dp > 1 or pp > 1, where that order is not one process's). The head's matmul (the logits), the MoE
router and the shared-expert gate stay in the model's precision; --fp8-min-dim keeps small GEMMs.
Layouts: a whole-tensor amax is MAX-reduced over tp and cp (a row along the tokens over cp), so a
split tensor gets one process's scale. Under ep a routed expert's GEMMs already hold the tokens of
every ep rank (the all-to-all brought them): its amax is its own; a dense weight's operands hold
this rank's tokens only, so their amax is MAX-reduced over ep too: every GEMM quantizes as one
process running the union of the ep ranks' micro-batches. The histories are saved by parameter
name (checkpoints).
Lesson: lessons/10-fp8-training.md
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from nanomega import ep as expert_parallel, schedules, seams
from nanomega.fp8 import E4M3, E5M2, quantize, quantize_mx, scale_from_amax, tile, tile_amax
from nanomega.fp8_gather import transposed
from nanomega.tp import ColumnParallelLinear, RowParallelLinear

ROLES = ("x", "w", "dy")
# the modules that hand the entry their weight parameter itself (its codes may come gathered)
WHOLE = (
    seams.Linear,
    ColumnParallelLinear,
    RowParallelLinear,
)  # the three tensors of a linear: input, weight, output gradient


@dataclass(frozen=True)
class Recipe:
    """act/weight: the (rows, cols) tile of an activation or gradient / of a weight, along K
    (0: the whole dimension); grad: the gradients' format; gemm: which arithmetic."""

    act: tuple
    weight: tuple
    grad: torch.dtype
    gemm: str
    pow2: bool = False  # scales rounded down to a power of two (torchao's rowwise recipe)


def recipe(name, block=128):
    """The recipe of --fp8 `name`; block: blockwise's tile side (DeepSeek-V3: 128)."""
    return {
        "tensorwise": Recipe((0, 0), (0, 0), E5M2, "scaled_mm"),
        "delayed": Recipe((0, 0), (0, 0), E5M2, "scaled_mm"),
        "rowwise": Recipe((1, 0), (1, 0), E4M3, "scaled_mm", pow2=True),
        "blockwise": Recipe((1, block), (block, block), E4M3, "promote"),
        "mxfp8": Recipe((1, 32), (1, 32), E4M3, "mx"),
    }[name]


class History:
    """Delayed scaling's state per weight: amax history (3 roles, L), the scales in use, and this
    micro-batch's amax not yet in the history."""

    def __init__(self, length, device):
        self.amax = torch.zeros(len(ROLES), length, device=device)
        self.scale = torch.ones(len(ROLES), device=device)
        self.pending = None

    def record(self, role, amax):
        i = ROLES.index(role)
        if self.pending is None:
            self.pending = torch.zeros_like(self.scale)
        self.pending[i] = torch.maximum(self.pending[i], amax)

    def roll(self, fmts):
        """The last micro-batch's amax into the history; scales from each role's max of it."""
        if self.pending is None:
            return
        self.amax = torch.cat([self.pending[:, None], self.amax[:, :-1]], 1)
        best = self.amax.amax(1)
        self.scale = torch.stack([scale_from_amax(best[i], f) for i, f in enumerate(fmts)])
        self.pending = None


def pad_to(t, rows, cols):
    """Zeros appended so that (rows, cols) tiles divide t (0: the whole dimension)."""
    R, K = t.shape
    pr, pc = (-R % rows if rows else 0), (-K % cols if cols else 0)
    return F.pad(t, (0, pc, 0, pr)) if pr or pc else t


class FP8:
    """The `linear` entry: (x, weight, bias) -> x W^T + b with the recipe's three FP8 GEMMs.
    name: --fp8; block: blockwise's tile; history: delayed's length; min_dim: a weight with a
    dimension below it stays in the model's precision; tp, cp: the tensor- and context-parallel
    Axes a tensorwise amax is reduced over (MAX: a replicated operand gives its own amax back); cp
    also holds the rest of a row along the tokens (rowwise dW's operands); ep: the expert-parallel
    Axis, over which a dense weight's operands are reduced too (not a routed expert's: `axes`)."""

    def __init__(
        self,
        name,
        dtype=torch.float32,
        block=128,
        history=1024,
        min_dim=0,
        tp=None,
        cp=None,
        ep=None,
    ):
        self.name, self.recipe, self.min_dim = name, recipe(name, block), min_dim
        self.dtype, self.length, self.tp, self.cp, self.ep = dtype, history, tp, cp, ep
        self.histories = WeakIdKeyDictionary()  # weight -> History (delayed only)

    def __repr__(self):
        return f"fp8.FP8({self.name})"

    def __call__(self, x, weight, bias=None):
        # kept: a small GEMM, the MoE router (marked; in a 16-bit model its GEMM is the fp32 one);
        # an expert no token was routed to (nothing to scale: its gradient is zero either way)
        if self.keeps(weight) or x.dtype != self.dtype or x.numel() == 0:
            return F.linear(x, weight, bias)
        return FP8Function.apply(x, weight, bias, self)

    def keeps(self, weight):
        """Does this weight's GEMM stay in the model's precision (marked, or small)?"""
        return getattr(weight, "fp8_keep", False) or min(weight.shape) < self.min_dim

    def fmt(self, role):
        return self.recipe.grad if role == "dy" else E4M3

    def start(self, weight):
        """A forward begins: delayed scaling moves the last micro-batch's amax into the history."""
        if self.name == "delayed":
            if weight not in self.histories:
                self.histories[weight] = History(self.length, weight.device)
            self.histories[weight].roll([self.fmt(r) for r in ROLES])

    def axes(self, weight, *spread):
        """The Axes an amax is MAX-reduced over: `spread` (those the tensor is split over), and ep
        unless the weight is a routed expert's (its rows came from every ep rank already)."""
        return [*spread] + ([] if getattr(weight, "fp8_expert", False) else [self.ep])

    def operand(self, t, role, weight, wt=False, tokens=False):
        """t (R, K) quantized as `role` along K, padded to whole tiles; wt: t is weight^T; tokens:
        K is the tokens (dW's operands: under cp a row continues on the other cp ranks). A weight
        ZeRO-3 gathered in FP8 (fp8_gather.py) comes quantized already: its codes, as they are."""
        gathered = getattr(weight, "fp8_gathered", None) if role == "w" else None
        if gathered is not None:
            return transposed(gathered) if wt else gathered
        r, fmt = self.recipe, self.fmt(role)
        rows, cols = r.weight if role == "w" else r.act
        t = pad_to(t, rows, cols)
        if r.gemm == "mx":
            return quantize_mx(t, fmt)
        if tokens and rows and not cols:  # a row along the tokens: its amax over the cp ranks
            amax = reduced(tile_amax(t, tile(t, rows, cols)), self.axes(weight, self.cp))
            return quantize(t, fmt, rows, cols, scale_from_amax(amax, fmt), pow2=r.pow2)
        if rows or cols:  # tiles: a tp shard or cp chunk holds whole tiles (check): local scales
            return quantize(t, fmt, rows, cols, pow2=r.pow2)
        amax = t.detach().float().abs().amax()  # the whole tensor: max over the tp, cp ranks too
        amax = reduced(amax, self.axes(weight, self.tp, self.cp))
        if self.name == "delayed":
            state = self.histories[weight]
            state.record(role, amax)
            return quantize(t, fmt, scale=state.scale[ROLES.index(role)])
        return quantize(t, fmt, scale=scale_from_amax(amax, fmt))

    def matmul(self, a, role_a, b, role_b, weight, wt=False, tokens=False):
        """a (M, K) @ b (N, K)^T in FP8 -> (M, N) fp32, by the recipe's arithmetic (wt: b = W^T;
        tokens: K is the tokens)."""
        M, N = a.shape[0], b.shape[0]
        qa = self.operand(a, role_a, weight, tokens=tokens)
        qb = self.operand(b, role_b, weight, wt, tokens)
        if self.recipe.gemm == "scaled_mm":
            sa = qa.scale_inv.reshape(()) if qa.scale_inv.numel() == 1 else qa.scale_inv
            sb = qb.scale_inv.reshape(()) if qb.scale_inv.numel() == 1 else qb.scale_inv.t()
            out = torch._scaled_mm(qa.data, qb.data.t(), scale_a=sa, scale_b=sb, out_dtype=a.dtype)
        elif self.recipe.gemm == "promote":
            out = promoted(qa, qb)
        else:
            out = qa.dequantize() @ qb.dequantize().t()
        return out[:M, :N].float()

    def dgrad(self, grad, weight, dtype=None):
        """dX = dY W: (..., N) -> (..., K) in `dtype` (default: grad's). FP8Function's backward;
        tp's sequence-parallel linear calls it through seams.dgrad."""
        if self.keeps(weight):
            return F.linear(grad, weight.t())
        g2 = grad.flatten(0, -2).float()  # (M, N) @ (K, N)^T: K = N
        dx = self.matmul(g2, "dy", weight.float().t(), "w", weight, wt=True)  # (M, K)
        return dx.to(dtype or grad.dtype).view(*grad.shape[:-1], weight.shape[1])

    def wgrad(self, grad, x, weight):
        """dW = dY^T X: (N, K) in the weight's dtype (K of this GEMM: the tokens)."""
        if self.keeps(weight):
            return F.linear(grad.flatten(0, -2).t(), x.flatten(0, -2).t())
        g2, x2 = grad.flatten(0, -2).float(), x.flatten(0, -2).float()  # (M, N), (M, K)
        return self.matmul(g2.t(), "dy", x2.t(), "x", weight, tokens=True).to(weight.dtype)


def reduced(amax, axes):
    """amax MAX-reduced over each Axis given (None or one rank: as it is)."""
    for axis in axes:
        if axis is not None and axis.size > 1:
            amax = axis.all_reduce(amax, op=dist.ReduceOp.MAX)
    return amax


def promoted(qa, qb):
    """DeepSeek-V3's blockwise GEMM: per chunk of K (the tile width) the fp8 values' product in fp32,
    times the chunk's scales (a: per row, b: per row of b), added into an fp32 accumulator."""
    kb = qa.block[1]
    sa = qa.scale_inv.repeat_interleave(qa.block[0], 0)  # (M, K/kb)
    sb = qb.scale_inv.repeat_interleave(qb.block[0], 0)  # (N, K/kb)
    out = torch.zeros(qa.data.shape[0], qb.data.shape[0], device=qa.data.device)
    for c in range(qa.data.shape[1] // kb):
        chunk = slice(c * kb, (c + 1) * kb)
        part = qa.data[:, chunk].float() @ qb.data[:, chunk].float().t()  # (M, N)
        out += part * sa[:, c : c + 1] * sb[:, c][None, :]
    return out


class FP8Function(torch.autograd.Function):
    """Y = X W^T + b; dX = dY W; dW = dY^T X; db = sum dY: the three GEMMs through fp8.matmul."""

    @staticmethod
    def forward(ctx, x, weight, bias, fp8):  # x (..., K), weight (N, K) -> (..., N)
        ctx.save_for_backward(x, weight)
        ctx.fp8, ctx.has_bias = fp8, bias is not None
        fp8.start(weight)
        x2 = x.flatten(0, -2)  # (M, K)
        y = fp8.matmul(x2.float(), "x", weight.float(), "w", weight).to(x.dtype)
        y = y.view(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias

    @staticmethod
    def backward(ctx, grad):  # grad (..., N)
        x, weight = ctx.saved_tensors
        fp8 = ctx.fp8
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = fp8.dgrad(grad, weight, x.dtype).view_as(x)
        if ctx.needs_input_grad[1]:
            dw = fp8.wgrad(grad, x, weight)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = grad.flatten(0, -2).sum(0)
        return dx, dw, db, None


def apply_fp8(
    model, name, dtype=torch.float32, block=128, history=1024, min_dim=0, tp=None, cp=None, ep=None
):
    """--fp8 `name` (not "off"): every block's linear entry becomes one FP8 entry; the head's table
    keeps its linear (the logits' precision), the MoE router and Qwen2-MoE's shared-expert gate
    (a 1-row weight, which rowwise's torch._scaled_mm refuses) are marked kept, the routed experts'
    weights `fp8_expert` (no amax over ep); the weights the entry quantizes whole are marked
    `fp8_weight` (ZeRO-3 may gather them in FP8). Returns the entry."""
    if name == "off":
        return None
    entry = FP8(name, dtype, block, history, min_dim, tp, cp, ep)
    for pname, p in model.named_parameters():
        if "router" in pname or "shared_gate" in pname:  # routing and gating: one output each
            p.fp8_keep = True
        if expert_parallel.is_expert(pname):
            p.fp8_expert = True
    for block_ in model.blocks.values():
        for m in block_.modules():
            if isinstance(m, WHOLE) and min(m.weight.shape) >= min_dim:
                m.weight.fp8_weight = True
    model.replace_op("linear", entry, blocks=list(model.blocks.keys()))
    return entry


def entry_of(model):
    """The model's FP8 entry (its blocks' linear), or None."""
    tables = [b.ops.linear for b in model.blocks.values()]
    return next((f for f in tables if isinstance(f, FP8)), None)


def histories(model, grid):
    """Delayed scaling's state, {parameter name: {amax, scale, pending}} on the CPU (None: no
    delayed entry). Collective over pp: every stage's weights in one table, the same in each of a
    data-parallel rank's shards, so a checkpoint resumed under another pp size finds every layer's
    history by name in any one shard (another dp size: rank 0's, its own micro-batches' amax)."""
    fp8 = entry_of(model)
    if fp8 is None or fp8.name != "delayed":
        return None
    mine = {}
    for name, p in model.named_parameters():
        state = fp8.histories.get(p)
        if state is not None:
            pending = None if state.pending is None else state.pending.cpu().clone()
            mine[name] = dict(amax=state.amax.cpu().clone(), scale=state.scale.cpu().clone())
            mine[name]["pending"] = pending
    return {k: v for table in grid.pp.all_gather_object(mine) for k, v in table.items()}


def load_histories(model, table):
    """histories' table into this rank's delayed entry, by parameter name (a checkpoint without
    one, or another recipe: left as is; a weight not in it starts a fresh history)."""
    fp8 = entry_of(model)
    if table is None or fp8 is None or fp8.name != "delayed":
        return
    for name, p in model.named_parameters():
        if name in table:
            state = History(fp8.length, p.device)
            saved = table[name]
            state.amax, state.scale = saved["amax"].to(p.device), saved["scale"].to(p.device)
            state.pending = None if saved["pending"] is None else saved["pending"].to(p.device)
            fp8.histories[p] = state


def check(c, cfg, dp=1):
    """One line for each combination --fp8 does not run (yet), before any collective. dp: the
    data-parallel size checks.check derived from the world."""
    if c.fp8 == "off":
        return
    side = {"blockwise": c.fp8_block, "mxfp8": 32}.get(c.fp8, 1)  # tiles along the tokens
    if c.ep > 1 and (c.batch_size * c.block_size // c.cp) % side:
        raise ValueError(
            f"--fp8 {c.fp8} with --ep {c.ep}: a rank's micro-batch ({c.batch_size * c.block_size // c.cp} "
            f"tokens) is not a whole number of {side}-token tiles, so dW's tiles along the tokens "
            "would group them unlike one process running the ep ranks' union; pick --batch-size x "
            f"--block-size divisible by {side * c.cp}"
        )
    if c.cp > 1 and (c.block_size // (2 * c.cp)) % side:
        raise ValueError(
            f"--fp8 {c.fp8} with --cp {c.cp}: a cp chunk (--block-size / 2cp = "
            f"{c.block_size // (2 * c.cp)} tokens) is not a whole number of {side}-token tiles "
            f"(dW's tiles run along the tokens); pick --block-size divisible by {2 * c.cp * side}"
        )
    if c.tp > 1:
        check_tensor_parallel(c, cfg)
    gather = {  # fp8_gather.py: the weights' codes gathered once serve the forward and dX
        "rowwise": "scales W along each GEMM's own K (by rows forward, by columns for dX = dY W): "
        "one gathered copy cannot serve both",
        "mxfp8": "scales W in 1 x 32 blocks along each GEMM's own K (rows forward, columns for "
        "dX = dY W): one gathered copy cannot serve both",
        "delayed": "takes W's scale from its amax history, which the forward rolls after the "
        "gather",
    }
    refusals = {
        f"--zero 3 (its FP8 weight gather: --fp8 {c.fp8} {gather.get(c.fp8)}; use tensorwise or "
        "blockwise)": c.zero == 3 and c.fp8 in gather,
        "--zero 3 --offload-params (the FP8 gather quantizes the shard on the device; the host "
        "shard's upload first is not built)": c.zero == 3 and c.offload_params,
        "--dtype fp16 (FP8's own scales replace loss scaling; use --dtype bf16 or fp32)": (
            c.dtype == "fp16"
        ),
        "--compile (the FP8 GEMMs are Python code torch.compile does not trace here)": c.compile,
        # both replace the linear entry: the zero-bubble split would be overwritten by the FP8 one
        f"--schedule {c.schedule} (its B/W split and FP8 both replace the linear entry; not "
        "composed yet)": c.schedule in schedules.SPLIT and c.pp > 1,
        "--recompute full (delayed scaling would record each forward twice)": (
            c.fp8 == "delayed" and c.recompute == "full"
        ),
        # found by the layout fuzzer (tests/fuzz.py): one process's history has seen every earlier
        # micro-batch of the step, in its order; a dp rank only its own, a pp stage another order
        f"dp {dp} or --pp {c.pp} (its amax history rolls at each weight's next forward, so the "
        "scales would follow a rank's own micro-batches and the schedule's order, not one "
        "process's; rolling once a step with the amax reduced over dp is not built; use "
        "tensorwise)": c.fp8 == "delayed" and (dp > 1 or c.pp > 1),
    }
    for what, bad in refusals.items():
        if bad:
            raise ValueError(f"--fp8 {c.fp8} does not run with {what}")


def check_tensor_parallel(c, cfg):
    """--tp: a tensorwise amax is reduced over tp; tiles must not straddle two ranks' shards."""
    if c.fp8 in ("rowwise", "delayed") or c.fp8_min_dim:
        raise ValueError(
            f"--fp8 {c.fp8} with --tp {c.tp}: built for tensorwise, blockwise and mxfp8 without "
            "--fp8-min-dim (a row's amax would need to know which dimension tp splits, a shard's "
            "size is not the weight's); use --tp 1"
        )
    side = {"blockwise": c.fp8_block, "mxfp8": 32}.get(c.fp8, 1)
    ffn = cfg.ffn
    if (c.n_embd // c.tp) % side or (ffn // c.tp) % side:
        raise ValueError(
            f"--fp8 {c.fp8} with --tp {c.tp}: a tp shard (--n-embd / tp = {c.n_embd // c.tp}, the "
            f"MLP's width / tp = {ffn // c.tp}) is not a whole number of {side}-wide tiles; pick "
            f"widths divisible by {side * c.tp}"
        )
