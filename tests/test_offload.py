"""ZeRO-Offload (offload.py) at dp2 equals the same engine without offload, for ZeRO 1, 2 and 3.

Bitwise, because the math guarantees it: the reference steps the same pieces with cpu_adam.CPUAdamW
-- the fused kernel the offloaded groups step with, the same arithmetic in the same order, with the
same clip coefficient -- so the only differences offload makes are where the masters live and the
copies (gradients down, weights up), which round nothing in fp32. Against torch.optim.AdamW (another
order of the same math) the bound is tests/test_cpu_adam.py's; here train.py with --offload checks
the loss curve within the layout tolerance.

On this CPU-only machine the copies are host-to-host; the CUDA streams and pinned buffers are the
GPU tier's.
"""

import contextlib
import json
from pathlib import Path

import pytest
import torch

from nanomega import cpu_adam, dist, reshard, train, worlds, zero, zero_rules
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT
from tolerance import layout_rtol

# a small clip norm: clipping is active, so the host path must apply it too
STEPS, ACCUM, CLIP = 4, 2, 0.05
OPTIM = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)


def build(grid, stage, optimizer, offload, dtype=torch.float32, params=False):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=100, block_size=16, n_layer=2, n_head=2, n_embd=48)).to(dtype)
    return zero.ZeroEngine(
        model,
        optimizer,
        zero_rules.weight_decay_groups(**OPTIM),
        grid,
        stage,
        bucket_mb=0.02,
        offload=offload,
        offload_params=params,
    )


def train_steps(engine, grid):
    losses = []
    for step in range(STEPS):
        for m in range(ACCUM):
            g = torch.Generator().manual_seed(1000 * step + 10 * grid.dp_rank + m)
            x, y = (
                torch.randint(0, 100, (2, 16), generator=g),
                torch.randint(0, 100, (2, 16), generator=g),
            )
            with engine.no_sync() if m < ACCUM - 1 else contextlib.nullcontext():
                loss = engine.module(x, y)
                (loss / ACCUM).backward()
        info = engine.step(clip_norm=CLIP)
        losses.append((loss.item(), info["grad_norm"], info["stepped"]))
    return losses


def weights_and_state(engine):
    params, optim = reshard.full_state(engine)
    return {k: v.clone() for k, v in params.items()}, {
        k: {n: t.clone() if torch.is_tensor(t) else t for n, t in s.items()}
        for k, s in optim.items()
    }


def same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def _world():
    grid, out = dist.Grid(2, 1, 1), {}
    for stage in (1, 2, 3):
        for fraction in (1.0, 0.5):
            ref = build(grid, stage, cpu_adam.CPUAdamW, 0.0)
            # the groups not offloaded step with the engine's optimizer: at 0.5 the same kernel
            # (everything is on the CPU here) keeps the comparison bitwise; at 1.0 torch's AdamW
            # only holds the state
            host = build(
                grid, stage, cpu_adam.CPUAdamW if fraction < 1 else torch.optim.AdamW, fraction
            )
            n_host = sum(g.master.numel() for g in host.offload.groups)
            on_host = all(g.master.data_ptr() != g.own.data_ptr() for g in host.offload.groups)
            a, b = train_steps(ref, grid), train_steps(host, grid)
            wa, wb = weights_and_state(ref), weights_and_state(host)
            out[stage, fraction] = dict(
                losses=a == b,
                weights=same(wa[0], wb[0]),
                state=same(wa[1], wb[1]),
                model=all(
                    torch.equal(p, q)
                    for p, q in zip(ref.module.parameters(), host.module.parameters())
                ),
                clipped=all(n > CLIP for _, n, _ in a),
                on_host=on_host,
                share=n_host / sum(g.master.numel() for g in host.groups),
            )
    # ZeRO-3 parameter offload: the shards on the host too, copied up at every gather; bitwise the
    # same run
    ref, host = (
        build(grid, 3, cpu_adam.CPUAdamW, 0.0),
        build(grid, 3, torch.optim.AdamW, 1.0, params=True),
    )
    a, b = train_steps(ref, grid), train_steps(host, grid)
    wa, wb = weights_and_state(ref), weights_and_state(host)
    shards = [g for g in host.sharded.groups if g.trainable]
    # each unit gathered once in forward and once in backward per micro-batch: this rank's shard
    # goes up each time
    formula = (
        STEPS
        * ACCUM
        * 2
        * sum(g.shard.numel() * g.shard.element_size() for g in host.sharded.groups)
    )
    out["params"] = dict(
        losses=a == b,
        weights=same(wa[0], wb[0]),
        state=same(wa[1], wb[1]),
        uploaded=host.sharded.uploaded,
        formula=formula,
        up_at_step=host.offload.moved["up"],
        resident=all(g.own is g.shard for g in shards),
    )
    # a bf16 model: the kernel writes the rounded bf16 weights in its own pass (into the staging
    # buffer that goes up; with the shards resident on the host, into the shard itself), where the
    # reference writes its masters back with a copy: round to nearest even both ways, so bitwise
    # again
    for stage, params in ((2, False), (3, True)):
        ref = build(grid, stage, cpu_adam.CPUAdamW, 0.0, torch.bfloat16)
        host = build(grid, stage, torch.optim.AdamW, 1.0, torch.bfloat16, params=params)
        a, b = train_steps(ref, grid), train_steps(host, grid)
        wa, wb = weights_and_state(ref), weights_and_state(host)
        out["bf16", stage] = dict(
            losses=a == b,
            weights=same(wa[0], wb[0]),
            state=same(wa[1], wb[1]),
            model=all(
                p.dtype == torch.bfloat16 and torch.equal(p, q)
                for p, q in zip(ref.module.parameters(), host.module.parameters())
            ),
            clipped=all(n > CLIP for _, n, _ in a),
        )
    return out


@pytest.fixture(scope="module")
def world():
    return worlds.launch(_world, 2, timeout=300)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_equals_the_engine_without_it_bitwise(world, stage, fraction):
    """Losses, grad norms, the model's parameters, the full fp32 masters and Adam's state after 4
    clipped steps."""
    for rank in world:
        r = rank[stage, fraction]
        assert r["clipped"] and r["on_host"]
        assert r["losses"] and r["weights"] and r["state"] and r["model"], r
        assert (r["share"] == 1.0) if fraction == 1.0 else (0.5 <= r["share"] < 1.0), r["share"]


def test_parameter_offload_equals_the_engine_without_it_and_uploads_each_gather(world):
    """ZeRO-3 with the parameter shards in host memory (offload_params): the same run bitwise (the
    shards only move), and the bytes copied up are this rank's shard at every gather: 2 gathers
    (forward, backward) per unit and micro-batch; the step itself uploads nothing (the update is
    written into the host shard)."""
    for rank in world:
        r = rank["params"]
        assert r["losses"] and r["weights"] and r["state"] and r["resident"], r
        assert r["uploaded"] == r["formula"] > 0 and r["up_at_step"] == 0, r


@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_offload_writes_the_weights_in_the_kernel_pass_bitwise(world, stage):
    """A bf16 model at ZeRO 2 (offload) and ZeRO 3 (offload + parameters): after 4 clipped steps the
    same losses, bf16 weights, fp32 masters and Adam state as the engine without offload (clip
    scaling and the bf16 write-back are inside cpu_adam's pass on the offloaded side, separate
    passes on the reference side)."""
    for rank in world:
        r = rank["bf16", stage]
        assert r["clipped"] and r["losses"] and r["weights"] and r["state"] and r["model"], r


def test_offload_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="--offload needs --zero 1, 2 or 3"):
        zero.ZeroEngine(
            GPT(GPTConfig(vocab_size=100, block_size=16, n_layer=1, n_head=2, n_embd=16)),
            torch.optim.AdamW,
            OPTIM,
            None,
            0,
            offload=1.0,
        )
    with pytest.raises(ValueError, match="the CPU step computes Adam/AdamW, not SGD"):
        zero.ZeroEngine(
            GPT(GPTConfig(vocab_size=100, block_size=16, n_layer=1, n_head=2, n_embd=16)),
            torch.optim.SGD,
            dict(lr=0.1),
            None,
            1,
            offload=1.0,
        )
    for stage, share in ((2, 1.0), (3, 0.5)):
        with pytest.raises(ValueError, match="--offload-params needs --zero 3 and --offload 1"):
            zero_rules.check_config(stage, torch.optim.AdamW, 1, share, offload_params=True)


def _train_runs(corpus, root):
    common = [
        "--n-layer",
        "2",
        "--n-head",
        "2",
        "--n-embd",
        "32",
        "--block-size",
        "32",
        "--batch-size",
        "2",
        "--max-steps",
        "4",
        "--warmup",
        "1",
        "--lr",
        "3e-3",
        "--eval-every",
        "0",
        "--peak-flops",
        "1e11",
        "--save-every",
        "2",
        "--corpus",
        str(corpus),
        "--data-cache",
        str(Path(root) / "cache"),
    ]
    train.main([*common, "--zero", "2", "--out-dir", str(Path(root) / "plain")])
    train.main([*common, "--zero", "2", "--offload", "1", "--out-dir", str(Path(root) / "offload")])
    train.main(
        [
            *common,
            "--zero",
            "3",
            "--offload",
            "1",
            "--offload-params",
            "--out-dir",
            str(Path(root) / "params"),
        ]
    )
    train.main(
        [
            *common,
            "--zero",
            "3",
            "--offload",
            "0.5",
            "--max-steps",
            "2",
            "--out-dir",
            str(Path(root) / "resumed"),
        ]
    )
    train.main(
        [
            *common,
            "--zero",
            "3",
            "--offload",
            "0.5",
            "--resume",
            "--out-dir",
            str(Path(root) / "resumed"),
        ]
    )
    return True


def test_train_with_offload_follows_the_same_curve_and_resumes(corpus, tmp_path):
    """train.py --offload (and --offload-params) at dp2: the loss curve of the run without it within
    the layout tolerance (the CPU kernel and torch.optim.AdamW order the same math differently); a
    checkpoint of an offloaded run resumes."""
    worlds.launch(_train_runs, 2, corpus, tmp_path, timeout=300)
    curve = lambda name: [
        json.loads(line)["loss"]
        for line in open(tmp_path / name / "metrics.jsonl")
        if "loss" in json.loads(line)
    ]
    rtol = layout_rtol(4, vocab=4096, width=128, depth=9)
    assert curve("offload") == pytest.approx(curve("plain"), rel=rtol)
    # --offload-params: ZeRO-3's shards too
    assert curve("params") == pytest.approx(curve("plain"), rel=rtol)
    assert (
        curve("resumed")[2:] == pytest.approx(curve("plain")[2:], rel=rtol)
        and len(curve("resumed")) == 4
    )


def test_parameter_uploads_go_on_a_side_stream_with_the_all_gather_behind_them(grid, monkeypatch):
    """Issue 42 M6: under parameter offload each gather's host-to-device copy went on the compute
    stream, so a prefetch's upload queued behind (and ahead of) the current unit's compute. Now the
    copy and the all-gather are issued inside `uploading` (on a GPU: a side stream that first waits
    for the compute stream); the compute stream waits only at the gather's work.wait(). CPU: the
    order of the calls, and a stubbed torch.cuda for the stream part (the values: the bitwise test
    above)."""
    from nanomega import zero3

    engine, events = build(grid, 3, cpu_adam.CPUAdamW, 1.0, params=True), []
    sharded, start = engine.sharded, engine.sharded.axis.start

    @contextlib.contextmanager
    def uploading(device):
        events.append("enter")
        yield
        events.append("exit")

    def started(op, *args):
        events.append(op)
        return start(op, *args)

    monkeypatch.setattr(sharded, "uploading", uploading)
    monkeypatch.setattr(sharded.axis, "start", started)
    x = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    engine.module(x, x).backward()
    gathers = [i for i, e in enumerate(events) if e == "all_gather"]
    assert gathers and all(events[i - 1] == "enter" and events[i + 1] == "exit" for i in gathers)

    # the stream part with torch.cuda stubbed: wait for the compute stream, then switch to the side
    calls = []

    class Stream:
        def __init__(self, device):
            calls.append(("new", device.type))

        def wait_stream(self, other):
            calls.append(("wait", other))

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: "compute")
    monkeypatch.setattr(
        torch.cuda,
        "stream",
        lambda s: calls.append(("current", type(s).__name__)) or contextlib.nullcontext(),
    )
    fresh = zero3.ShardedParameters.uploading
    for _ in range(2):
        with fresh(sharded, torch.device("cuda", 0)):
            calls.append("copy and all-gather")
    assert calls == [("new", "cuda")] + 2 * [
        ("wait", "compute"),
        ("current", "Stream"),
        "copy and all-gather",
    ]
