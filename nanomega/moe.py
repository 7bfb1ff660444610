"""Mixture of experts: a router sends each token to k of E SwiGLU experts; the Llama block's MLP, replaced.

Idea (Shazeer et al. 2017; Switch, Fedus et al. 2021; GShard, Lepikhin et al. 2020; Mixtral; DeepSeek-V3):
E experts hold E x the MLP parameters, but each token runs through only k of them, so the FLOPs per token are
those of k MLPs. A router (one (E, h) matrix, fp32) scores every token; two conventions pick and weigh:
    mixtral   top-k of the logits, then a softmax over those k       (= softmax over all, top-k, renormalized)
    deepseek  softmax over all E, then top-k, the k weights renormalized to sum 1; qwen: not renormalized
              (Qwen2-MoE's norm_topk_prob = False)
Nothing makes the router spread the tokens: left alone, a few experts win everything. Three remedies:
    aux loss   Switch/GShard: E * sum_e f_e P_e, f_e the share of the assignments to expert e, P_e the mean
               router probability of e; 1 when uniform, up to E when one expert takes all. Its gradient flows
               through P (f is a count).
    bias       DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the scores for the
               choice only (never to the weights), moved after each step by rate * sign(mean load - load_e)
               outside autograd (update_bias): an overloaded expert becomes less attractive
    capacity   at most C = ceil(cf * s * k / E) assignments per expert and sequence; the rest are dropped (their
               token keeps only its residual and its other experts); cf = 0: dropless
The router z-loss (ST-MoE, Zoph et al. 2022) mean(logsumexp(logits)^2) keeps the logits small.
Where the statistics are gathered, so no layout changes the loss: f, P, the capacity and the z-loss are taken
per SEQUENCE and averaged over sequences. A sequence is the unit no layout splits -- dp and gradient
accumulation cut the global batch into whole sequences, tp replicates the tokens, pp cuts layers, ep moves
tokens only after routing -- so dp1 x 4 micro-batches, dp2 x 2 and ep2 x tp2 average the same per-sequence
values (only the order of the fp32 sums differs). A per-micro-batch statistic (Megatron's default) changes
with the micro-batch size; a global-batch one (Qwen's; Megatron PR #3768) needs every micro-batch's routing
before the first backward, so with accumulation it is an approximation. (Context parallelism would split a
sequence: its counts would need a sum over cp first; not built.) DeepSeek-V3 uses this sequence-wise form.
How the losses reach the backward: AuxLossToGrad returns the block's output unchanged and, in backward, hands
the aux and z losses the gradient coef x grad_scale (grad_scale = loss_scale / micro-batches, set by the trainer:
set_grad_scale) -- the same factor the LM loss gets. So the pipeline's last stage never needs the other
stages' aux losses (Megatron's MoEAuxLossAutoScaler), and under recompute the statistics are booked in that
backward, which autograd runs once per micro-batch however often the forward was rerun.
Experts run one after the other (nanomega/ep.py): a grouped GEMM (one kernel for E matmuls of uneven sizes)
exists only on CUDA (torch._grouped_mm, bf16); the loop is exact, runs on the CPU, and costs E_local launches.
Formulas (one home: formulas.py): parameters per MoE layer E 3hf + E h (router); active per token k 3hf + E h;
FLOPs per token 6 N_active + 12 L h s.
Lesson: lessons/14-experts.md
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .ep import dispatch_combine
from .modern import GatedMLP

ROUTERS = ("mixtral", "deepseek", "qwen")


def check(cfg):
    """One line for an MoE shape that cannot run (GPTConfig.validate calls it)."""
    if not cfg.n_experts:
        if cfg.shared_experts:
            raise ValueError("--shared-experts needs --n-experts (shared experts sit beside routed ones)")
        return
    if cfg.arch != "llama":
        raise ValueError("--n-experts replaces the Llama block's SwiGLU MLP by experts; add --arch llama")
    if cfg.n_experts < 2 or not 1 <= cfg.top_k <= cfg.n_experts:
        raise ValueError(f"--n-experts {cfg.n_experts} must be >= 2 and --top-k {cfg.top_k} in [1, n_experts]")
    if cfg.router not in ROUTERS:
        raise ValueError(f"--router {cfg.router!r} is not one of {', '.join(ROUTERS)}")
    for flag in ("capacity_factor", "moe_aux_loss", "moe_z_loss", "shared_experts"):
        if not 0 <= getattr(cfg, flag) < math.inf:
            raise ValueError(f"--{flag.replace('_', '-')} must be a finite number >= 0, got {getattr(cfg, flag)}")


def route(logits, k, router="mixtral", bias=None):
    """logits (T, E) fp32 -> weights (T, k), experts (T, k) (best first), probs (T, E) (softmax over all E).
    bias (E,): added to the scores for the choice only (DeepSeek-V3), never to the weights."""
    probs = logits.softmax(-1)
    score = logits if router == "mixtral" else probs
    experts = (score if bias is None else score + bias.float()).topk(k, dim=-1).indices
    if router == "mixtral":
        return logits.gather(-1, experts).softmax(-1), experts, probs
    weights = probs.gather(-1, experts)
    return (weights / weights.sum(-1, keepdim=True) if router == "deepseek" else weights), experts, probs


def capacity(cf, s, k, n_experts):
    """Assignments one expert takes from one sequence of s tokens: ceil(cf * s * k / E)."""
    return math.ceil(cf * s * k / n_experts)


def within_capacity(experts, n_experts, cap):
    """experts (b, s, k) -> keep (b, s, k): the first `cap` assignments of each (sequence, expert), in token
    order (earlier tokens first, a token's best expert before its second: GShard's position policy)."""
    onehot = F.one_hot(experts.flatten(1), n_experts)  # (b, s k, E)
    position = (onehot.cumsum(1) * onehot).sum(-1) - 1  # (b, s k): place in its expert's queue
    return (position < cap).view_as(experts)


def balance_loss(probs, experts, n_experts):
    """Switch/GShard's E * sum_e f_e P_e per sequence: probs (b, s, E), experts (b, s, k) -> (b,)."""
    b, s, k = experts.shape
    f = F.one_hot(experts.flatten(1), n_experts).sum(1).float() / (s * k)  # (b, E): share of the assignments
    return n_experts * (f * probs.mean(1)).sum(-1)


def z_loss(logits):
    """ST-MoE's router z-loss per sequence: logits (b, s, E) -> (b,) mean over tokens of logsumexp^2."""
    return torch.logsumexp(logits, -1).square().mean(-1)


def mlp(cfg, ops):
    """The Llama block's MLP: one SwiGLU, or (n_experts > 0) an MoE; ops: the block's table (seams.Ops)."""
    if not cfg.n_experts:
        return GatedMLP(cfg.n_embd, cfg.ffn, cfg.dropout, ops=ops)
    check(cfg)
    return MoE(cfg, ops)


class AuxLossToGrad(torch.autograd.Function):
    """Forward: y unchanged. Backward: y's gradient passed on, and `loss` given the gradient moe.grad_scale, as if
    loss * grad_scale had been added to the model's loss; the forward's statistics booked (once per backward)."""

    @staticmethod
    def forward(ctx, y, loss, moe, stats):
        ctx.moe, ctx.stats = moe, stats
        return y

    @staticmethod
    def backward(ctx, grad):
        ctx.moe.book(ctx.stats)
        return grad, torch.full((), ctx.moe.grad_scale, dtype=torch.float32, device=grad.device), None, None


class MoE(nn.Module):
    """The MoE MLP of one block: router + E routed experts (+ shared ones, which every token runs through).
    Experts are keyed by their global index ("experts.5"), so a rank holding some (ep.py) keeps the dense names,
    and meta.Init draws it the dense model's values. ep: the expert-parallel Axis (None: all experts here)."""

    def __init__(self, cfg, ops):
        super().__init__()
        h, f = cfg.n_embd, cfg.ffn
        self.ops = ops  # the block's table: the router's matmul and every expert's are its linear
        self.n_experts, self.top_k, self.router_kind = cfg.n_experts, cfg.top_k, cfg.router
        self.capacity_factor, self.aux_coef, self.z_coef = cfg.capacity_factor, cfg.moe_aux_loss, cfg.moe_z_loss
        self.router = nn.Linear(h, cfg.n_experts, bias=False)  # (E, h)
        self.experts = nn.ModuleDict({str(e): GatedMLP(h, f, cfg.dropout, ops=ops)
                                      for e in range(cfg.n_experts)})
        self.shared = GatedMLP(h, f * cfg.shared_experts, cfg.dropout, ops=ops) if cfg.shared_experts else None
        # DeepSeek-V3's balancing bias: computed on the host (not drawn; like alibi_slopes), moved by update_bias
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts, device="cpu"))
        self.ep, self.grad_scale, self.last, self.booked = None, 1.0, {}, None

    def forward(self, x):  # (b, s, h) -> (b, s, h)
        b, s, h = x.shape
        logits = self.ops.linear(x.float(), self.router.weight.float())  # (b, s, E), fp32 as every trainer does
        weights, experts, probs = route(logits.flatten(0, 1), self.top_k, self.router_kind, self.expert_bias)
        experts = experts.view(b, s, -1)  # (b, s, k)
        keep = within_capacity(experts, self.n_experts, capacity(self.capacity_factor, s, self.top_k,
                                                                  self.n_experts)) if self.capacity_factor else None
        y = dispatch_combine(x.flatten(0, 1), experts.flatten(0, 1), weights,
                             None if keep is None else keep.flatten(0, 1), self.experts, self.n_experts, self.ep)
        y = y.view(b, s, h)
        if self.shared is not None:
            y = y + self.shared(x)
        aux, z = balance_loss(probs.view(b, s, -1), experts, self.n_experts), z_loss(logits)  # (b,) each
        kept = experts if keep is None else experts[keep]
        load = torch.bincount(kept.flatten(), minlength=self.n_experts).double()  # (E,) assignments computed
        self.last = dict(experts=experts, keep=keep, aux=aux.detach(), z=z.detach(), load=load)
        if not torch.is_grad_enabled():
            return y
        return AuxLossToGrad.apply(y, self.aux_coef * aux.mean() + self.z_coef * z.mean(), self, self.last)

    def swiglus(self):
        """The SwiGLU MLPs held here (tp.py splits each as the dense one; the router stays replicated)."""
        return list(self.experts.values()) + ([self.shared] if self.shared is not None else [])

    def book(self, stats):
        """Add one micro-batch's statistics (from its backward: once, whatever recompute reran) to the step's."""
        row = torch.cat([stats["aux"].sum().reshape(1).double(), stats["z"].sum().reshape(1).double(),
                         torch.tensor([stats["aux"].numel()], dtype=torch.float64, device=stats["load"].device),
                         stats["load"]])  # (3 + E,): aux sum, z sum, sequences, loads
        self.booked = row if self.booked is None else self.booked + row


def layers(model):
    """{layer index: MoE} of the blocks this rank holds."""
    return {int(i): b.mlp for i, b in model.blocks.items() if isinstance(b.mlp, MoE)}


def set_grad_scale(model, scale):
    """The factor the LM loss's backward starts from (loss_scale / micro-batches): the aux losses get the same."""
    for moe in layers(model).values():
        moe.grad_scale = scale


@torch.no_grad()
def step_stats(model, grid):
    """The step's routing statistics, the same on every rank: (n_layer, 3 + E) rows of booked sums (aux, z,
    sequences, loads per expert), summed over dp (every rank of a replica group saw other sequences; tp ranks
    saw the same ones: not summed) and over pp (each stage books its own layers). Resets the booking.
    -> dict(aux, z: means over sequences and MoE layers; load: (n_layer, E) assignments; per_layer_aux)."""
    moes = layers(model)
    if not moes:
        return None
    n_experts, n_layer = next(iter(moes.values())).n_experts, model.cfg.n_layer
    rows = torch.zeros(n_layer, 3 + n_experts, dtype=torch.float64, device=grid.device)
    for i, moe in moes.items():
        if moe.booked is not None:
            rows[i] = moe.booked.to(rows.device)
        moe.booked = None
    grid.dp.all_reduce(rows)
    grid.pp.all_reduce(rows)
    used = rows[:, 2] > 0
    per_layer = rows[used, 0] / rows[used, 2]
    return dict(aux=per_layer.mean().item() if used.any() else float("nan"),
                z=(rows[used, 1] / rows[used, 2]).mean().item() if used.any() else float("nan"),
                load=rows[:, 3:], per_layer_aux=per_layer)


@torch.no_grad()
def update_bias(model, loads, rate):
    """DeepSeek-V3: b_e += rate * sign(mean load - load_e) for every MoE layer this rank holds; loads (n_layer, E)
    from step_stats (summed over the whole step: the same bias on every rank)."""
    for i, moe in layers(model).items():
        load = loads[i].to(moe.expert_bias.device)
        moe.expert_bias += rate * torch.sign(load.mean() - load).to(moe.expert_bias.dtype)


@torch.no_grad()
def bias_table(model, grid):
    """Collective over pp: every MoE layer's DeepSeek-V3 bias as one (n_layer, E) fp32 table on the CPU, the same
    on every rank (each stage fills its own layers' rows; a layer lives on one stage), so that a checkpoint
    resumed under another pp, ep, tp or dp size finds every layer's bias in any one shard. None without experts."""
    if not model.cfg.n_experts:
        return None
    table = torch.zeros(model.cfg.n_layer, model.cfg.n_experts, dtype=torch.float32, device=grid.device)
    for i, moe in layers(model).items():
        table[i] = moe.expert_bias.float()  # bf16 -> fp32: exact, and back on restore
    return grid.pp.all_reduce(table).cpu()


@torch.no_grad()
def load_bias_table(model, table):
    """The rows of bias_table's table for the MoE layers this rank holds (a checkpoint without one: left as is)."""
    if table is None:
        return
    for i, moe in layers(model).items():
        moe.expert_bias.copy_(table[i])
