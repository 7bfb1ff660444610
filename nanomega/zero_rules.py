"""ZeRO's rules, read before the engine builds anything: what each stage shards (STAGE), which
optimizers and layouts it can run (check_config, pipeline_error), and the replica groups (Replicas).

A stage is three choices (Stage): the optimizer state, the gradients, the parameters split 1/N over
a replica group's N ranks; each cuts bytes/param/rank (bf16 weights, fp32 gradients, Adam's 12):
    2 + 4 + 12 = 18 (stage 0)  ->  2 + 4 + 12/N  ->  2 + (4 + 12)/N  ->  (2 + 4 + 12)/N (stage 3)
Sharding steps 1-D slices of flat buffers, exact only for an element-wise optimizer (ELEMENTWISE);
one that needs whole matrices (Muon) plugs in through one seam, whole_matrices (owners.py).
A replica group is a set of parameters the ranks of one axis hold alike, reduced over that axis:
the dense weights over dp_cp, ep's experts over edp, pp's tied embedding's extra sum; owners()
gives each parameter its group. Hybrid sharding (HSDP): a group sharded over `axis` (S ranks,
inside a host) and replicated over `replicate` (R ranks, across hosts): its gradient slices are
reduce-scattered inside, then all-reduced across (the slice only), its parameters gathered inside:
    bytes/param/rank  (2 + 4 + 12)/S at stage 3        per step across: 2(R-1)/R x Psi/S
Nothing here allocates or communicates; ZeroEngine (zero.py) reads these rules.
Lesson: lessons/04-data-parallel-and-zero.md
"""

import dataclasses

import torch

from . import offload as offloading

ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.Adamax,
    torch.optim.Adadelta,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Rprop,
    torch.optim.ASGD,
)


@dataclasses.dataclass(frozen=True)
class Stage:
    """What a ZeRO stage shards over the dp ranks; each field is one choice in
    ZeroEngine.__init__."""

    # flat groups split: a rank steps its slice (masters, Adam state 1/N), the norm sums ranks
    optimizer: bool
    gradients: bool  # ShardBuckets: only the slice's gradient kept, reduced each micro-batch
    # zero3.ShardedParameters: parameters kept as 1/N shards, units gathered on demand
    parameters: bool


# = data parallelism (ddp.py)
STAGE = {
    0: Stage(optimizer=False, gradients=False, parameters=False),
    1: Stage(optimizer=True, gradients=False, parameters=False),
    2: Stage(optimizer=True, gradients=True, parameters=False),
    3: Stage(optimizer=True, gradients=True, parameters=True),
}


def pipeline_error(stage, pp):
    """Why ZeRO `stage` cannot run beside pp pipeline stages, or None: the one rule train.py and the
    planner use."""
    if pp > 1 and stage >= 2:
        return (
            f"--zero {stage} with --pp {pp}: ZeRO-2/3 shard gradients/parameters that every micro-batch of "
            f"the pipeline needs again (DeepSpeed forbids it too); use --zero 0 or 1"
        )
    return None


def check_config(stage, optimizer_cls, pp=1, offload=0.0, offload_params=False):
    """One-line errors for a stage, an optimizer, a pipeline or an offload ZeRO cannot run, raised
    before any collective."""
    if stage not in STAGE:
        raise ValueError(f"--zero {stage!r}: ZeRO stages are 0, 1, 2 and 3")
    if offload or offload_params:
        offloading.check(optimizer_cls, stage, offload, offload_params)
    if pipeline_error(stage, pp):
        raise ValueError(pipeline_error(stage, pp))
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise ValueError(
            f"optimizer: a {type(optimizer_cls).__name__} is not a torch.optim.Optimizer class; pass "
            f"e.g. torch.optim.AdamW (the class, not an instance)"
        )
    name = optimizer_cls.__name__
    if optimizer_cls in (torch.optim.LBFGS, torch.optim.SparseAdam):
        raise ValueError(
            f"optimizer {name} cannot run under ZeroEngine (LBFGS needs a closure, SparseAdam "
            f"sparse gradients); use AdamW, Adam or SGD"
        )
    if (stage or offload) and communicates(optimizer_cls):
        raise ValueError(
            f"--zero {stage} / --offload with {name}: it averages each rank's whole momentum "
            f"over dp itself; use --zero 0 without --offload"
        )
    if offload and whole_matrices(optimizer_cls):
        raise ValueError(f"--offload: the CPU step computes Adam/AdamW, not {name}'s matrices")
    if (
        stage
        and optimizer_cls not in ELEMENTWISE
        and not getattr(optimizer_cls, "elementwise", False)
        and not whole_matrices(optimizer_cls)
    ):
        raise ValueError(
            f"--zero {stage}: optimizer {name} cannot be sharded: ZeRO steps 1-D slices of flat "
            f"buffers, exact only for element-wise updates "
            f"({', '.join(c.__name__ for c in ELEMENTWISE)}); use --zero 0 or one of those "
            f"(or set {name}.elementwise = True if its update is element-wise)"
        )


def hybrid_error(dp_shard, dp, stage, cp=1, ep=1, pp=1):
    """Why hybrid sharding over groups of dp_shard dp ranks cannot run, or None (0 or dp: off)."""
    if dp_shard in (0, dp):
        return None
    if dp % dp_shard:
        return (
            f"--dp-shard {dp_shard} must divide dp {dp}: the dp ranks split into shard groups of "
            f"--dp-shard (inside a host), replicated dp / dp-shard times; pick a divisor of {dp}"
        )
    if stage == 0:
        return (
            f"--dp-shard {dp_shard} with --zero 0: hybrid sharding splits ZeRO's state inside a "
            f"shard group and nothing is sharded at stage 0; use --zero 1, 2 or 3"
        )
    if max(cp, ep, pp) > 1:
        return (
            f"--dp-shard {dp_shard} with --cp {cp} / --ep {ep} / --pp {pp}: hybrid sharding is "
            f"built and tested for tp x dp layouts only so far (issue 46); leave out --dp-shard"
        )
    return None


def whole_matrices(optimizer_cls):
    """The seam for an optimizer that is not element-wise (muon.Muon): it says elementwise = False
    and has place(owners) and whole(param group); ZeroEngine then hands it an owners.Owners that
    gives each sharded matrix of a group whose whole(...) is true one rank computing its update."""
    return getattr(optimizer_cls, "elementwise", None) is False and hasattr(optimizer_cls, "place")


def communicates(optimizer_cls):
    """The seam for an optimizer that averages over dp itself (onebit.OneBitAdam): it has
    communicate(axis) and local(); ZeroEngine hands it the dense axis and, while local() is true,
    leaves the gradients unreduced (stage 0 only: the optimizer holds the whole momentum)."""
    return hasattr(optimizer_cls, "communicate") and hasattr(optimizer_cls, "local")


@dataclasses.dataclass(frozen=True, eq=False)
class Replicas:
    """A replica group: parameters the ranks of `axis` hold alike. The engine reduces their
    gradients over `axis` (and gathers their ZeRO slices over it); the technique that owns the rule
    builds it: the dense weights over grid.dp_cp (the default), ep.replica_group: the routed experts
    over grid.edp, pp.tied_rule: the tied embedding's extra sum over grid.embed. replicate: hybrid
    sharding's second axis (grid.dp_rep): the group's slices, reduced over `axis` (grid.dp_shard),
    are all-reduced over it too, and the mean is over both."""

    name: str
    axis: object  # dist.Axis
    holds: object = None  # holds(name) -> bool; None: every parameter no other group holds
    divide: int = 1  # after the mean over `axis`: experts' gradients sum the tokens of ep ranks too
    across: object = None  # an Axis whose ranks hold the group's other parameters (ep's experts)
    extra_sums: tuple = ()  # ((parameter, Axis), ...): a bucket each, its mean summed over Axis
    whole: bool = False  # ZeRO-3: kept whole on every rank, all-reduced (replicated LayerNorms)
    check: object = None  # check(stage, offload): one line for what the engine cannot do with them
    uncounted: object = None  # uncounted(p) -> bool: a copy another rank counts in the norm (pp's)
    replicate: object = None  # an Axis holding the same slices (hybrid sharding: across hosts)


def owners(names, replicas):
    """(the default group, {name: the group holding it}): the first group whose holds(name) is true,
    else the default one (holds=None; the first such), which every list of groups has."""
    default = next((r for r in replicas if r.holds is None), None)
    if default is None:
        raise ValueError(
            "ZeroEngine(replicas=...): no default group; add Replicas(name, axis), holds=None"
        )
    return default, {
        k: next((r for r in replicas if r.holds is not None and r.holds(k)), default) for k in names
    }


def weight_decay_groups(weight_decay, **options):
    """A param_groups_fn: weight decay on >= 2-D parameters (matrices, embeddings), none on biases
    and norms."""

    def groups(named_params):
        return [
            dict(
                params=[n for n, p in named_params if p.dim() >= 2],
                weight_decay=weight_decay,
                **options,
            ),
            dict(params=[n for n, p in named_params if p.dim() < 2], weight_decay=0.0, **options),
        ]

    return groups
