"""ZeRO stages 0-3: one engine for any nn.Module and element-wise optimizer, over replica groups.

Rank r of a group's N replicas owns the slice [r S, (r+1) S) of every flat buffer, S = ceil(n / N)
(flat.py). STAGE (zero_rules.py) says what each stage shards; ZeroEngine.__init__ is the one place
reading it. Each replica group (zero_rules.Replicas: dense, experts, ...) is reduced over its own
axis; the technique owning a rule builds its group (ep.py, pp.py), the composer passes them in
(compose.build). An optimizer needing whole matrices (muon.Muon) gets, through one seam
(zero_rules.whole_matrices), an owners.Owners: which rank computes each sharded matrix's update.
    stage  keeps between micro-batches   reduce           write-back               bytes/param/rank
    0      the full gradient             all-reduce       none: all stepped whole  16
    1      the full gradient             reduce-scatter   all-gather the slices    4 + 12/N
    2      only its gradient slice       reduce-scatter   all-gather the slices    2 + 14/N
    3      only its gradient slice       reduce-scatter   none: each unit gathered 16/N (zero3.py)
    bytes sent per step (ring, Psi = gradient bytes): stages 0-2 2(N-1)/N Psi; stage 3 3(N-1)/N Psi
Hybrid sharding (a group's Replicas.replicate): N = S ranks shard it inside a host, R replicas
across all-reduce the reduced slices (2(R-1)/R Psi/S per step, formulas.hybrid_comm_bytes).
(bf16 weights, Adam; gradients in grad_dtype, fp32 by default: 2 + 4 + 12 = 18 bytes at stage 0.)
Lesson: lessons/04-data-parallel-and-zero.md
"""

import math

import torch

from . import clip, precision
from . import offload as offloading
from .ddp import bucket_groups, start_equal
from .flat import Piece, storage_bytes
from .zero3 import ShardedParameters
from .zero_buckets import Buckets, ScatterBuckets, ShardBuckets
from .owners import Owners
from .zero_rules import STAGE, Replicas, check_config, communicates, owners, whole_matrices


class ZeroEngine:
    """Owns the gradient buffers, the fp32 master weights and the optimizer of `model`, per replica
    group.

    optim: optimizer kwargs (one group), or param_groups_fn(named trainable params) ->
    [dict(params=[names], **options)]. wrap (stage 3): the modules gathered as units (default
    zero3.default_wrap). replicas: the replica groups (Replicas), in bucket order; default: one
    group over grid.dp_cp (a weight's replicas: dp, and cp, whose ranks hold the same weights and
    other tokens of the sequences).
    init: "verify" (default) or "broadcast" the parameters and buffers (ddp.start_equal), or, for a
    model built on the meta device, values(name, p, start, stop) (meta.Init.values): the engine
    draws each parameter straight into its flat buffers on grid.device -- at stage 3 only this
    rank's shard -- so no rank ever holds more than its share (+ one parameter on the host). On a
    meta grid (a dry run, meta.PaperGrid) nothing is drawn: the buffers are meta too, their bytes
    counted all the same.
    offload: the share (0..1) of this rank's optimizer elements whose fp32 masters and Adam state
    live in host memory and step on the CPU (offload.py: ZeRO-Offload; Adam/AdamW, stages 1-3).
    offload_params (stage 3, offload 1): the parameter shards in host memory too, copied up at each
    gather (zero3.py). wire (stage 3): another format for the parameters it takes on the
    all-gather (fp8_gather.FP8Gather: the FP8 linear's weights as E4M3 codes and scales).
    zeropp (stage 3): a zeropp.Plan: qwZ's wire, hpZ's secondary axis, qgZ's reduce-scatter.
    Use: forward/backward as usual (`with engine.no_sync():` on all but the last micro-batch), then
    step(). Your own optimizer: ddp.DistributedDataParallel, zero3.FullyShardedDataParallel.
    """

    def __init__(
        self,
        model,
        optimizer_cls,
        optim,
        grid,
        stage=0,
        bucket_mb=25,
        grad_dtype=torch.float32,
        wrap=None,
        replicas=None,
        init="verify",
        offload=0.0,
        offload_params=False,
        wire=None,
        zeropp=None,
    ):
        pp = grid.pp.size if grid is not None else 1
        check_config(stage, optimizer_cls, pp, offload, offload_params)
        named = list(model.named_parameters())  # tied parameters once, under their first name
        replicas = replicas or [Replicas("dense", grid.dp_cp)]
        dense, owner = owners([k for k, _ in named], replicas)
        trainable = [(k, p) for k, p in named if p.requires_grad]
        if not trainable:
            raise ValueError(
                "the model has no trainable parameters (all requires_grad=False): "
                "nothing to synchronise"
            )

        # the groups with parameters here; what the engine cannot do with one, said by its technique
        held = [r for r in replicas if any(owner[k] is r for k, _ in trainable)]
        for r in held:
            if r.whole and stage != 3:
                raise ValueError(
                    f"Replicas({r.name!r}, whole=True): keeping parameters whole only "
                    f"means something at stage 3 (got --zero {stage})"
                )
            if r.check is not None:
                r.check(stage, offload)
            if STAGE[stage].parameters and not r.whole and r is not dense:
                raise ValueError(
                    f"--zero 3 with replica group {r.name!r}: ZeRO-3's units are "
                    f"sharded over the default group's axis; use --zero 0, 1 or 2"
                )

        # init: a mode, or a meta model's values (a dry run: shapes only, nothing to draw)
        values = init if callable(init) and grid.device.type != "meta" else None
        init = "verify" if callable(init) else init
        device = grid.device if values is not None else None  # else: where the parameters are
        specs = self._param_groups(optim, trainable)  # before ZeRO-3 empties the parameters
        self.module, self.grid, self.stage = model, grid, stage
        self.axis = dense.axis  # the default group's axis: ZeRO-3 shards its units over it
        self.replicate = dense.replicate  # hybrid sharding: its copies across hosts (None: off)
        self.zeropp = zeropp  # ZeRO++'s plan (None: off): read by the dry run's bytes per link
        row = STAGE[stage]  # the one place the stage's row is read

        # ZeRO-3: units of shards (zero3.py) over the default group's axis; whole groups: buckets
        self.sharded, units = None, []
        if row.parameters:  # while the parameters are whole (meta: nothing); hybrid: across too
            for axis in filter(None, (self.axis, dense.replicate)):
                start_equal(model, axis, init)
            sharded = [(k, p) for k, p in named if not owner[k].whole]
            secondary = None
            if zeropp is not None:  # ZeRO++: its wire (qwZ) and secondary axis (hpZ)
                wire, secondary = wire or zeropp.wire(), zeropp.secondary
            self.sharded = ShardedParameters(
                model,
                sharded,
                self.axis,
                wrap,
                values,
                device,
                host=offload_params,
                wire=wire,
                secondary=secondary,
            )
            units = [g for g in self.sharded.groups if g.trainable]

        # each replica group's flat buckets, split over its axis from stage 1 on, backward's order
        self.replicas, self.rule, self.groups, parts = [], {}, [], []
        for r in held:
            whole = r.whole or not row.parameters
            mine = [(k, p) for k, p in trainable if owner[k] is r and whole]
            groups = (units if r is dense else []) + bucket_groups(
                mine,
                bucket_mb,
                r.axis,
                split=row.optimizer and not row.parameters,
                alone=[p for p, _ in r.extra_sums],
                values=values,
                device=device,
            )
            self.replicas.append((r, groups))
            self.rule.update({id(g): r for g in groups})
            self.groups += groups
        if not row.parameters:  # now that the buffers hold the values (drawn, for a meta model)
            for r in held:  # keep: its own parameters; hybrid sharding: the replicas across too
                for axis in filter(None, (r.axis, r.replicate)):
                    start_equal(model, axis, init, lambda k, r=r: owner[k] is r)

        # the gradients reduced while backward runs: one set of buckets per group, over its axis
        for r, groups in self.replicas:
            if row.gradients:  # ZeRO-2/3: only the owned slice of the gradient kept
                release = self.sharded.release if row.parameters else None
                parts.append(
                    ShardBuckets(
                        groups,
                        r.axis,
                        grad_dtype,
                        in_order=not row.parameters,
                        after_reduce=release,
                        # ZeRO++'s qgZ: the dense group's gradients quantized, hierarchically
                        scatter=zeropp.scatter() if zeropp is not None and r is dense else None,
                    )
                )
            else:
                parts.append(ScatterBuckets(groups, r.axis, grad_dtype))
        self.buckets = Buckets(parts)

        # the optimizer over this rank's pieces of fp32 masters, some of them on the host (offload)
        self.norm_over_dp = row.optimizer  # the pieces differ per dp rank: the norm adds theirs
        # fp32 model: the same tensor (no copy); 16-bit model: the fp32 master
        for g in self.groups:
            g.master = precision.fp32_master(g.own)
        host = offloading.choose(self.groups, offload)  # none when offload == 0
        resident = [g for g in self.sharded.groups if g.trainable] if offload_params else []
        self.offload = offloading.Offload(host, self.groups[0].device, resident)
        self.optimizer = self._build_optimizer(optimizer_cls, specs)
        if whole_matrices(optimizer_cls):  # the seam: who computes each sharded matrix (owners.py)
            groups, whole = self.optimizer.param_groups, self.optimizer.whole
            self.owners = Owners(
                [(r.axis, gs) for r, gs in self.replicas],
                self.pieces,
                lambda k: groups[self.group_of[k]] if whole(groups[self.group_of[k]]) else None,
                grid.tp if grid is not None else None,
            )
            self.optimizer.place(self.owners)
        if communicates(optimizer_cls):  # the seam: it averages over the dense axis itself
            if len(held) > 1:
                raise ValueError(f"{optimizer_cls.__name__}: one replica group only (dense)")
            self.optimizer.communicate(self.axis)
            for part in self.buckets.parts:
                part.local = self.optimizer.local

        # this rank's share of the norm, per replica group: fixed by the layout (and by a group's
        # copies another rank counts)
        counted = [
            piece
            for piece in self.pieces
            if piece.group
            and clip.counts(piece.group.params[piece.index], piece.replica, grid, self.norm_over_dp)
            and not self.uncounted(piece)
        ]
        self.norm_pieces = [
            (r, [p for p in counted if self.rule[id(p.group)] is r]) for r, _ in self.replicas
        ]

    def no_sync(self):
        """Micro-batches before the last: no reduction (stages 0-1; ddp.GradBuckets.no_sync)."""
        return self.buckets.no_sync()

    def zero_grad(self):
        """Drop the gradients accumulated since the last step (step() does it after updating)."""
        self.buckets.zero_grad()

    def _param_groups(self, optim, trainable):
        specs = (
            optim(trainable)
            if callable(optim)
            else [dict(params=[k for k, _ in trainable], **optim)]
        )
        self.group_of = {}
        for j, spec in enumerate(specs):
            for k in spec["params"]:
                if k in self.group_of:
                    raise ValueError(f"param_groups_fn puts parameter {k} in two groups")
                self.group_of[k] = j
        missing = [k for k, _ in trainable if k not in self.group_of]
        if missing:
            raise ValueError(
                f"param_groups_fn leaves out trainable parameters {missing[:3]}; give each a group"
            )
        return specs

    def _build_optimizer(self, optimizer_cls, specs):
        """The optimizer steps this rank's pieces (views of the fp32 masters); whole groups: shaped
        parameters."""
        groups = [dict(spec, params=[]) for spec in specs]
        self.pieces = []  # the Piece of every parameter slice this rank steps
        for g in self.groups:
            for i, a, b in g.pieces():
                m = g.master[a - g.lo : b - g.lo]
                if not g.split:  # held whole: shaped, so shape-aware optimizers work too
                    m = m.view(g.shapes[i])
                groups[self.group_of[g.names[i]]]["params"].append(m)
                self.pieces.append(
                    Piece(
                        g.names[i],
                        tuple(g.shapes[i]),
                        a - g.offsets[i],
                        b - g.offsets[i],
                        m,
                        replica=not g.split,
                        group=g,
                        index=i,
                        at=a - g.lo,
                    )
                )
        # a rank owning nothing of a group steps an empty piece: same state keys on all
        for group in groups:
            if not group["params"]:
                empty = self.groups[0].master[:0]
                group["params"].append(empty)
                self.pieces.append(Piece("", (0,), 0, 0, empty, replica=False))
        return optimizer_cls(groups)

    def uncounted(self, piece):
        """Whether piece's replica group marks it a copy another rank counts in the norm."""
        rule = self.rule[id(piece.group)].uncounted
        return rule is not None and rule(piece.group.params[piece.index])

    def _grad(self, piece):
        g = piece.group
        return g.grad_own[piece.at : piece.at + piece.end - piece.start].view_as(piece.master)

    # ---- the step ----
    def set_lr(self, lr):
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def reduce(self, scaler=None, pp=True):
        """Finish the reductions, average, unscale (fp16), add the extra sums (the tied embedding's
        two copies), and return the global gradient norm's square on the device (fp64, one element)
        without waiting for it: a trainer reads it together with the loss in one host sync, then
        calls step(norm=...). pp=False: the norm summed over this pipeline stage only."""
        self.buckets.finish()  # all micro-batches under no_sync (or none ran): reduce now; wait

        # hybrid sharding: each slice's sum over the replicate axis too (across hosts; Psi/S each)
        across = [(g, self.rule[id(g)].replicate) for g in self.groups if g.split]
        works = [r.start("all_reduce", g.grad_own) for g, r in across if r is not None]
        for work in filter(None, works):
            work.wait()

        # each group's mean over its replicas, then the extra sums of its own-bucket parameters
        for g in self.groups:
            r = self.rule[id(g)]
            n = r.axis.size * (r.replicate.size if r.replicate is not None else 1)
            if g.split and n > 1:  # whole groups: averaged; slices: sums
                g.grad_own.div_(n)
            if r.divide > 1:  # e.g. an expert's sum covers the tokens of edp x ep = dp ranks
                g.grad_own.div_(r.divide)
            precision.unscale_(g.grad_own, scaler)
            for p, axis in r.extra_sums:
                if g.params[0] is p:
                    axis.all_reduce(g.grad_own)

        # the optimizer's gradients (an offloaded piece: none, the optimizer skips it: offload.py's)
        host = self.offload.offloaded
        for piece in self.pieces:
            piece.master.grad = (
                None
                if host(piece.group)
                else self._grad(piece).float()
                if piece.group
                else piece.master.new_zeros(0)
            )

        # the norm: each group's counted shares, summed over its axis (sharded) and its `across`
        shares = []
        for r, mine in self.norm_pieces:
            grads = [self._grad(p).float() if host(p.group) else p.master.grad for p in mine]
            shares.append((grads, r.axis, r.across))
        device = self.groups[0].device
        return clip.global_norm_squared(shares, self.grid, self.norm_over_dp, device, pp)

    def step(self, clip_norm=None, scaler=None, skip=False, norm=None, check_finite=True):
        """reduce() (unless the caller did, and passes its norm read on the host), global norm,
        clip, step the owned pieces, write the parameters back (all-gather for stages 1-2), zero the
        gradients. -> dict(grad_norm, stepped, finite). skip=True drops the update (a loss spike,
        job/guard.Spikes) like a non-finite one. check_finite=False: the masters' finite check is
        the caller's (nonfinite_masters, no host sync; train.py votes on it at the step boundary):
        the weights are written back regardless."""
        if norm is None:
            norm = self.reduce(scaler).sqrt().item()
        stepped = math.isfinite(norm) or scaler is None
        if scaler is not None:
            scaler.update(not stepped)
        stepped, finite = stepped and not skip, True
        if stepped:
            clip.clip_(
                [p.master.grad for p in self.pieces if p.master.grad is not None], norm, clip_norm
            )
            self.optimizer.step()

            # the host groups: D2H, CPU Adam, H2D (their weights written back already)
            written = self.offload.step(
                self.pieces, self.optimizer, self.group_of, clip.coefficient(norm, clip_norm)
            )
            # a finite gradient can still give inf/NaN weights (lr, decay, overflow)
            finite = not check_finite or self.masters_finite()
            if finite:
                self.write_back(skip=written)
        self.buckets.zero_grad()  # between steps ZeRO-3 holds no gradient at all
        return dict(grad_norm=norm, stepped=stepped and finite, finite=finite)

    def nonfinite_masters(self):
        """This rank's count of non-finite fp32 masters: one read of them -- aminmax: a NaN or an
        infinity reaches the min or the max, no mask allocated -- left on the device (1 element,
        fp32)."""
        bad = torch.zeros(1, device=self.groups[0].device)
        ends = [
            t.to(bad.device)
            for g in self.groups
            if g.master.numel()
            for t in torch.aminmax(g.master)
        ]
        if ends:  # (offloaded masters: on the host)
            bad += (~torch.isfinite(torch.stack(ends))).sum()
        return bad

    def masters_finite(self):
        """Whether every fp32 master weight of the job is finite, the same answer on every rank (the
        caller must stop: the update cannot be undone without a copy of the masters and the
        optimizer state, 12 more bytes per parameter): nonfinite_masters, then a 1-element
        all-reduce per axis, as the gradient norm's."""
        bad = self.nonfinite_masters()
        # dp_cp when the masters differ per dp rank (ZeRO-1..3), as the norm: it spans every group's
        # ranks; else the ranks holding a group's other parameters (ep: other experts)
        across = [r.across for r, _ in self.replicas if r.across is not None]
        axes = [self.axis] if self.norm_over_dp else across
        for axis in axes + [self.grid.tp, self.grid.pp]:
            axis.all_reduce(bad)
        return bad.item() == 0

    def write_back(self, skip=()):
        """The fp32 masters -> the model's parameters in their dtype; stages 1-2 all-gather the
        slices over each group's axis. Call it after changing the masters yourself (step() calls
        it). skip: groups whose slice is written already (offloaded: uploaded by offload.py), only
        gathered."""
        works = []
        for g in self.groups:
            if not any(g is s for s in skip):
                precision.write_back(g.master, g.own)
            if g.split and g.shard is None:
                axis = self.rule[id(g)].axis
                # in place: own is full's slice
                works.append(axis.start("all_gather", g.full, g.own))
        for w in works:
            if w is not None:
                w.wait()

    def memory_bytes(self):
        """Bytes this rank holds now, from the tensors allocated (each storage counted once)."""
        seen, groups = set(), self.groups + (self.sharded.frozen if self.sharded else [])
        frozen = [p for p in self.module.parameters() if not p.requires_grad]
        params = storage_bytes([g.full for g in groups] + [g.shard for g in groups] + frozen, seen)
        grads = storage_bytes(
            [g.grad for g in self.groups] + [s.bucket for s in self.buckets.progress], seen
        )
        state = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        optimizer = storage_bytes([g.master for g in self.groups] + state, seen)
        return dict(params=params, grads=grads, optimizer=optimizer)
