"""Checkpoints on the device path (nanomega/checkpoint.py, reshard.py, zero.py, rng.py, dist.py),
checked on CPU.

- import_by_name puts every optimizer state tensor on its parameter's device, at every ZeRO stage:
  the engine is built on the `meta` device while the state comes from a CPU checkpoint (stage 0 used
  to keep it on the CPU).
- A rank reads only the shards it needs (the manifest's piece index), always to the CPU first.
- The CUDA generator is restored on resume; init_process_group gets device_id; LOCAL_RANK beyond the
  GPUs is one clear line.
"""

import json
import os

import pytest
import torch

from nanomega import checkpoint, dist, reshard, rng, worlds, zero
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT

pytestmark = pytest.mark.usefixtures("one_thread")
CFG = dict(vocab_size=128, block_size=16, n_layer=1, n_head=2, n_embd=16)


def trained_engine(grid, stage, seed=0):
    torch.manual_seed(0)  # the same init on every rank; `seed` picks the batch
    model = GPT(GPTConfig(**CFG))
    engine = zero.ZeroEngine(model, torch.optim.AdamW, dict(lr=1e-3), grid, stage)
    x = torch.randint(
        0, CFG["vocab_size"], (2, CFG["block_size"]), generator=torch.Generator().manual_seed(seed)
    )
    model(x, x).backward()
    engine.step()
    return engine


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_loaded_optimizer_state_lives_on_the_parameters_device(grid, stage):
    source = trained_engine(grid, 0)
    params, optim = reshard.full_state(source)  # CPU tensors, as read from disk
    with torch.device("meta"):  # a second device type: any tensor left on the CPU is caught
        model = GPT(GPTConfig(**CFG))
    engine = zero.ZeroEngine(model, torch.optim.AdamW, dict(lr=1e-3), grid, stage)
    reshard.import_by_name(engine, params, optim)
    placed = {
        (k, v.device.type)
        for s in engine.optimizer.state.values()
        for k, v in s.items()
        if v.dim() > 0
    }
    assert placed and {d for _, d in placed} == {"meta"}, placed


class OnGpu(torch.Tensor):
    """A CPU tensor that says it lives on cuda:0 (no GPU here); what torch computes from it is a
    plain tensor."""

    device = property(lambda self: torch.device("cuda", 0))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def test_full_state_gathers_only_cpu_tensors(grid, monkeypatch):
    """all_gather_object pickles: a CUDA tensor would be unpickled onto the sender's GPU on every
    rank. The engine's tensors are made to claim cuda:0 (export_by_name wrapped); what reaches the
    gather must be CPU."""
    engine, real = trained_engine(grid, 1), reshard.export_by_name

    def on_gpu(*args, **kwargs):
        claim = lambda v: v.as_subclass(OnGpu) if torch.is_tensor(v) else v  # noqa: E731
        return [
            dict(p, master=claim(p["master"]), state={k: claim(v) for k, v in p["state"].items()})
            for p in real(*args, **kwargs)
        ]

    monkeypatch.setattr(reshard, "export_by_name", on_gpu)
    gathered = []
    monkeypatch.setattr(engine.axis, "all_gather_object", lambda obj: gathered.append(obj) or [obj])
    params, optim = reshard.full_state(engine)
    tensors = [
        t for p in gathered[0] for t in [p["master"], *p["state"].values()] if torch.is_tensor(t)
    ]
    assert tensors and {(type(t), t.device.type) for t in tensors} == {(torch.Tensor, "cpu")}
    monkeypatch.undo()
    expect = reshard.full_state(engine)
    assert (
        all(torch.equal(params[k], v) for k, v in expect[0].items())
        and optim.keys() == expect[1].keys()
    )


@pytest.mark.parametrize("stage", [1, 3])
def test_a_synchronous_save_copies_masters_and_moments_straight_to_the_host(grid, stage):
    """Issue 42 M3: the synchronous save's export (reshard.pieces, copy=True) must not clone each
    fp32 master and Adam moment on its device first (+12 bytes per parameter on the GPU while the
    save lasts): every one leaves by a single copy to the CPU. Seen on any device through the ops
    dispatched: no clone of a whole tensor, one _to_copy to the CPU per master and moment."""
    from torch.utils._python_dispatch import TorchDispatchMode

    engine, ops = trained_engine(grid, stage), []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            ops.append((func, args[0].numel() if torch.is_tensor(args[0]) else 0, kwargs))
            return func(*args, **kwargs)

    with Record():
        pieces = reshard.pieces(engine, grid)["pieces"]
    clones = [n for f, n, _ in ops if f is torch.ops.aten.clone.default and n > 1]
    to_host = [k for f, _, k in ops if f is torch.ops.aten._to_copy.default]
    assert clones == []
    assert len(to_host) == 3 * len(pieces)  # master, exp_avg, exp_avg_sq
    assert all(k.get("device") == torch.device("cpu") for k in to_host)
    assert all(p["master"].device.type == "cpu" for p in pieces)


def _save_and_reload(tmp):
    """In a world of 2: save under (dp 2, ZeRO stage s), load under other stages; report the shards
    read."""
    grid = dist.Grid(2, 1, 1)
    out = {}
    for saved, loaded in ((1, 1), (1, 0), (0, 2), (1, 2), (1, 3)):
        folder = os.path.join(tmp, f"s{saved}")
        engine = trained_engine(grid, saved, seed=grid.rank)  # ranks see different batches
        if loaded == 1 or saved == 0:  # save once per saved stage
            state = dict(universal=reshard.pieces(engine, grid), step=1)
            checkpoint.save(folder, 1, GPTConfig(**CFG), state, grid, dict(zero=saved, dp=2))
        reference = reshard.full_state(engine)[0]
        torch.manual_seed(123)
        target = zero.ZeroEngine(
            GPT(GPTConfig(**CFG)), torch.optim.AdamW, dict(lr=1e-3), grid, loaded
        )
        got = reshard.load(
            checkpoint.latest(folder), GPTConfig(**CFG), target, grid, dict(zero=loaded, dp=2)
        )
        weights = reshard.full_state(target)[0]
        out[(saved, loaded)] = (
            got["shards_read"],
            got["same_layout"],
            all(torch.equal(weights[k], reference[k]) for k in reference),
        )
    return out


def test_each_rank_reads_only_the_shards_it_needs(tmp_path):
    results = worlds.launch(_save_and_reload, 2, str(tmp_path))
    both = ["rank_00000.pt", "rank_00001.pt"]
    for rank, res in enumerate(results):
        assert all(equal for _, _, equal in res.values()), res  # and every load is exact
        assert res[(1, 1)][:2] == ([f"rank_{rank:05d}.pt"], True)  # same layout: its own shard only
        assert res[(1, 0)][0] == both  # stage 0 holds whole parameters: every piece it needs
        # stage-0 replicas saved nothing: dp rank 0's shard
        assert res[(0, 2)][0] == ["rank_00000.pt"]
        # ZeRO-2 cuts the same flat slices: its own shard
        assert res[(1, 2)][0] == [f"rank_{rank:05d}.pt"]
    manifest = json.load(open(tmp_path / "s1" / "ckpt" / "step_000001" / "manifest.json"))
    assert set(manifest["pieces"]) == set(both) and all(manifest["pieces"].values())


def test_shards_are_read_to_the_cpu_first(grid, tmp_path, monkeypatch):
    engine = trained_engine(grid, 0)
    checkpoint.save(
        str(tmp_path), 1, GPTConfig(**CFG), dict(universal=reshard.pieces(engine, grid)), grid
    )
    seen = []
    real = torch.load
    monkeypatch.setattr(
        torch, "load", lambda *a, **kw: seen.append(kw.get("map_location")) or real(*a, **kw)
    )
    reshard.load(checkpoint.latest(str(tmp_path)), GPTConfig(**CFG), engine, grid, {})
    reshard.full_weights(checkpoint.latest(str(tmp_path)))
    assert seen and set(seen) == {"cpu"}


def test_resume_restores_the_cuda_generator(monkeypatch):
    """The CUDA path of rng.restore_state, on CPU: the saved device state is set back on this rank's
    device."""
    calls = []
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda state, device: calls.append((state, device))
    )
    cuda0 = torch.device("cuda", 0)
    saved = dict(rng=torch.get_rng_state(), cuda_rng=torch.arange(4, dtype=torch.uint8))
    rng.restore_state(saved, cuda0)
    assert len(calls) == 1 and torch.equal(calls[0][0], saved["cuda_rng"]) and calls[0][1] == cuda0
    rng.restore_state(
        dict(saved, cuda_rng=[torch.zeros(1), saved["cuda_rng"]]), torch.device("cuda", 1)
    )
    # an older checkpoint's list of every GPU's state
    assert torch.equal(calls[1][0], saved["cuda_rng"])
    rng.restore_state(saved, torch.device("cpu"))
    assert len(calls) == 2


def test_init_binds_the_device_and_checks_local_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    captured = {}
    monkeypatch.setattr(
        torch.distributed, "init_process_group", lambda *a, **kw: captured.update(kw)
    )
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert dist.init("auto") == torch.device("cuda", 1)
    assert captured["device_id"] == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ValueError, match="LOCAL_RANK 2 but this node sees 2 CUDA device"):
        dist.init("auto")
