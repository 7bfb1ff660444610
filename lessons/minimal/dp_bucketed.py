"""Minimal build, step 2: bucketed data parallelism -- gradients all-reduced in a few large buckets,
each launched while backward still runs.

Idea: backward produces gradients from the last layer to the first. Group the parameters in that
order into buckets of about CAP bytes, each with one flat buffer; a hook on each parameter copies
its gradient into the bucket as soon as autograd has accumulated it, and when a bucket's last
gradient arrives its all-reduce starts (asynchronously). The early layers' backward then runs while
the late layers' gradients are on the wire, and a few large messages replace one per tensor.
PyTorch's DDP (25 MB buckets) and nanomega/ddp.py work this way.
Formula: the same bytes as dp_naive.py (2 (N - 1) / N x 4 per parameter); ceil(4 P / CAP) calls
instead of one per tensor. The result is bitwise dp_naive's: each element is the same 2-term sum,
divided by 2.
Run:  python lessons/minimal/dp_bucketed.py
"""

import torch

from nanomega import dist, worlds
import common

CAP = 64 * 1024  # bytes per bucket: small, so this small model gets several buckets


class Bucket:
    def __init__(self, params, dp):
        self.params, self.dp = params, dp
        self.flat = torch.zeros(sum(p.numel() for p in params))  # (sum of numels,) fp32
        offsets = [0]
        for p in params[:-1]:
            offsets.append(offsets[-1] + p.numel())
        # views
        self.slots = {p: self.flat[o : o + p.numel()].view_as(p) for p, o in zip(params, offsets)}
        self.ready, self.work = 0, None
        for p in params:
            # runs once p.grad holds this backward's sum
            p.register_post_accumulate_grad_hook(self.arrived)

    def arrived(self, p):
        self.slots[p].copy_(p.grad)
        self.ready += 1
        if self.ready == len(self.params):  # the bucket is full: put it on the wire, do not wait
            self.work = self.dp.start("all_reduce", self.flat)

    def finish(self):
        """Wait for the all-reduce; the mean gradient goes back into each p.grad."""
        if self.work is not None:
            self.work.wait()
        self.flat /= self.dp.size
        for p in self.params:
            p.grad.copy_(self.slots[p])
        self.ready, self.work = 0, None


def buckets(net, dp):
    """Parameters in reverse (the order backward finishes them), cut into buckets of at most CAP
    bytes."""
    out, current = [], []
    for p in reversed(list(net.parameters())):
        if current and 4 * (sum(q.numel() for q in current) + p.numel()) > CAP:
            out.append(Bucket(current, dp))
            current = []
        current.append(p)
    return out + [Bucket(current, dp)]


def train(steps=common.STEPS):
    grid = dist.Grid(dp=torch.distributed.get_world_size())
    dp = grid.dp
    net = common.model()
    bucket_list = buckets(net, dp)
    opt, losses = common.optimizer(net.parameters()), []
    for step in range(steps):
        idx, targets = common.batch(step)
        loss = net(idx.chunk(dp.size)[dp.rank], targets.chunk(dp.size)[dp.rank])
        loss.backward()  # the buckets' all-reduces start in here
        for bucket in bucket_list:
            bucket.finish()
        opt.step()
        opt.zero_grad()
        losses.append((dp.all_reduce(loss.detach()) / dp.size).item())
    calls = sum(c for (op, _, _), (c, _) in grid.log.counts.items() if op == "all_reduce")
    return dict(
        losses=losses,
        weights=common.weights(net),
        buckets=len(bucket_list),
        calls=calls // steps - 1,
    )  # per step, less the loss's all-reduce


if __name__ == "__main__":
    out = worlds.launch(train, 2, 10)[0]
    for step, loss in enumerate(out["losses"]):
        print(f"step {step} loss {loss:.4f}")
    print(
        f"{out['calls']} all-reduces of gradients per step ({out['buckets']} buckets of <= {CAP:,} bytes)"
    )
