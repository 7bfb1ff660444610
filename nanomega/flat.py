"""Flat buffers and their shards: the bookkeeping under ZeRO (nanomega/zero.py, nanomega/zero3.py).

A group of parameters is laid end to end in one flat 1-D buffer, zero-padded to a multiple of the
data-parallel size N; rank r owns the slice [r S, (r+1) S), so one collective moves a whole group
whatever the parameter shapes. A parameter's *piece* on rank r is its range intersected with r's
slice, a 1-D view the optimizer steps: exact for element-wise optimizers (SGD, Adam, AdamW, ...)
only, which is why ZeRO-1/2/3 accept only those.

    shard size   S = ceil(n / N)                 padded size N S  (padding < N elements per group)
    owned by r   clamp(n - r S, 0, S) elements   the real, non-padding elements rank r updates

Lesson: lessons/04-data-parallel-and-zero.md
"""

import dataclasses

import torch


class FlatGroup:
    """Parameters of one dtype laid end to end, split over `n_shards` ranks (n_shards = 1: kept
    whole).

    split   this rank owns the slice [lo, hi) (ZeRO stages 1-3; False: stage 0, ZeRO-3's replicated
            parameters); a split group on a world of one still owns everything: lo = 0, hi = padded
    keep    "full": the parameters become views of `full` (DP, ZeRO-1/2); "shard": only this rank's
    slice is
            kept, in `shard`, and `full` is gathered on demand (ZeRO-3, zero3.py frees and refills its storage);
            host: that shard lives in host memory (pinned beside a GPU): ZeRO-3 parameter offload
    values  for parameters still on the meta device: values(name, p, a, b) gives elements [a, b) of
    one
            (meta.Init.values), drawn straight into the buffers on `device`, one parameter (keep="shard": one
            piece) at a time; without it the parameters' own data is copied
    The buffers (all 1-D). Set here, never reassigned: full, shard, own. Written elsewhere, one
    writer each:
      full    model dtype, N S elements; the parameters are views of it (ZeRO-3: only while gathered)
      shard   model dtype, this rank's S elements (ZeRO-3: the persistent copy of the parameters), else None
      own     this rank's slice of the parameters: full[lo:hi], or shard under ZeRO-3
      master  fp32, this rank's S elements the optimizer updates (it IS `own` when the model is fp32): zero.py
      grad    the gradient in grad_dtype, full or this rank's slice (ZeRO-2/3); ZeRO-3 frees it between
              steps: ddp.GradBuckets, zero_buckets.ShardBuckets
    """

    __slots__ = (
        "names",
        "params",
        "shapes",
        "sizes",
        "offsets",
        "numel",
        "shard_numel",
        "padded",
        "lo",
        "hi",
        "dtype",
        "device",
        "trainable",
        "split",
        "full",
        "shard",
        "own",
        "master",
        "grad",
    )

    def __init__(
        self,
        named_params,
        n_shards,
        rank,
        split=None,
        keep="full",
        values=None,
        device=None,
        host=False,
    ):
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        # kept: ZeRO-3 swaps the parameters for empty tensors
        self.shapes = [p.shape for p in self.params]
        self.sizes = [p.numel() for p in self.params]
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        self.numel = sum(self.sizes)
        self.shard_numel = -(-self.numel // n_shards)  # S = ceil(n / N)
        self.padded = self.shard_numel * n_shards
        self.lo = rank * self.shard_numel
        self.hi = (rank + 1) * self.shard_numel
        self.dtype = self.params[0].dtype
        self.device = torch.device(device) if device is not None else self.params[0].device
        self.trainable = self.params[0].requires_grad
        self.split = n_shards > 1 if split is None else split

        # parameter i's elements [a, b): drawn if still on meta (meta.Init), else its own
        def part(i, a, b):
            p = self.params[i]
            return (
                values(self.names[i], p, a, b)
                if values and p.is_meta
                else p.detach().reshape(-1)[a:b]
            )

        if keep == "full":  # the parameters become views of one padded buffer
            self.full, self.shard = (
                self.flatten((part(i, 0, n) for i, n in enumerate(self.sizes))),
                None,
            )
            self.bind(self.full)
            self.own = self.full[self.lo : self.hi]
        # the persistent 1/N, filled piece by piece (no full copy); `full` is storage to gather into
        # (zero3.py)
        else:
            where = (
                dict(device="cpu", pin_memory=self.device.type == "cuda")
                if host
                else dict(device=self.device)
            )
            self.shard = self.own = torch.zeros(self.shard_numel, dtype=self.dtype, **where)
            for i, a, b in self.pieces():
                self.shard[a - self.lo : b - self.lo].copy_(
                    part(i, a - self.offsets[i], b - self.offsets[i])
                )
            # no bytes until zero3.py gathers
            self.full = torch.empty(0, dtype=self.dtype, device=self.device)
        self.master = None
        self.grad = None

    @property
    def grad_own(self):
        """The reduced gradient of the owned slice: grad[lo:hi] of a full gradient, or the slice
        itself."""
        if self.grad is None or self.grad.numel() != self.padded:
            return self.grad
        return self.grad[self.lo : self.hi]

    def flatten(self, tensors, dtype=None):
        """The tensors (shaped like the parameters, or flat; an iterable: one at a time) end to end
        in a new zero-padded buffer of N S elements."""
        out = torch.zeros(self.padded, dtype=dtype or self.dtype, device=self.device)
        for t, o in zip(tensors, self.offsets):
            out[o : o + t.numel()].copy_(t.detach().reshape(-1))
        return out

    def views(self, flat):
        """Views of a padded flat buffer shaped like the parameters (no copy)."""
        return [flat[o : o + n].view(s) for o, n, s in zip(self.offsets, self.sizes, self.shapes)]

    def bind(self, flat):
        """Make the parameters views of `flat` (the nn.Parameter objects, their names and tags are
        kept)."""
        for p, v in zip(self.params, self.views(flat)):
            set_data(p, v)

    def pieces(self):
        """(index, a, b): parameter `index` has elements [a, b) of the flat buffer in this rank's
        slice."""
        for i, (o, n) in enumerate(zip(self.offsets, self.sizes)):
            a, b = max(o, self.lo), min(o + n, self.hi)
            if a < b:
                yield i, a, b


@dataclasses.dataclass
class Piece:
    """This rank's slice of one parameter: elements [start, end) of the flattened (tensor-parallel
    local) parameter `name` -- the one record for it. The optimizer steps `master`, the engine finds
    its gradient at group.grad_own[at:at + end - start], checkpoints save and reshard it by (name,
    start, end).
      master   fp32 values, a view into group.master; frozen parameters: their values, in the model's dtype
      replica  every data-parallel rank holds this same slice (stage 0, replicated or frozen whole parameters)
      group, index, at  where it lives (group None: a frozen parameter held whole, or an empty placeholder)"""

    name: str
    shape: tuple
    start: int
    end: int
    master: torch.Tensor
    replica: bool
    group: FlatGroup | None = None
    index: int | None = None
    at: int = 0


def set_data(p, data):
    """p.data = data, also for a parameter still on the meta device (torch refuses to give a meta
    tensor real data; swap_tensors does it, keeping p's identity, hence ties; its tags and hooks are
    put back)."""
    if p.is_meta and not data.is_meta:
        tags, pre, post = dict(p.__dict__), p._backward_hooks, p._post_accumulate_grad_hooks
        torch.utils.swap_tensors(p, torch.nn.Parameter(data, requires_grad=p.requires_grad))
        p.__dict__.update(tags)
        # autograd's hooks (tp.py's sequence-parallel reduction) left with the old tensor: install
        # them again
        p._backward_hooks, p._post_accumulate_grad_hooks = pre, post
    else:
        p.data = data


def storage_bytes(tensors, seen):
    """Bytes of the storages behind `tensors`, each storage counted once across calls sharing `seen`
    (by the storage's identity: on the meta device every data_ptr is 0, and a dry run counts meta
    storages)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()
        if s.nbytes() and s._cdata not in seen:
            seen.add(s._cdata)
            total += s.nbytes()
    return total


def split_by_size(named_params, cap_bytes, alone=()):
    """Buckets of consecutive parameters with one dtype and at most cap_bytes (a larger parameter
    gets its own); parameters in `alone` get a bucket each, so their shard layout is the same on
    every stage."""
    buckets, current, size = [], [], 0
    for name, p in named_params:
        bytes_ = p.numel() * p.element_size()
        solo = any(p is q for q in alone)
        if current and (
            solo
            or size + bytes_ > cap_bytes
            or p.dtype != current[0][1].dtype
            or any(q is current[0][1] for q in alone)
        ):
            buckets.append(current)
            current, size = [], 0
        current.append((name, p))
        size += bytes_
    return buckets + ([current] if current else [])
