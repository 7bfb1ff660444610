"""ZeRO-Offload: the fp32 master weights and Adam's state in host memory, the step on the CPU.

The 12 bytes per parameter only the optimizer step reads (fp32 master, Adam's m and v) live on the
host (Ren et al. 2021, DeepSpeed's offload_optimizer). Per offloaded flat group: its gradient down
(D2H), the fused CPU Adam (cpu_adam.py) on its pieces, its weights up (H2D: the write-back),
pipelined across groups. `fraction` offloads the largest groups first (DeepSpeed's ratio); the
engine calls Offload.step once per step.
Formula (P parameters on this rank after ZeRO's 1/N, fully offloaded, bf16 model, fp32 gradients):
    device bytes   2 P (weights) + 4 P (gradients)         instead of 2 + 4 + 12 (zero.py)
    host bytes     12 P (master, m, v) + 4 P (pinned gradient buffers) + 2 P (weights to upload)
    PCIe per step  4 P down (fp32 gradients) + 2 P up (bf16 weights): 6 P, overlapping the CPU step
    CPU step       30 P bytes through host memory: cpu_adam.py's one pass (28) also applies the
                   clip coefficient and writes the bf16 weights (2); as three passes
                   (grad *= c; AdamW; cast) it would be 42
Lesson: lessons/04-data-parallel-and-zero.md (section "Beyond the device: ZeRO-Offload")
"""

import torch

from . import cpu_adam

ADAM = (
    torch.optim.Adam,
    torch.optim.AdamW,
    cpu_adam.CPUAdamW,
)  # the update the CPU kernel computes


def choose(groups, fraction):
    """The groups to offload: the largest first, until their optimizer elements reach `fraction` of
    all."""
    total = sum(g.master.numel() for g in groups)
    chosen, held = [], 0
    for g in sorted(groups, key=lambda g: -g.master.numel()):
        if held >= fraction * total or g.master.numel() == 0:
            break
        chosen.append(g)
        held += g.master.numel()
    return chosen


class Offload:
    """The host half of a ZeroEngine: `groups` get host fp32 masters (pinned beside a GPU) and
    pinned gradient buffers; `step` runs the D2H -> CPU Adam -> H2D pipeline over them. The engine
    keeps its optimizer for everything: offloaded pieces are stepped here with its hyper-parameters
    and its `state` entries."""

    def __init__(self, groups, device, resident=()):
        # resident: groups whose weights (ZeRO-3 shards) live on the host as well (parameter
        # offload): their update is written into the host shard, and goes up at each gather instead
        # (zero3.py)
        self.groups, self.device, self.resident = groups, device, {id(g) for g in resident}
        pinned = device.type == "cuda"
        self.grads, self.staged = (
            {},
            {},
        )  # id(group) -> its host gradient buffer, its weights in the model's dtype

        for g in (
            groups
        ):  # a separate host copy even for an fp32 model on the CPU: the same path as on a GPU
            g.master = torch.empty(g.own.shape, dtype=torch.float32, pin_memory=pinned).copy_(g.own)
            self.grads[id(g)] = torch.empty(g.own.shape, dtype=g.grad_own.dtype, pin_memory=pinned)
            self.staged[id(g)] = (
                g.master
                if g.own.dtype == torch.float32
                else torch.empty(g.own.shape, dtype=g.own.dtype, pin_memory=pinned).copy_(g.master)
            )  # 2 bytes cross
            # (copied once: the padding between pieces, which no step writes, goes up as it came)

        # the copies' streams, beside the compute stream: one per direction, so that an upload
        # never queues behind the next group's download (a GPU copies both ways at once)
        cuda = pinned and groups
        self.streams = {way: torch.cuda.Stream(device) for way in ("down", "up")} if cuda else None
        self.moved = dict(
            down=0, up=0
        )  # bytes copied device -> host and host -> device (lessons/04_zero.py)
        self.by_group = None

    def offloaded(self, group):
        return id(group) in self.grads

    def _copy(self, dst, src, way):
        """dst.copy_(src), queued on the copy stream on a GPU; returns the event that marks it done
        (or None)."""
        self.moved[way] += src.numel() * src.element_size()
        if self.streams is None:
            dst.copy_(src)
            return None
        stream = self.streams[way]
        stream.wait_stream(
            torch.cuda.current_stream(self.device)
        )  # src is ready on the compute stream
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        return done

    @torch.no_grad()
    def step(self, pieces, optimizer, group_of, coefficient):
        """Step the pieces of the offloaded groups: per group, its gradient down (the next group's
        already copying), scaled by the clip coefficient, the CPU Adam step of each piece, its
        weights up; the compute stream waits for the uploads. Returns the groups stepped here (their weights written
        back already:
        ZeroEngine.write_back's skip)."""
        if (
            self.by_group is None
        ):  # the engine's pieces are fixed once it is built: sorted into groups once
            self.by_group = {id(g): [p for p in pieces if p.group is g] for g in self.groups}
        by_group = self.by_group

        # the first group's gradient goes down now; each next one while the group before steps
        downs = [self._copy(self.grads[id(g)], g.grad_own, "down") for g in self.groups[:1]]
        ups = []
        for i, g in enumerate(self.groups):
            if i + 1 < len(
                self.groups
            ):  # prefetch: the next gradient copies while this group steps
                nxt = self.groups[i + 1]
                downs.append(self._copy(self.grads[id(nxt)], nxt.grad_own, "down"))
            if downs[i] is not None:
                downs[i].synchronize()
            grad = (
                self.grads[id(g)]
                if self.grads[id(g)].dtype == torch.float32
                else self.grads[id(g)].float()
            )

            # the write-back's rounding to the model's dtype, on the host: into the host shard
            # itself (resident: nothing crosses now) or into the staging buffer that goes up; bf16
            # inside the kernel's pass
            staged = g.own if id(g) in self.resident else self.staged[id(g)]
            fused_out = staged.dtype == torch.bfloat16
            for piece in by_group[
                id(g)
            ]:  # clip.clip_'s scaling (coefficient) inside the kernel's pass as well
                at = slice(piece.at, piece.at + piece.end - piece.start)
                self._adam(
                    piece,
                    grad[at],
                    optimizer,
                    optimizer.param_groups[group_of[piece.name]],
                    coefficient,
                    staged[at] if fused_out else None,
                )

            if not fused_out and staged is not g.master:
                staged.copy_(g.master)  # an fp16 model: the rounding as a pass of its own
            if id(g) not in self.resident:
                ups.append(self._copy(g.own, staged, "up"))

        # the compute stream, not the host, waits for the weights: the host goes on at once (its
        # staging buffers are next written after the next step's download, which the compute
        # stream orders after these uploads)
        for done in ups:
            if done is not None:
                torch.cuda.current_stream(self.device).wait_event(done)
        return self.groups

    @staticmethod
    def _adam(piece, grad, optimizer, group, grad_scale, out):
        """torch.optim.AdamW's update of one piece by the CPU kernel, its state in the engine's
        optimizer; its gradient times grad_scale first, the new weights also rounded into `out`
        (bf16) if given."""
        m = piece.master
        state = optimizer.state[m]
        if (
            not state
        ):  # as torch.optim.AdamW creates it: a 0-d fp32 step, m and v like the parameter
            state.update(
                step=torch.tensor(0.0), exp_avg=torch.zeros_like(m), exp_avg_sq=torch.zeros_like(m)
            )

        state["step"] += 1
        beta1, beta2 = group["betas"]
        cpu_adam.adam_step(
            m.reshape(-1),
            grad,
            state["exp_avg"].reshape(-1),
            state["exp_avg_sq"].reshape(-1),
            lr=float(group["lr"]),
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            step=state["step"].item(),
            grad_scale=grad_scale,
            out=None if out is None else out.reshape(-1),
            decoupled=group.get(
                "decoupled_weight_decay",  # torch < 2.6 has no such key
                isinstance(optimizer, (torch.optim.AdamW, cpu_adam.CPUAdamW)),
            ),
        )


def check(optimizer_cls, stage, fraction=1.0, params=False):
    """One line for what offload cannot do: an optimizer the CPU kernel does not compute, ZeRO stage
    0, or parameters offloaded without ZeRO-3 or without all of the optimizer state (their update is
    on the host)."""
    if not issubclass(optimizer_cls, ADAM):
        raise ValueError(
            f"--offload: the CPU step computes Adam/AdamW, not {optimizer_cls.__name__}"
        )
    # (--offload-params alone is named as itself, not as --offload)
    if params and (stage != 3 or fraction != 1.0):
        raise ValueError(
            f"--offload-params needs --zero 3 and --offload 1 (got --zero {stage}, --offload "
            f"{fraction:g}): parameter shards exist at stage 3 only, and the CPU step that updates them "
            f"must hold every master"
        )
    if stage == 0:
        raise ValueError(
            "--offload needs --zero 1, 2 or 3 (ZeRO-Offload offloads a ZeRO engine's optimizer state)"
        )
