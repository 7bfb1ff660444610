"""The engine's public API for people wrapping their own model (nanomega/ddp.py, zero.py, zero3.py),
at 2 ranks: module buffers start equal (broadcast or verified, as PyTorch's DDP), ZeRO-3 with the
caller's own optimizer stepping the local shards (zero3.FullyShardedDataParallel, as FSDP2) equals
one process bitwise, and zero_grad() drops what was accumulated (the next step is bitwise the step
without it)."""

import contextlib
import gc
import weakref

import pytest
import torch
import torch.nn as nn

from nanomega import dist, worlds
from nanomega.ddp import DistributedDataParallel
from nanomega.zero import ZeroEngine
from nanomega.zero3 import FullyShardedDataParallel
from test_zero import ACCUM, _batch, _bitwise, _build, _engine, _mean_grads, _train, _weights


class Norm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.bn = nn.BatchNorm1d(3)


def _buffers(grid):
    """Same parameters on every rank, buffers (BatchNorm's running statistics) differing."""

    def build():
        torch.manual_seed(0)
        m = Norm()
        m.bn.running_mean.fill_(float(grid.dp_rank))
        return m

    try:
        DistributedDataParallel(build(), grid)
        error = None
    except ValueError as e:
        error = str(e)
    m = build()
    DistributedDataParallel(m, grid, init="broadcast")
    return dict(error=error, mean=m.bn.running_mean.tolist())


def _fsdp(grid, kind):
    """ZeRO-3 units, torch.optim.AdamW over this rank's shards; the reference: one process, the same
    micro-batches summed as ZeRO-3 does (the ranks of each micro-batch, then the micro-batches)."""
    model, ref = _build(kind), _build(kind)
    fsdp = FullyShardedDataParallel(model, grid)
    opt = torch.optim.AdamW(fsdp.parameters(), lr=1e-2)
    params = [p for p in ref.parameters() if p.requires_grad]
    ref_opt = torch.optim.AdamW(params, lr=1e-2)
    for step in range(3):
        for m in range(ACCUM):
            x, y = _batch(kind, step, grid.dp_rank, m)
            (model(x, y) / ACCUM).backward()
        opt.step()
        fsdp.zero_grad()
        mbs = [[_batch(kind, step, r, m) for m in range(ACCUM)] for r in range(grid.dp.size)]
        for p, t in zip(params, _mean_grads(ref, params, mbs, "mb_last")):
            p.grad = t
        ref_opt.step()
    # every rank gathers every unit to read the full weights
    for u in range(len(fsdp.sharded.units)):
        fsdp.sharded.gather(u)
    got = {k: p.detach().clone() for k, p in model.named_parameters()}
    return _bitwise(got, dict(ref.named_parameters()))


def _zero_grad(grid):
    """A junk backward, then zero_grad(): the training that follows is bitwise the one without
    it."""
    out = {}
    for stage in range(4):
        clean = _weights(_train(_engine(grid, "toy", stage), "toy", 0, 2)[0])
        engine = _engine(grid, "toy", stage)
        x, y = _batch("toy", 99, grid.dp_rank, 0)
        with engine.no_sync() if stage < 2 else contextlib.nullcontext():
            engine.module(x, y).backward()
        engine.zero_grad()
        out[stage] = _bitwise(_weights(_train(engine, "toy", 0, 2)[0]), clean)
    ddp = DistributedDataParallel(_build("toy"), grid)
    ddp.module(*_batch("toy", 0, grid.dp_rank, 0)).backward()
    ddp.zero_grad()
    out["ddp"] = [k for k, p in ddp.module.named_parameters() if p.grad is not None] + [
        j for j, g in enumerate(ddp.groups) if g.grad.count_nonzero()
    ]
    return out


def _raise_in_backward(module):
    """The gradient reaching module's output raises: the backward stops there, after the later
    layers' gradient buckets were launched."""

    def boom(grad):
        raise RuntimeError("injected: backward failed")

    def arm(module, inputs, out):
        out.register_hook(boom)  # (returns None: the output stays as it is)

    return module.register_forward_hook(arm)


def _failed_backward(grid):
    """Issue 43: a backward that raised midway left its reductions in flight and its bookkeeping
    stale (autograd drops the end-of-backward callback), so they outlived the step, and the group
    when a harness ended there; the next backward never finished. After zero_grad() nothing is in
    flight and the training that follows is bitwise the one without the failed backward."""
    out = {}
    for stage in ("ddp", 0, 1, 2, 3):
        wrap = (
            (lambda: DistributedDataParallel(_build("gpt"), grid, bucket_mb=0.05))
            if stage == "ddp"
            else (lambda: _engine(grid, "gpt", stage))
        )
        engine = wrap()
        hook = _raise_in_backward(engine.module.embed)
        with contextlib.suppress(RuntimeError):
            engine.module(*_batch("gpt", 99, grid.dp_rank, 0)).backward()
        hook.remove()
        engine.zero_grad()
        # reductions still in flight, in each set of buckets
        left = sum(len(b._pending) for b in getattr(engine.buckets, "parts", [engine.buckets]))
        if stage == "ddp":  # one synced step, its mean gradients against a fresh DDP's
            clean = DistributedDataParallel(_build("gpt"), grid, bucket_mb=0.05)
            for ddp in (engine, clean):
                ddp.module(*_batch("gpt", 0, grid.dp_rank, 0)).backward()
            grads = dict(engine.module.named_parameters())
            out[stage] = [left] + _bitwise(
                {k: p.grad for k, p in clean.module.named_parameters() if p.grad is not None},
                {k: grads[k].grad for k in grads},
            )
            continue
        clean = _weights(_train(_engine(grid, "gpt", stage), "gpt", 0, 2)[0])
        out[stage] = [left] + _bitwise(_weights(_train(engine, "gpt", 0, 2)[0]), clean)
    return out


def _world(world):
    grid = dist.Grid(world, 1, 1)
    return dict(
        buffers=_buffers(grid),
        fsdp={k: _fsdp(grid, k) for k in ("toy", "gpt")},
        zero_grad=_zero_grad(grid),
        failed_backward=_failed_backward(grid),
    )


@pytest.fixture(scope="module")
def world2():
    return worlds.launch(_world, 2, 2, timeout=300)


def test_buffers_broadcast_or_verified(world2):
    for rank in world2:
        assert (
            rank["buffers"]["error"]
            and "ranks [1] start from other weights" in rank["buffers"]["error"]
        )
        assert rank["buffers"]["mean"] == [0.0, 0.0, 0.0]


def test_zero3_with_your_own_optimizer_equals_one_process(world2):
    for rank in world2:
        assert rank["fsdp"] == dict(toy=[], gpt=[])


def test_zero_grad_drops_the_accumulated_gradients(world2):
    for rank in world2:
        assert rank["zero_grad"] == {0: [], 1: [], 2: [], 3: [], "ddp": []}


def test_a_failed_backward_leaves_nothing_in_flight(world2):
    for rank in world2:
        assert rank["failed_backward"] == {s: [0] for s in ("ddp", 0, 1, 2, 3)}


def test_a_dropped_engine_frees_its_parameters_and_gradient_buffers(grid):
    """A process that builds engines one after another (bench/bench_gpu.py's configurations, these
    tests) gets their memory back once gc.collect() has run (engine and parameters reference each
    other: `del` is not enough). A post-accumulate-grad hook holding the engine kept every parameter
    and gradient buffer alive for good: Python's gc does not see those hooks. One process, CPU: 0
    left of each (before: all)."""

    def build_step_drop(wrap):
        model = _build("gpt")
        wrapped = wrap(model)
        model(*_batch("gpt", 0, 0, 0)).backward()
        if hasattr(wrapped, "step"):
            wrapped.step()
        buffers = [g.grad for g in wrapped.buckets.groups if g.grad is not None]
        return [weakref.ref(t) for t in [model, wrapped, *model.parameters(), *buffers]]

    wrappers = {
        f"zero{s}": lambda m, s=s: ZeroEngine(m, torch.optim.AdamW, dict(lr=1e-3), grid, s)
        for s in range(4)
    }
    wrappers.update(
        ddp=lambda m: DistributedDataParallel(m, grid),
        fsdp=lambda m: FullyShardedDataParallel(m, grid),
    )
    for name, wrap in wrappers.items():
        refs = build_step_drop(wrap)
        gc.collect()
        assert [r() is None for r in refs] == [True] * len(refs), name
