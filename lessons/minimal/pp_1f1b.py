"""Minimal build, step 5: the 1F1B pipeline schedule -- the same bubble as AFAB, activations for p
micro-batches instead of m.

Idea (PipeDream-Flush, Narayanan et al. 2021): start micro-batch i's backward as soon as possible.
Stage k runs warm-up = p - k - 1 forwards, then alternates one forward and one backward (the steady
state), then runs the backwards left (the cool-down). At most p - k micro-batches are in flight on
stage k, whatever m.
The catch is deadlock: in the steady state a stage sends its output forward and waits for a gradient
from the next stage, which is itself sending a gradient back and waiting for an activation. Each
pair of messages goes in ONE batched call (Megatron's send_forward_recv_backward /
send_backward_recv_forward), so both neighbours post both directions before either waits.
Formula: bubble (p - 1) / (m + p - 1), as AFAB; peak activations ∝ min(m, p - k) micro-batches, not
m. nanomega/schedules.py writes any schedule as data, and nanomega/pp.py runs it; this file is one
schedule by hand.
Run:  python lessons/minimal/pp_1f1b.py
"""

import torch

from nanomega import dist, worlds
import common

MICRO = 4  # micro-batches per step


def train(steps=common.STEPS):
    grid = dist.Grid(pp=torch.distributed.get_world_size())
    pp, rank = grid.pp, grid.pp_rank
    first, last = rank == 0, rank == pp.size - 1
    net = common.stage(rank, pp.size)
    opt, losses = common.optimizer(net.parameters()), []
    shape = (common.BATCH // MICRO, common.CONFIG.block_size, common.CONFIG.n_embd)  # (b, s, h)

    def exchange(send_fwd=None, send_bwd=None, recv_fwd=False, recv_bwd=False):
        """One batched p2p call: an activation to rank + 1 and/or a gradient to rank - 1, and what
        comes back."""
        act = torch.empty(shape) if recv_fwd and not first else None
        grad = torch.empty(shape) if recv_bwd and not last else None
        pp.p2p(
            sends=[
                (t, peer)
                for t, peer in ((send_fwd, rank + 1), (send_bwd, rank - 1))
                if t is not None and 0 <= peer < pp.size
            ],
            recvs=[(t, peer) for t, peer in ((act, rank - 1), (grad, rank + 1)) if t is not None],
        )
        return act, grad

    for step in range(steps):
        idx, targets = common.batch(step)
        inflight, total, peak = [], torch.zeros(()), 0

        def forward(i, x):
            x = idx.chunk(MICRO)[i] if first else x.requires_grad_()
            y = net(x, targets.chunk(MICRO)[i] if last else None)
            if last:
                y = y / MICRO
                total.add_(y.detach())
            inflight.append((x, y))
            return None if last else y.detach()

        def backward(grad):  # the oldest micro-batch in flight; returns d loss / d its input
            x, y = inflight.pop(0)
            y.backward(None if last else grad)  # the last stage starts from its loss
            return None if first else x.grad

        warmup = min(pp.size - rank - 1, MICRO)
        for i in range(warmup):  # warm-up: forwards only
            x, _ = exchange(recv_fwd=True)
            exchange(send_fwd=forward(i, x))
            peak = max(peak, len(inflight))
        x, _ = exchange(recv_fwd=warmup < MICRO)
        for i in range(warmup, MICRO):  # steady state: one forward, one backward
            out = forward(i, x)
            peak = max(peak, len(inflight))
            _, grad = exchange(send_fwd=out, recv_bwd=True)  # send_forward_recv_backward
            dx = backward(grad)
            x, _ = exchange(send_bwd=dx, recv_fwd=i + 1 < MICRO)  # send_backward_recv_forward
        for _ in range(warmup):  # cool-down: the backwards left
            _, grad = exchange(recv_bwd=True)
            exchange(send_bwd=backward(grad))
        opt.step()
        opt.zero_grad()
        losses.append(pp.broadcast(total, src_index=pp.size - 1).item())
    return dict(losses=losses, weights=common.weights(net), peak_in_flight=peak)


if __name__ == "__main__":
    outs = worlds.launch(train, 2, 10)
    for step, loss in enumerate(outs[0]["losses"]):
        print(f"step {step} loss {loss:.4f}")
    print(
        "micro-batches in flight at most, per stage:",
        [o["peak_in_flight"] for o in outs],
        f"(AFAB: {MICRO} on every stage)",
    )
