"""Mixture of experts: a router sends each token to k of E SwiGLU experts (the Llama block's MLP).

Idea: E experts hold E x the MLP parameters, but each token runs through only k of them (the FLOPs
of k MLPs). A router (one (E, h) matrix, fp32) scores the tokens and picks k by one of the rules
of ROUTERS, each named for the models that use it. Balance comes from the Switch/GShard aux loss,
DeepSeek-V3's choice-only bias (update_bias, kept in fp32 whatever the model's dtype) or a capacity
per expert and sequence; the z-loss keeps the logits small. Shared experts run on every token,
ungated (DeepSeek) or times sigmoid(x . w_gate) (Qwen2-MoE's shared_expert_gate). Every statistic is taken per sequence,
so no layout changes the loss: cp, the one layout that splits a sequence, sums the balance loss's
counts over its ranks (balance_loss); the aux losses join the backward at their block (AuxLossToGrad).
Formulas (one home: formulas.py):
    aux loss          E sum_e f_e P_e  (f_e: share of the assignments, P_e: mean router probability)
                      (transformers' load_balancing_loss_func: k x this; tools/hf_moe.py converts)
    deepseek_v3       s = sigmoid(l); chosen: top-k of s + b among the topk_group groups of best
                      top-2 sum; w = scale s_chosen / sum s_chosen; P_e from s / sum_e s
    capacity          C = ceil(cf s k / E) assignments per expert and sequence (cf = 0: dropless)
    parameters/layer  E 3hf + E h (router); active per token k 3hf + E h
    first_k_dense     blocks 0 .. k-1 a dense SwiGLU of width (k + shared) f unless given (DeepSeek-V3)
    FLOPs per token   6 N_active + 12 L h s
Lesson: lessons/16-experts.md
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .ep import dispatch_combine
from .modern import GatedMLP

# The routing rules, named for the models that use them (checked against each model's HF code)
ROUTERS = {
    "mixtral": "top-k of the logits, softmax over the k (Mixtral; the same weights as "
    "softmax_topk_norm)",
    "softmax_topk": "softmax over E, top-k, not renormalized (DeepSeek-V2, Qwen2-MoE, OLMoE)",
    "softmax_topk_norm": "softmax over E, top-k, renormalized over the k (Qwen3-MoE)",
    "deepseek_v3": "sigmoid scores, top-k of score + bias within the best --topk-group of "
    "--n-group groups, normalized over the k, x --routed-scaling (DeepSeek-V3)",
}
# names used before issue 48, and the rule each computed (checkpoints that record one keep it)
RENAMED = {"deepseek": "softmax_topk_norm", "qwen": "softmax_topk"}


def rule(router):
    """The ROUTERS name of a router, old names mapped to the rule they computed."""
    return RENAMED.get(router, router)


def check(cfg):
    """One line for an MoE shape that cannot run (GPTConfig.validate calls it)."""
    if rule(cfg.router) not in ROUTERS:  # with or without experts: a typo is never ignored
        raise ValueError(f"--router {cfg.router!r} is not one of {', '.join(ROUTERS)}")
    if not cfg.n_experts:
        given = {
            "--shared-experts": cfg.shared_experts,  # shared experts sit beside routed ones
            "--first-k-dense": cfg.first_k_dense,  # dense blocks come before MoE ones
            "--dense-ffn-hidden": cfg.dense_ffn_hidden,
        }
        named = [flag for flag, value in given.items() if value]
        if named:
            raise ValueError(
                f"{' and '.join(named)} {'needs' if len(named) == 1 else 'need'} --n-experts "
                "(beside or before routed experts); add --n-experts or leave it out"
            )
        return

    if cfg.arch != "llama":
        raise ValueError(
            "--n-experts replaces the Llama block's SwiGLU MLP by experts; add --arch llama"
        )
    if cfg.n_experts < 2 or not 1 <= cfg.top_k <= cfg.n_experts:
        raise ValueError(
            f"--n-experts {cfg.n_experts} must be >= 2 and --top-k {cfg.top_k} in [1, n_experts]"
        )
    if not 0 <= cfg.first_k_dense < cfg.n_layer or (cfg.dense_ffn_hidden and not cfg.first_k_dense):
        raise ValueError(
            f"--first-k-dense {cfg.first_k_dense} must be in [0, n_layer {cfg.n_layer}) (at least "
            "one MoE block), and --dense-ffn-hidden sets the width of those dense blocks: add it"
        )
    if cfg.shared_expert_gate and not cfg.shared_experts:
        raise ValueError("--shared-expert-gate gates the shared experts: add --shared-experts")
    check_groups(cfg)

    for flag in (
        "capacity_factor",
        "moe_aux_loss",
        "moe_z_loss",
        "shared_experts",
        "routed_scaling",
    ):
        if not 0 <= getattr(cfg, flag) < math.inf:
            raise ValueError(
                f"--{flag.replace('_', '-')} must be a finite number >= 0, got {getattr(cfg, flag)}"
            )


def check_groups(cfg):
    """One line for a deepseek_v3 group limit that cannot be (the other routers take no groups)."""
    groups, n, e, k = (cfg.n_group, cfg.topk_group), cfg.n_group, cfg.n_experts, cfg.top_k
    if rule(cfg.router) != "deepseek_v3":
        if groups != (1, 1) or cfg.routed_scaling != 1.0:
            raise ValueError(
                "--n-group, --topk-group and --routed-scaling are --router deepseek_v3's; add it "
                "or leave them out"
            )
        return
    if n < 1 or e % n or (n > 1 and e // n < 2) or not 1 <= cfg.topk_group <= n:
        raise ValueError(
            f"--n-group {n} must divide --n-experts {e} into groups of >= 2 (a group's score is its "
            f"top-2 sum) and --topk-group {cfg.topk_group} be in [1, n_group]"
        )
    if k > cfg.topk_group * e // n:
        raise ValueError(
            f"--top-k {k} is more than the {cfg.topk_group * e // n} experts of --topk-group "
            f"{cfg.topk_group} groups; raise --topk-group"
        )


def route(logits, k, router="mixtral", bias=None, groups=(1, 1), scale=1.0):
    """logits (T, E) fp32 -> weights (T, k), experts (T, k), probs (T, E) (the affinities the
    balance loss averages: softmax over all E; deepseek_v3: sigmoid normalized over E). bias (E,):
    added to the scores for the choice only (DeepSeek-V3), never to the weights. groups (n_group,
    topk_group) and scale: deepseek_v3's group limit and routed scaling factor."""
    router = rule(router)
    if router == "deepseek_v3":
        return sigmoid_route(logits, k, bias, groups, scale)
    probs = logits.softmax(-1)
    score = logits if router == "mixtral" else probs
    experts = (score if bias is None else score + bias.float()).topk(k, dim=-1).indices
    if router == "mixtral":
        return logits.gather(-1, experts).softmax(-1), experts, probs
    weights = probs.gather(-1, experts)
    return (
        (weights / weights.sum(-1, keepdim=True) if router == "softmax_topk_norm" else weights),
        experts,
        probs,
    )


def sigmoid_route(logits, k, bias, groups, scale):
    """DeepSeek-V3's rule (Sec. 2.1.2; transformers' DeepseekV3TopkRouter): sigmoid affinities, the
    choice on affinity + bias within the topk_group groups whose two best sum highest, the chosen
    affinities (no bias) normalized to 1 and times scale."""
    scores = logits.sigmoid()  # (T, E)
    choice = scores if bias is None else scores + bias.float()

    # node-limited routing: only the experts of each token's best topk_group groups compete
    (n_group, topk_group), (t, e) = groups, scores.shape
    if n_group > 1:
        by_group = choice.view(t, n_group, e // n_group)  # (T, G, E/G)
        best = by_group.topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices  # (T, g)
        allowed = torch.zeros(t, n_group, dtype=torch.bool, device=scores.device)
        allowed = allowed.scatter(1, best, True)[..., None].expand(-1, -1, e // n_group)
        allowed = allowed.reshape(t, e)  # (T, E): each group's flag for each of its experts
        choice = choice.masked_fill(~allowed, -math.inf)

    experts = choice.topk(k, dim=-1).indices  # (T, k)
    weights = scores.gather(-1, experts)
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * scale
    return weights, experts, scores / scores.sum(-1, keepdim=True)


def capacity(cf, s, k, n_experts):
    """Assignments one expert takes from one sequence of s tokens: ceil(cf * s * k / E)."""
    return math.ceil(cf * s * k / n_experts)


def within_capacity(experts, n_experts, cap):
    """experts (b, s, k) -> keep (b, s, k): the first `cap` assignments of each (sequence, expert),
    in token order (earlier tokens first, a token's best expert before its second: GShard's position
    policy)."""
    onehot = F.one_hot(experts.flatten(1), n_experts)  # (b, s k, E)
    position = (onehot.cumsum(1) * onehot).sum(-1) - 1  # (b, s k): place in its expert's queue
    return (position < cap).view_as(experts)


def balance_loss(probs, experts, n_experts, cp=None):
    """Switch/GShard's E * sum_e f_e P_e per sequence: probs (b, s, E), experts (b, s, k) ->
    (b,). cp: the context-parallel Axis when this rank holds s of the sequence's cp s tokens: the
    assignment counts are summed over it (f is the whole sequence's, the same on every cp rank) and
    P_e stays this rank's mean, so the cp ranks' mean of the loss (the LM loss's rule: gradients
    averaged over dp_cp) is the whole sequence's loss, and so is each token's gradient."""
    b, s, k = experts.shape
    counts = F.one_hot(experts.flatten(1), n_experts).sum(1).float()  # (b, E) assignments
    if cp is not None and cp.size > 1:
        cp.all_reduce(counts)  # integers: exact in fp32, the same sum on every rank
    f = counts / (s * k * (1 if cp is None else cp.size))  # (b, E): share of the assignments
    return n_experts * (f * probs.mean(1)).sum(-1)


def z_loss(logits):
    """ST-MoE's router z-loss per sequence: logits (b, s, E) -> (b,) mean over tokens of
    logsumexp^2."""
    return torch.logsumexp(logits, -1).square().mean(-1)


def mlp(cfg, ops, layer=0):
    """Block `layer`'s Llama MLP: one SwiGLU, or (n_experts > 0) an MoE, but a SwiGLU of width
    dense_ffn in the first first_k_dense blocks (DeepSeek-V3); ops: the block's table (seams.Ops)."""
    if not cfg.n_experts:
        return GatedMLP(cfg.n_embd, cfg.ffn, cfg.dropout, ops=ops)
    check(cfg)
    if not cfg.is_moe(layer):
        return GatedMLP(cfg.n_embd, cfg.dense_ffn, cfg.dropout, ops=ops)
    return MoE(cfg, ops)


class AuxLossToGrad(torch.autograd.Function):
    """Forward: y unchanged. Backward: y's gradient passed on, and `loss` given the gradient
    moe.grad_scale, as if loss * grad_scale had been added to the model's loss; the forward's
    statistics booked (once per backward)."""

    @staticmethod
    def forward(ctx, y, loss, moe, stats):
        ctx.moe, ctx.stats = moe, stats
        return y

    @staticmethod
    def backward(ctx, grad):
        ctx.moe.book(ctx.stats)
        return (
            grad,
            torch.full((), ctx.moe.grad_scale, dtype=torch.float32, device=grad.device),
            None,
            None,
        )


class MoE(nn.Module):
    """The MoE MLP of one block: router + E routed experts (+ shared ones, which every token runs
    through). Experts are keyed by their global index ("experts.5"), so a rank holding some (ep.py)
    keeps the dense names, and meta.Init draws it the dense model's values. ep: the expert-parallel
    Axis (None: all experts here)."""

    def __init__(self, cfg, ops):
        super().__init__()
        h, f = cfg.n_embd, cfg.ffn
        self.ops = ops  # the block's table: the router's matmul and every expert's are its linear
        self.n_experts, self.top_k, self.router_kind = cfg.n_experts, cfg.top_k, rule(cfg.router)
        self.groups, self.scale = (cfg.n_group, cfg.topk_group), cfg.routed_scaling
        self.capacity_factor, self.aux_coef, self.z_coef = (
            cfg.capacity_factor,
            cfg.moe_aux_loss,
            cfg.moe_z_loss,
        )

        # the router, the routed experts and the shared ones
        self.router = nn.Linear(h, cfg.n_experts, bias=False)  # (E, h)
        self.experts = nn.ModuleDict(
            {str(e): GatedMLP(h, f, cfg.dropout, ops=ops) for e in range(cfg.n_experts)}
        )
        self.shared = (
            GatedMLP(h, f * cfg.shared_experts, cfg.dropout, ops=ops)
            if cfg.shared_experts
            else None
        )
        # Qwen2-MoE: the shared experts' output times sigmoid(x . w) per token (a (1, h) matrix)
        self.shared_gate = nn.Linear(h, 1, bias=False) if cfg.shared_expert_gate else None

        # DeepSeek-V3's balancing bias: computed on the host (not drawn; like alibi_slopes), moved
        # by update_bias
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts, device="cpu"))
        self.fp32_buffers = ("expert_bias",)  # precision.cast_model leaves it fp32: 1e-3 steps
        # round away in bf16 once |b| > 0.25
        self.ep, self.grad_scale, self.last, self.booked = None, 1.0, {}, None
        self.cp = None  # the context-parallel Axis (apply_context_parallel): None, whole sequences

    def forward(self, x):  # (b, s, h) -> (b, s, h)
        b, s, h = x.shape

        # route: fp32 logits, as every trainer does; k experts and their weights per token
        logits = self.ops.linear(x.float(), self.router.weight.float())  # (b, s, E)
        tokens = logits.flatten(0, 1)  # (b s, E)
        weights, experts, probs = route(
            tokens, self.top_k, self.router_kind, self.expert_bias, self.groups, self.scale
        )
        experts = experts.view(b, s, -1)  # (b, s, k)
        keep = None  # dropless; else the assignments within each expert's capacity
        if self.capacity_factor:
            cap = capacity(self.capacity_factor, s, self.top_k, self.n_experts)
            keep = within_capacity(experts, self.n_experts, cap)  # (b, s, k)

        # the experts (on their ep ranks), and the shared ones
        kept = None if keep is None else keep.flatten(0, 1)
        y = dispatch_combine(
            x.flatten(0, 1),
            experts.flatten(0, 1),
            weights,
            kept,
            self.experts,
            self.n_experts,
            self.ep,
        )
        y = y.view(b, s, h)
        if self.shared is not None and self.shared_gate is None:
            y = y + self.shared(x)
        elif self.shared is not None:
            gate = self.ops.linear(x, self.shared_gate.weight).sigmoid()  # (b, s, 1)
            y = y + gate * self.shared(x)

        # the step's statistics, and the aux losses' way into backward
        aux = balance_loss(probs.view(b, s, -1), experts, self.n_experts, self.cp)  # (b,)
        z = z_loss(logits)  # (b,): this rank's token mean (cp: the ranks' mean is the sequence's)
        # (E,) assignments computed: a sum of ones, as bincount, without its host sync
        kept = torch.ones_like(experts, dtype=torch.float64) if keep is None else keep.double()
        load = kept.new_zeros(self.n_experts).index_add_(0, experts.flatten(), kept.flatten())
        self.last = dict(experts=experts, keep=keep, aux=aux.detach(), z=z.detach(), load=load)
        if not torch.is_grad_enabled():
            return y
        loss = self.aux_coef * aux.mean() + self.z_coef * z.mean()
        return AuxLossToGrad.apply(y, loss, self, self.last)

    def swiglus(self):
        """The SwiGLU MLPs held here (tp.py splits each as the dense one; the router stays
        replicated)."""
        return list(self.experts.values()) + ([self.shared] if self.shared is not None else [])

    def book(self, stats):
        """Add one micro-batch's statistics (from its backward: once, whatever recompute reran) to
        the step's."""
        row = torch.cat(
            [
                stats["aux"].sum().reshape(1).double(),
                stats["z"].sum().reshape(1).double(),
                torch.tensor(
                    [stats["aux"].numel()], dtype=torch.float64, device=stats["load"].device
                ),
                stats["load"],
            ]
        )  # (3 + E,): aux sum, z sum, sequences, loads
        self.booked = row if self.booked is None else self.booked + row


def layers(model):
    """{layer index: MoE} of the blocks this rank holds."""
    return {int(i): b.mlp for i, b in model.blocks.items() if isinstance(b.mlp, MoE)}


def apply_context_parallel(model, axis):
    """In place: every MoE layer takes the cp Axis, over which its balance loss sums each
    sequence's assignment counts (routing itself is per token: nothing else changes)."""
    for moe in layers(model).values():
        moe.cp = axis if axis.size > 1 else None
    return model


def set_grad_scale(model, scale):
    """The factor the LM loss's backward starts from (loss_scale / micro-batches): the aux losses
    get the same."""
    for moe in layers(model).values():
        moe.grad_scale = scale


@torch.no_grad()
def step_stats(model, grid):
    """The step's routing statistics, the same on every rank: (n_layer, 3 + E) rows of booked sums
    (aux, z, sequences, loads per expert), summed over dp x cp (every dp rank saw other sequences,
    every cp rank other tokens of them; tp ranks saw the same ones: not summed) and over pp (each stage books its own
    layers). Resets the booking. -> dict(aux, z: means over sequences and MoE layers; load:
    (n_layer, E) assignments; per_layer_aux)."""
    moes = layers(model)  # none on a stage of dense blocks only (first_k_dense): it still joins
    if not model.cfg.n_experts:
        return None

    n_experts, n_layer = model.cfg.n_experts, model.cfg.n_layer
    rows = torch.zeros(n_layer, 3 + n_experts, dtype=torch.float64, device=grid.device)
    for i, moe in moes.items():
        if moe.booked is not None:
            rows[i] = moe.booked.to(rows.device)
        moe.booked = None

    # summed over dp x cp and pp: the same on every rank (cp ranks book the same sequences, each its
    # part of every mean: the sums over cp are cp x the sequences and the whole sequences' means)
    grid.dp_cp.all_reduce(rows)
    grid.pp.all_reduce(rows)

    used = rows[:, 2] > 0
    per_layer = rows[used, 0] / rows[used, 2]
    return dict(
        aux=per_layer.mean().item() if used.any() else float("nan"),
        z=(rows[used, 1] / rows[used, 2]).mean().item() if used.any() else float("nan"),
        load=rows[:, 3:],
        per_layer_aux=per_layer,
    )


def row(routing):
    """The metrics row's MoE numbers of step_stats' dict (None: {}): the aux loss and the largest
    max load / mean load of a layer (1 when balanced)."""
    if not routing:
        return {}
    load = routing["load"]  # (n_layer, E)
    max_load = (load.max(1).values / load.mean(1)).max().item()
    return dict(moe_aux=routing["aux"], moe_max_load=max_load)


@torch.no_grad()
def update_bias(model, loads, rate):
    """DeepSeek-V3: b_e += rate * sign(mean load - load_e) for every MoE layer this rank holds;
    loads (n_layer, E) from step_stats (summed over the whole step: the same bias on every rank)."""
    for i, moe in layers(model).items():
        load = loads[i].to(moe.expert_bias.device)
        moe.expert_bias += rate * torch.sign(load.mean() - load).to(moe.expert_bias.dtype)


@torch.no_grad()
def bias_table(model, grid):
    """Collective over pp: every MoE layer's DeepSeek-V3 bias as one (n_layer, E) fp32 table on the
    CPU, the same on every rank (each stage fills its own layers' rows; a layer lives on one stage),
    so that a checkpoint resumed under another pp, ep, tp or dp size finds every layer's bias in any
    one shard. None without experts."""
    if not model.cfg.n_experts:
        return None
    table = torch.zeros(
        model.cfg.n_layer, model.cfg.n_experts, dtype=torch.float32, device=grid.device
    )
    for i, moe in layers(model).items():
        table[i] = moe.expert_bias.float()  # bf16 -> fp32: exact, and back on restore
    return grid.pp.all_reduce(table).cpu()


@torch.no_grad()
def load_bias_table(model, table):
    """The rows of bias_table's table for the MoE layers this rank holds (a checkpoint without one:
    left as is)."""
    if table is None:
        return
    for i, moe in layers(model).items():
        moe.expert_bias.copy_(table[i])
