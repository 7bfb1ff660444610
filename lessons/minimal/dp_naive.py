"""Minimal build, step 1: naive data parallelism -- every rank the whole model, 1/N of the batch,
and one all-reduce per parameter after backward.

Idea: rank r computes the gradient g_r of its rows; the mean gradient (g_0 + ... + g_{N-1}) / N is
what one process would get from the whole batch, so after an all-reduce every rank takes the same
AdamW step and the replicas never drift apart. "Naive": one collective per parameter tensor (many
small messages), and all of them wait for the whole backward to finish (no overlap). dp_bucketed.py
fixes both.
Formula: bytes one rank sends per step, ring all-reduce over N: 2 (N - 1) / N x 4 bytes x
parameters.
Run:  python lessons/minimal/dp_naive.py   (2 ranks on this CPU; prints each step's loss)
"""

import torch

from nanomega import dist, worlds
import common


def train(steps=common.STEPS):
    grid = dist.Grid(dp=torch.distributed.get_world_size())  # every rank a data-parallel replica
    dp = grid.dp  # an Axis: its collectives are counted in grid.log
    net = common.model()
    opt, losses = common.optimizer(net.parameters()), []
    for step in range(steps):
        idx, targets = common.batch(step)
        x, y = idx.chunk(dp.size)[dp.rank], targets.chunk(dp.size)[dp.rank]  # this rank's rows
        loss = net(x, y)
        loss.backward()
        for p in net.parameters():  # one all-reduce per tensor, after the whole backward
            dp.all_reduce(p.grad)
            p.grad /= dp.size
        opt.step()
        opt.zero_grad()
        # the mean loss, for printing only
        losses.append((dp.all_reduce(loss.detach()) / dp.size).item())
    params = sum(p.numel() for p in net.parameters())
    return dict(
        losses=losses,
        weights=common.weights(net),
        bytes_per_step=grid.log.bytes("all_reduce") / steps,
        params=params,
    )


if __name__ == "__main__":
    out = worlds.launch(train, 2, 10)[0]
    for step, loss in enumerate(out["losses"]):
        print(f"step {step} loss {loss:.4f}")
    print(
        f"all-reduced per step: {out['bytes_per_step']:,.0f} bytes = 4 x {out['params']:,} parameters + 4 (the loss)"
    )
