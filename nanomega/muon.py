"""Muon: the hidden layers' matrices stepped by their momentum orthogonalized; AdamW for the rest.

The momentum M of a weight matrix (rows x cols) is replaced by the nearest semi-orthogonal matrix,
U V^T of M = U S V^T, approximated by 5 steps of a quintic Newton-Schulz iteration; every direction
of the update then moves the weight alike, however small its share of the gradient (Keller
Jordan, 2024, "Muon: An optimizer for hidden layers in neural networks"; github.com/KellerJordan/
Muon, the NanoGPT speedrun's). Embeddings, the head, norms, biases and the MoE router stay on AdamW.
    momentum   B <- B + (1 - beta)(G - B)      U = G + beta (B - G)   (Nesterov; beta 0.95)
    Newton-Schulz  X0 = U / |U|_F (wide: rows <= cols, else on U^T), 5 times:
                   A = X X^T,  X <- a X + (b A + c A A) X      a, b, c = 3.4445, -4.7750, 2.0315
    on the singular values: s <- a s + b s^3 + c s^5, which takes [0.0015, 1] into about [0.68, 1.2]
                   (a smaller s grows at most a^5 = 485-fold)
    update     W <- W (1 - lr wd) - lr k(rows, cols) X
               k = 0.2 sqrt(max(rows, cols)): Moonlight's, the update's RMS that of AdamW, so --lr,
               --weight-decay and the schedule serve both (Liu et al. 2025, "Muon is Scalable for
               LLM Training", arXiv:2502.16982, sec. 2.2); scale="speedrun": max(1, rows/cols)^0.5
The iteration runs in fp32 here (the speedrun's bf16 pays on tensor cores; a CPU without bf16
units emulates it, and fp32 keeps the SVD comparison's bound at fp32 rounding).
The momentum is element-wise, so ZeRO shards it like Adam's state; only the orthogonalization needs
a whole matrix: under ZeRO, owners.py gives each matrix one rank that orthogonalizes it (a
tensor-parallel one gathered over tp first).
Lesson: lessons/04-data-parallel-and-zero.md
"""

import math

import torch

from . import onebit, zero_rules  # onebit: --optimizer's third value (this file holds the table)

COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the speedrun's quintic, tuned for speed, not a fixpoint
STEPS = 5


def newton_schulz(g, steps=STEPS, eps=1e-7, dtype=torch.float32):
    """The quintic Newton-Schulz iteration on a matrix, in `dtype`: about U V^T of g = U S V^T."""
    a, b, c = COEFFICIENTS
    x = g.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:  # iterate on the wide side: X X^T is the smaller Gram matrix
        x = x.mT
    x = x / (x.norm() + eps)  # singular values into (0, 1]
    for _ in range(steps):
        gram = x @ x.mT  # (r, r), r = min(rows, cols)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def shape_scale(rows, cols, rule="moonlight"):
    """The update's factor for a rows x cols matrix: Moonlight's 0.2 sqrt(max) (AdamW's RMS), or the
    speedrun's max(1, rows / cols)^0.5."""
    if rule == "moonlight":
        return 0.2 * math.sqrt(max(rows, cols))
    return max(1.0, rows / cols) ** 0.5


def is_hidden_matrix(name, p):
    """A 2-D weight of a block other than the MoE router and shared gate: what Muon steps
    (embeddings, head, norms, biases, the router and the (1, h) shared gate stay on AdamW)."""
    return (
        p.dim() == 2
        and name.startswith("blocks.")
        and ".router." not in name
        and ".shared_gate." not in name
    )


def orthogonalized(u, group):
    """The update of one whole matrix from its Nesterov momentum u (shaped rows x cols): k X."""
    rows, cols = u.shape
    return newton_schulz(u, group["ns_steps"]) * shape_scale(rows, cols, group["scale"])


class Muon(torch.optim.AdamW):
    """AdamW whose groups marked muon=True are stepped by Muon (their parameters 2-D, whole, or
    ZeRO's 1-D pieces of a whole matrix once place() has told where the rest of it is: owners.py).
    Muon groups: lr, weight_decay (decoupled, as AdamW's), momentum, nesterov, ns_steps, scale."""

    elementwise = False  # zero_rules: the seam for a non-element-wise optimizer (place)
    MUON = dict(muon=False, momentum=0.95, nesterov=True, ns_steps=STEPS, scale="moonlight")

    def __init__(self, params, **adamw):
        params = list(params)
        if params and not isinstance(params[0], dict):  # tensors: one AdamW group
            params = [dict(params=params)]
        groups = [dict(self.MUON, **g) for g in params]
        super().__init__(groups, **adamw)
        self.owners = None  # owners.Owners once the engine places the pieces

    def place(self, owners):
        """The engine's layout: owners.Owners, which rank orthogonalizes each sharded matrix."""
        self.owners = owners

    @staticmethod
    def whole(group):
        """Whether a param group's matrices need to be whole (the engine asks: zero_rules)."""
        return group["muon"]

    @torch.no_grad()
    def step(self, closure=None):
        # AdamW on the groups not marked muon (its own step, over those groups only)
        groups = self.param_groups
        try:
            self.param_groups = [g for g in groups if not g["muon"]]
            super().step(closure)
        finally:
            self.param_groups = groups

        # the momentum, element-wise: on whole matrices or on ZeRO's pieces alike
        todo = []
        for group in (g for g in groups if g["muon"]):
            for p in group["params"]:
                if p.grad is None or p.numel() == 0:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                u = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf.clone()
                todo.append((group, p, u))

        # the orthogonalized update: whole matrices here, pieces by their matrix's owner
        placed = self.owners.holds if self.owners is not None else (lambda p: False)
        updates = {id(p): orthogonalized(u, g) for g, p, u in todo if not placed(p)}
        if self.owners is not None:
            updates.update(self.owners.exchange([t for t in todo if placed(t[1])], orthogonalized))

        # decoupled weight decay, then the step: element-wise again
        for group, p, _ in todo:
            p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(updates[id(p)].view_as(p), alpha=-group["lr"])


def param_groups(weight_decay, **options):
    """A param_groups_fn (zero.ZeroEngine's optim): the hidden matrices on Muon, the rest on AdamW
    with weight decay on >= 2-D parameters only (as zero_rules.weight_decay_groups)."""

    def groups(named_params):
        hidden = [n for n, p in named_params if is_hidden_matrix(n, p)]
        rest = [(n, p) for n, p in named_params if not is_hidden_matrix(n, p)]
        return [
            dict(params=hidden, weight_decay=weight_decay, muon=True, **options),
            dict(params=[n for n, p in rest if p.dim() >= 2], weight_decay=weight_decay, **options),
            dict(params=[n for n, p in rest if p.dim() < 2], weight_decay=0.0, **options),
        ]

    return groups


def choose(name):
    """--optimizer: (the optimizer class, its param_groups_fn(weight_decay, **options))."""
    if name == "muon":
        return Muon, param_groups
    if name == "onebit":  # 1-bit Adam: AdamW's groups, the momentum compressed after a warm-up
        return onebit.OneBitAdam, zero_rules.weight_decay_groups
    return torch.optim.AdamW, zero_rules.weight_decay_groups


def check(name):
    """One line for an --optimizer that is not one of ours."""
    if name not in ("adamw", "muon", "onebit"):
        raise ValueError(f"--optimizer {name!r}: choose adamw, muon or onebit")
