"""Minimal build, step 3: ZeRO-1 -- each rank keeps the AdamW state of 1/N of the parameters only.

Idea (Rajbhandari et al. 2020): with data parallelism every rank holds the same AdamW state (m and
v: 8 bytes per parameter, the biggest share of 16 bytes/param with mixed precision) and does the
same update N times.
Lay the parameters end to end in one flat vector padded to N S elements (S = ceil(P / N)); rank r
owns the slice [r S, (r+1) S). Per step: a reduce-scatter leaves each rank the summed gradient of
its slice only, the rank updates its slice (an AdamW over one 1-D tensor: AdamW works element by
element, so that is exact), and an all-gather gives everyone the updated parameters.
Formula: optimizer state 8 P / N bytes per rank instead of 8 P; bytes on the wire: reduce-scatter +
all-gather = (N - 1) / N x 4 x N S each, the same 2 (N - 1) / N x 4 P as dp_naive's all-reduce (an
all-reduce IS a reduce-scatter followed by an all-gather). nanomega/zero.py and nanomega/flat.py do
this for any model and stages 1-3.
Run:  python lessons/minimal/zero1.py
"""

import torch

from nanomega import dist, worlds
import common


def train(steps=common.STEPS):
    grid = dist.Grid(dp=torch.distributed.get_world_size())
    dp = grid.dp
    net = common.model()
    params = list(net.parameters())
    numel = sum(p.numel() for p in params)
    shard = -(-numel // dp.size)  # S = ceil(P / N)
    flat = torch.zeros(shard * dp.size)  # (N S,): the parameters end to end, zero-padded
    torch.cat([p.detach().reshape(-1) for p in params], out=flat[:numel])
    # (S,): what this rank updates
    mine = flat[dp.rank * shard : (dp.rank + 1) * shard].clone().requires_grad_()
    opt = common.optimizer([mine])  # AdamW state for S elements, not P
    losses = []
    for step in range(steps):
        idx, targets = common.batch(step)
        loss = net(idx.chunk(dp.size)[dp.rank], targets.chunk(dp.size)[dp.rank])
        loss.backward()
        grads = torch.zeros(shard * dp.size)  # (N S,) this rank's gradients, end to end
        torch.cat([p.grad.reshape(-1) for p in params], out=grads[:numel])
        # (S,): the sum over ranks of my slice
        mine.grad = dp.reduce_scatter(torch.empty(shard), grads)
        mine.grad /= dp.size
        opt.step()
        opt.zero_grad()
        dp.all_gather(flat, mine.detach())  # every rank's updated slice -> the whole vector
        with torch.no_grad():
            offset = 0
            for p in params:  # the model's parameters take the new values
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
                p.grad = None
        losses.append((dp.all_reduce(loss.detach()) / dp.size).item())
    state = sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim()
    )
    return dict(
        losses=losses,
        weights=common.weights(net),
        state_bytes=state,
        params=numel,
        wire=grid.log.wire_bytes() / steps,
    )


if __name__ == "__main__":
    out = worlds.launch(train, 2, 10)[0]
    for step, loss in enumerate(out["losses"]):
        print(f"step {step} loss {loss:.4f}")
    print(
        f"AdamW state on this rank: {out['state_bytes']:,} bytes = 8 x {out['params']:,} parameters / 2 (+ padding)"
    )
