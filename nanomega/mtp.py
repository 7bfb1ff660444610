"""Multi-token prediction (MTP; DeepSeek-V3, arXiv 2412.19437 Sec. 2.2): D extra modules after the
trunk, module k predicting the token k + 1 ahead, one after the other.

Idea: module k takes the previous depth's hidden state h^(k-1) (h^0: the trunk's last, before the
final norm) and the embedding of token t_(i+k), normalizes each, concatenates them, projects 2h ->
h and runs one transformer block of its own; its own final norm and the model's LM head give the
logits of t_(i+k+1). The embedding and the head are the model's (on a pipeline's last stage the
tied copy pp.py keeps there), so every module sits on the last stage. Each depth's cross-entropy is
averaged over its valid targets in the WHOLE step -- every dp rank's and every micro-batch's,
counted before the first forward (prepare: one all-reduce of D numbers) -- not over a rank's own:
a local mean weighs each rank's tokens by 1 / its count, which uneven counts (documents, ignored
targets) make differ (Megatron-LM #7452). The MTP loss joins the backward beside the LM loss
(WithLoss); the loss a step reports stays the LM loss.
Formulas (D modules, weight lambda, T_k: depth k's valid targets in the step over all ranks):
    h'_i^k = W_k [RMSNorm(Emb(t_(i+k))); RMSNorm(h_i^(k-1))]    (2h -> h; the embedding first, the
                                                                 order of DeepSeek-V3's weights)
    h_i^k  = Block_k(h'^k)_i;   p_(i+k+1) = softmax(Head(RMSNorm_k(h_i^k)))
    L_MTP  = lambda / D  sum_k  1 / T_k  sum_(valid i) CE(p_(i+k+1), t_(i+k+1))
    valid  i + k < s, neither token ignored (-1), and (--document-mask) t_(i+k) in token i's document
    parameters  D (block + 2h^2 + 3h);  FLOPs/token  D (6 (block + 2h^2 + 3h + V h) + 12 h s)
Lesson: lessons/02-the-modern-block.md
"""

import torch
import torch.nn as nn

from .seams import Linear


class Depth(nn.Module):
    """Module k: the embedding's and the hidden state's norms, the 2h -> h projection, a block
    (model.py builds it: the Llama block, its own op table) and the final norm before the head."""

    def __init__(self, cfg, block, norm):
        super().__init__()
        ops = block.ops  # the block's table: its norms and projection swap with it (fused.py)
        self.e_norm, self.h_norm = norm(cfg, ops), norm(cfg, ops)
        self.eh_proj = Linear(2 * cfg.n_embd, cfg.n_embd, bias=False, ops=ops)
        self.block = block
        self.out_norm = norm(cfg, ops)

    def forward(self, h, e, docs=None, positions=None):  # (b, s, h) twice -> (b, s, h)
        x = self.eh_proj(torch.cat([self.e_norm(e), self.h_norm(h)], -1))
        return self.block(x, docs, positions)


class WithLoss(torch.autograd.Function):
    """Forward: the LM loss unchanged. Backward: its gradient passed on, and the same to `extra`,
    as if extra had been added to the loss (Megatron-Core's MTPLossAutoScaler)."""

    @staticmethod
    def forward(ctx, loss, extra):
        return loss

    @staticmethod
    def backward(ctx, grad):
        return grad, grad


class MultiTokenPrediction(nn.Module):
    """The D modules. weights: (D,) each depth's factor on its summed cross-entropy, set by prepare
    for the step (None: this micro-batch alone is the step, as a plain forward and backward)."""

    def __init__(self, cfg, blocks, norm):
        super().__init__()
        self.depths = nn.ModuleDict({str(k): Depth(cfg, b, norm) for k, b in enumerate(blocks)})
        self.scale = cfg.mtp_loss_scaling_factor
        self.weights = None
        self.booked = None  # (2, D) fp64: each depth's summed cross-entropy and valid targets

    def forward(self, h, loss, targets, embed, head, docs=None, positions=None):
        """h (b, s, h): the trunk's last hidden state; loss: this micro-batch's LM loss; targets
        (b, s): t_(i+1); embed: ids -> (b, s, h); head: the model's (its lm_head and loss entry).
        Returns loss, with the MTP loss joined to its backward."""
        sums, counts = [], []
        for k, depth in enumerate(self.depths.values(), start=1):
            tokens, goal = shifted(targets, k, docs)
            h = depth(h, embed(tokens), docs, positions)
            count = (goal >= 0).sum()
            # no valid target here: one stand-in, weighted by its count 0 (finite gradients)
            stand_in = torch.zeros_like(goal, dtype=torch.bool)
            stand_in[:, 0] = True
            goal = goal.masked_fill(stand_in & (count == 0), 0)
            mean = head.ops.loss(head.lm_head(depth.out_norm(h)), goal)  # over this micro-batch
            sums.append(mean * count)
            counts.append(count)
        sums = torch.stack(sums)  # (D,) the summed cross-entropy of each depth
        # booked for the step's row (step_stats)
        booked = torch.stack([sums.detach(), torch.stack(counts).to(sums.dtype)]).double()
        self.booked = booked if self.booked is None else self.booked + booked
        weights = self.weights
        if weights is None:
            weights = self.scale / len(sums) / torch.stack(counts).clamp(min=1)
        return WithLoss.apply(loss, (sums * weights).sum())


def shifted(targets, k, docs=None):
    """Depth k's input tokens t_(i+k) and targets t_(i+k+1), -1 where not valid, each (b, s), from
    the LM's targets t_(i+1) (b, s) and the document ids (b, s) or None."""
    b, s = targets.shape
    later = torch.cat([targets, targets.new_full((b, k), -1)], 1)  # (b, s + k)
    tokens, goal = later[:, k - 1 : k - 1 + s], later[:, k : k + s]
    valid = (tokens >= 0) & (goal >= 0)
    if docs is not None:  # t_(i+k) is the window's token i + k: in token i's document
        valid &= torch.cat([docs[:, k:], docs.new_full((b, k), -1)], 1) == docs
    return tokens.clamp(min=0), goal.masked_fill(~valid, -1)


def prepare(model, grid, batches):
    """Before a step's first forward: each depth's valid targets in the step (this rank's
    micro-batches, summed over dp x cp: one all-reduce of D numbers), and the factor on each
    micro-batch's summed cross-entropy such that, after the LM loss's 1 / m and the engine's mean
    over dp x cp, depth k's loss is the mean over all of them: lambda / D x m x dp_cp / T_k.
    Nothing without MTP modules (off, or not the last pipeline stage)."""
    mtp = getattr(model, "mtp", None)
    if mtp is None:
        return
    depths = len(mtp.depths)
    counts = torch.zeros(depths, dtype=torch.float64, device=grid.device)
    for _, y, *docs in batches:  # (x, y) or (x, y, document ids)
        for k in range(1, depths + 1):
            counts[k - 1] += (shifted(y, k, *docs)[1] >= 0).sum()
    counts = grid.dp_cp.all_reduce(counts)
    factor = mtp.scale / depths * len(batches) * grid.dp_cp.size
    mtp.weights = (factor / counts.clamp(min=1)).float()


def step_stats(model, grid):
    """The step's MTP numbers for its metrics row, the same on every rank: each depth's mean
    cross-entropy over its valid targets in the whole step (the booked sums and counts summed over
    dp x cp and over pp: the modules are on the last stage; tp ranks hold the same), and their
    mean over the depths (before lambda: comparable with the LM loss). Resets the booking."""
    depths = model.cfg.mtp_num_layers
    if not depths:
        return {}
    rows = torch.zeros(2, depths, dtype=torch.float64, device=grid.device)
    mtp = getattr(model, "mtp", None)
    if mtp is not None and mtp.booked is not None:
        rows += mtp.booked.to(rows.device)
        mtp.booked = None
    rows = grid.pp.all_reduce(grid.dp_cp.all_reduce(rows))
    per_depth = rows[0] / rows[1].clamp(min=1)
    return dict(mtp_loss=per_depth.mean().item(), mtp_loss_depths=per_depth.tolist())


def check(cfg, tp=1, pp=1, cp=1):
    """One line for what MTP does not compose with (before any collective)."""
    if not cfg.mtp_num_layers:
        return
    if cfg.mtp_num_layers >= cfg.block_size:
        raise ValueError(
            f"--mtp-num-layers {cfg.mtp_num_layers} predicts past the window: use fewer than "
            f"--block-size {cfg.block_size}"
        )
    refused = [
        (cp > 1, f"--cp {cp}: a chunk's last tokens need the tokens k ahead, on another cp rank"),
        (
            tp > 1 and pp > 1,
            f"--tp {tp} and --pp {pp}: the last stage's copy of the embedding is a vocabulary "
            f"shard, and its lookup over tp is not built",
        ),
        (
            pp > 1 and not cfg.tie_embeddings,
            f"--pp {pp} with --untie-embeddings: the last stage holds no embedding to look up "
            f"t_(i+k) (tied, it holds the head's copy)",
        ),
        (
            cfg.n_experts > 0,
            "--n-experts: an MoE block in an MTP module would sit outside moe.py's layer "
            "statistics and bias updates",
        ),
    ]
    for bad, why in refused:
        if bad:
            raise ValueError(f"--mtp-num-layers with {why}; not built: leave one of them out")
