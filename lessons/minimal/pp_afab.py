"""Minimal build, step 4: a pipeline, all forwards then all backwards (AFAB, GPipe's schedule).

Idea (Huang et al. 2019): cut the layers into p stages, one per rank, and the batch into m
micro-batches.
Stage k receives micro-batch i's activation (b, s, h) from stage k - 1, runs its layers, sends the
output on; the last stage computes the loss. When all m forwards are done, the backwards run in the
same order, each stage receiving d loss / d output from the next stage and sending d loss / d input
to the previous one.
Every stage keeps the activations of all m micro-batches until their backward: memory ∝ m.
Formula: the idle share of a step (the bubble) is (p - 1) / (m + p - 1): the pipeline fills and
drains once.
The gradients add up over the micro-batches in order 0..m-1 on every stage: bitwise one process
doing the same.
Run:  python lessons/minimal/pp_afab.py
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
    for step in range(steps):
        idx, targets = common.batch(step)
        inputs, outputs, total = [], [], torch.zeros(())
        shape = (common.BATCH // MICRO, common.CONFIG.block_size, common.CONFIG.n_embd)  # (b, s, h)
        for i in range(MICRO):  # all forwards
            if first:
                x = idx.chunk(MICRO)[i]
            else:
                x = torch.empty(shape)
                pp.p2p(recvs=[(x, rank - 1)])
                x.requires_grad_()  # a leaf: its .grad is what backward sends to the previous stage
            y = net(x, targets.chunk(MICRO)[i] if last else None)
            if last:
                # the loss of micro-batch i, scaled so the m gradients add up to the mean's
                y = y / MICRO
                total += y.detach()
            else:
                pp.p2p(sends=[(y.detach(), rank + 1)])
            inputs.append(x)
            outputs.append(y)  # kept for backward: the whole graph of micro-batch i (memory ∝ m)
        for i in range(MICRO):  # all backwards, same order
            if last:
                outputs[i].backward()
            else:
                grad = torch.empty(shape)
                pp.p2p(recvs=[(grad, rank + 1)])
                outputs[i].backward(grad)
            if not first:
                pp.p2p(sends=[(inputs[i].grad, rank - 1)])
        opt.step()
        opt.zero_grad()
        losses.append(pp.broadcast(total, src_index=pp.size - 1).item())
    return dict(losses=losses, weights=common.weights(net))


if __name__ == "__main__":
    out = worlds.launch(train, 2, 10)[0]
    for step, loss in enumerate(out["losses"]):
        print(f"step {step} loss {loss:.4f}")
