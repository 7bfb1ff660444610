"""Tensor and sequence parallelism (nanomega/tp.py, nanomega/rng.py) against dense PyTorch.

One spawned world of 4 CPU ranks (gloo) holds two grids, (dp 2, tp 2) and (dp 1, tp 4); every
distributed check runs in it once and returns numbers that the tests below assert on. All fp32.
Tolerance (derived in tests/tolerance.py's terms; never bitwise between sharded and dense: a slice
of a GEMM is not, on every BLAS kernel, bitwise the slice of the dense GEMM -- AVX2 and AVX-512
kernels block K differently): every compared number is the end of at most DEPTH = 8 reductions in
sequence (2 blocks x qkv, proj, fc, proj), each of at most N = 160 terms (the vocab-parallel softmax
at t = 4; the linears sum 16-128), which sharded and dense sum in two orders: 2 likely(N) relative
each, independent errors adding in quadrature over the chain: TOL = 2 likely(N) sqrt(DEPTH) =
3.4e-5, relative (max |a - b| / max |b|).
After AdamW steps: Adam's update g / sqrt(v) is scale-free, so a relative gradient difference passes
into the update unamplified while |g| >> eps (eps = 1e-6 here; the key bias, whose exact gradient is
0, is left out): TOL_STEPS = steps x TOL. Initial weights and slicing are compared bitwise (copies,
no arithmetic).
"""

import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nanomega import dist, recompute, tp, tp_loss, worlds
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT
from nanomega.rng import TrackedDropout, model_parallel_seed
from tolerance import likely

STEPS = 3
TOL = 2 * likely(160) * 8**0.5
TOL_STEPS = STEPS * TOL


def _err(a, b):
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _seq(x, axis, sp):
    """This rank's piece of a (b, s, ...) activation: the whole of it, or its 1/t of the sequence
    under SP."""
    return x.chunk(axis.size, 1)[axis.rank] if sp else x


def _layers(axis, sp):
    """Each parallel layer forward and backward against its dense PyTorch counterpart."""
    torch.manual_seed(0)
    r, t, b, s, h, V = axis.rank, axis.size, 2, 8, 16, 40 * axis.size
    out, piece = {}, lambda x: _seq(x, axis, sp)

    dense = nn.Linear(h, 24)
    x, gy = torch.randn(b, s, h, requires_grad=True), torch.randn(b, s, 24)
    dense(x).backward(gy)
    col = tp.ColumnParallelLinear(
        nn.Parameter(dense.weight.detach().chunk(t)[r].clone()),
        nn.Parameter(dense.bias.detach().chunk(t)[r].clone()),
        axis,
        sp,
    )
    xl = piece(x.detach()).requires_grad_()
    y = col(xl)
    y.backward(gy.chunk(t, -1)[r])
    out["column out"] = _err(y, dense(x).chunk(t, -1)[r])
    out["column dx"] = _err(xl.grad, piece(x.grad))
    out["column dw"] = _err(col.weight.grad, dense.weight.grad.chunk(t)[r])
    out["column db"] = _err(col.bias.grad, dense.bias.grad.chunk(t)[r])

    dense = nn.Linear(4 * h, h)
    x, gy = torch.randn(b, s, 4 * h, requires_grad=True), torch.randn(b, s, h)
    dense(x).backward(gy)
    row = tp.RowParallelLinear(
        nn.Parameter(dense.weight.detach().chunk(t, 1)[r].clone()),
        nn.Parameter(dense.bias.detach().clone()),
        axis,
        sp,
    )
    xl = x.detach().chunk(t, -1)[r].requires_grad_()
    y = row(xl)
    y.backward(piece(gy))
    out["row out"] = _err(y, piece(dense(x)))
    out["row dx"] = _err(xl.grad, x.grad.chunk(t, -1)[r])
    out["row dw"] = _err(row.weight.grad, dense.weight.grad.chunk(t, 1)[r])
    # under SP each rank's bias sees only its tokens; apply_tensor_parallel's hook sums them (tested
    # below)
    out["row db"] = _err(
        axis.all_reduce(row.bias.grad.clone()) if sp else row.bias.grad, dense.bias.grad
    )

    dense = nn.Embedding(V, h)
    idx, gy = torch.randint(V, (b, s)), torch.randn(b, s, h)
    dense(idx).backward(gy)
    emb = tp.VocabParallelEmbedding(
        nn.Parameter(dense.weight.detach().chunk(t)[r].clone()), axis, sp
    )
    y = emb(idx)
    y.backward(piece(gy))
    out["embedding out"] = _err(y, piece(dense(idx)))
    out["embedding dw"] = _err(emb.weight.grad, dense.weight.grad.chunk(t)[r])

    logits, targets = torch.randn(b, s, V, requires_grad=True) * 3, torch.randint(V, (b, s))
    targets[0, :3] = -1  # ignored
    targets[1, 0] = V - 1  # the last rank's last row
    for dtype in (torch.float32, torch.bfloat16):
        full = logits.detach().to(dtype).requires_grad_()
        ref = F.cross_entropy(full.float().flatten(0, 1), targets.flatten(), ignore_index=-1)
        ref.backward()
        mine = full.detach().chunk(t, -1)[r].clone().requires_grad_()
        loss = tp_loss.vocab_parallel_cross_entropy(mine, targets, axis)
        loss.backward()
        out[f"cross-entropy loss {dtype}"] = _err(loss, ref)
        out[f"cross-entropy dlogits {dtype}"] = _err(mine.grad, full.grad.chunk(t, -1)[r])
        assert mine.grad.dtype == dtype
    return out


def _config(t, **kw):
    return GPTConfig(
        vocab_size=200,
        block_size=16,
        n_layer=2,
        n_head=4,
        n_embd=32,
        make_vocab_size_divisible_by=128 * t,
        **kw,
    )


def _bytes_per_layer(grid, sp):
    """Bytes each tp collective moved in one layer's forward and backward."""
    axis, (b, s, h) = grid.tp, (2, 16, 32)
    torch.manual_seed(0)
    block = tp.apply_tensor_parallel(GPT(_config(axis.size)), axis, sp).blocks["0"]
    x = _seq(torch.randn(b, s, h), axis, sp).requires_grad_()
    grid.log.reset()
    y = block(x)
    fwd = {op: grid.log.bytes(op, "tp") for op in ("all_reduce", "all_gather", "reduce_scatter")}
    y.backward(torch.randn_like(y))
    both = {op: grid.log.bytes(op, "tp") for op in fwd}
    return fwd, both, b * s * h * 4


def _gpt_vs_dense(grid, sp, steps=STEPS, freeze=None, **kw):
    """The TP GPT and the dense GPT from one seed: loss, every gradient and every AdamW update,
    sliced."""
    axis = grid.tp
    cfg = _config(axis.size, **kw)
    torch.manual_seed(1)
    dense = GPT(cfg)
    torch.manual_seed(1)
    par = tp.apply_tensor_parallel(GPT(cfg), axis, sp)
    for model in (dense, par):
        if freeze:
            model.get_parameter(freeze).requires_grad_(False)
    mine = dict(par.named_parameters())
    assert mine.keys() == dict(dense.named_parameters()).keys()
    sliced = lambda name, full: tp.shard_param(name, full, axis.rank, axis.size)
    err = dict(
        init=max(_err(mine[n], sliced(n, p)) for n, p in dense.named_parameters()),
        loss=0.0,
        grad0=0.0,
        grad=0.0,
        weight=0.0,
        missing=0,
    )
    opts = [
        torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6) for m in (dense, par)
    ]
    gen = torch.Generator().manual_seed(2)
    for step in range(steps):
        idx, targets = torch.randint(cfg.vocab_size, (2, cfg.block_size), generator=gen).unbind(0)
        idx, targets = idx.view(1, -1).repeat(2, 1), targets.view(1, -1).repeat(2, 1).roll(3, 1)
        targets[0, :5] = -1  # ignore_index
        losses = [m(idx, targets) for m in (dense, par)]
        for loss in losses:
            loss.backward()
        err["loss"] = max(err["loss"], _err(losses[1], losses[0]))
        for n, p in dense.named_parameters():
            if p.grad is None or mine[n].grad is None:
                err["missing"] += (p.grad is None) != (mine[n].grad is None)
                continue
            key = "grad" if step else "grad0"
            err[key] = max(err[key], _err(mine[n].grad, sliced(n, p.grad)))
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for n, p in dense.named_parameters():
            a, b = mine[n], sliced(n, p)
            # keep q and v: the key bias's exact gradient is 0 (softmax ignores a
            if n.endswith("c_attn.bias"):
                # per-row shift), so Adam steps on noise
                a, b = a.view(3, -1)[0::2], b.view(3, -1)[0::2]
            err["weight"] = max(err["weight"], _err(a, b))
    return err


def _dropout(grid, sp):
    """Dropout under TP: reproducible, replicas identical, shard masks independent,
    recompute-safe."""
    axis = grid.tp
    cfg = _config(axis.size, dropout=0.1)

    def run(mode="none"):
        torch.manual_seed(1)
        model = GPT(cfg)
        rng = model_parallel_seed(7, grid)
        tp.apply_tensor_parallel(model, axis, sp, rng=rng)
        recompute.apply_recompute(model, mode)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen, losses, grads = torch.Generator().manual_seed(3), [], []
        for _ in range(2):
            idx = torch.randint(cfg.vocab_size, (2, cfg.block_size), generator=gen)
            loss = model(idx, idx.roll(1, 1))
            loss.backward()
            losses.append(loss.detach())
            grads += [p.grad.clone() for p in model.parameters()]
            opt.step()
            opt.zero_grad()
        return torch.stack(losses), grads, model

    (l1, g1, model), (l2, g2, _), (l3, g3, _) = run(), run(), run("full")
    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(a, b))
    # replicated parameters must stay equal across the tp group
    spread, ops = 0.0, torch.distributed.ReduceOp
    for p in model.parameters():
        if not getattr(p, "tensor_parallel", False):
            hi, lo = (axis.all_reduce(p.detach().clone(), op=op) for op in (ops.MAX, ops.MIN))
            spread = max(spread, (hi - lo).abs().max().item())
    rng = model_parallel_seed(7, grid)
    ones = torch.ones(4096)
    with rng.fork():
        sharded = F.dropout(ones, 0.5)
    shared = F.dropout(ones, 0.5)
    masks = [torch.empty(axis.size * 4096) for _ in range(2)]
    axis.all_gather(masks[0], sharded)
    axis.all_gather(masks[1], shared)
    sharded_equal = [torch.equal(m, masks[0][:4096]) for m in masks[0].view(axis.size, -1)]
    shared_equal = [torch.equal(m, masks[1][:4096]) for m in masks[1].view(axis.size, -1)]
    module = TrackedDropout(0.5, rng).train()
    return dict(
        rerun=same([l1, *g1], [l2, *g2]),
        recompute=same([l1, *g1], [l3, *g3]),
        spread=spread,
        loss_finite=bool(torch.isfinite(l1).all()),
        sharded_equal=sharded_equal,
        shared_equal=shared_equal,
        kept=(sharded != 0).float().mean().item(),
        module_kept=(module(ones) != 0).float().mean().item(),
    )


def _world():
    g2, g4 = dist.Grid(2, 1, 2), dist.Grid(1, 1, 4)
    res = {"rank": g2.rank}
    for grid in (g2, g4):
        for sp in (False, True):
            key = (grid.tp.size, sp)
            res[("layers",) + key] = _layers(grid.tp, sp)
            res[("bytes",) + key] = _bytes_per_layer(grid, sp)
    # the two dp replicas of the tp=2 grid run different cases side by side
    sp = g2.dp_rank == 1
    res[("gpt", 2, sp, "learned")] = _gpt_vs_dense(g2, sp)
    res[("gpt", 2, sp, "alibi")] = _gpt_vs_dense(
        g2, sp, alibi=True, embed_layernorm=True, freeze="blocks.1.ln_2.weight"
    )
    res[("gpt", 4, True, "learned")] = _gpt_vs_dense(g4, True, steps=2)
    res[("dropout", sp)] = _dropout(g2, sp)
    return res


@pytest.fixture(scope="module")
def world():
    return worlds.launch(_world, 4, timeout=240)


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_layers_match_dense(world, t, sp):
    for res in world:
        errs = res[("layers", t, sp)]
        bad = {k: v for k, v in errs.items() if v > TOL}
        assert not bad, f"rank {res['rank']}: {bad}"


@pytest.mark.parametrize("t", [2, 4])
def test_bytes_per_layer_equal_the_formula(world, t):
    h = 32
    for res in world:
        fwd, both, B = res[("bytes", t, False)]
        # g after attention and MLP
        assert fwd == dict(all_reduce=2 * B, all_gather=0, reduce_scatter=0)
        # + f before them, backward
        assert both == dict(all_reduce=4 * B, all_gather=0, reduce_scatter=0)
        fwd, both, B = res[("bytes", t, True)]
        # same bytes as 2 all-reduces
        assert fwd == dict(all_reduce=0, all_gather=2 * B, reduce_scatter=2 * B)
        # backward: the conjugates (2 RS + 2 AG), 2 re-gathers of the stored shards for the weight
        # gradients, and the gradient all-reduce of the replicated parameters (2 LayerNorms, 2 row
        # biases = 6h floats)
        assert both == dict(all_reduce=6 * h * 4, all_gather=6 * B, reduce_scatter=4 * B)


@pytest.mark.parametrize(
    "case",
    [
        (2, False, "learned"),
        (2, True, "learned"),
        (2, False, "alibi"),
        (2, True, "alibi"),
        (4, True, "learned"),
    ],
    ids=str,
)
def test_gpt_matches_dense_after_adamw_steps(world, case):
    for res in world:
        key = ("gpt",) + case
        if key not in res:  # each dp replica of the tp=2 grid ran one sequence-parallel setting
            continue
        err = res[key]
        assert err["init"] == 0.0 and err["missing"] == 0, err
        assert err["loss"] < TOL and err["grad0"] < TOL, err
        assert err["grad"] < TOL_STEPS and err["weight"] < TOL_STEPS, err
    assert sum(("gpt",) + case in res for res in world) >= 2


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_dropout_reproducible_and_statistically_right(world, sp):
    results = [res[("dropout", sp)] for res in world if ("dropout", sp) in res]
    assert len(results) == 2
    for d in results:
        assert d["rerun"] and d["recompute"] and d["loss_finite"], d
        assert d["spread"] == 0.0  # replicated weights stay bitwise equal on the tp group
        assert d["sharded_equal"] == [True, False] and d["shared_equal"] == [True, True]
        assert abs(d["kept"] - 0.5) < 0.05 and abs(d["module_kept"] - 0.5) < 0.05


def test_shard_unshard_round_trip_every_parameter():
    cfg = GPTConfig(
        vocab_size=100,
        block_size=8,
        n_layer=2,
        n_head=4,
        n_embd=16,
        embed_layernorm=True,
        make_vocab_size_divisible_by=512,
    )
    for name, p in GPT(cfg).named_parameters():
        for t in (1, 2, 4):
            shards = [tp.shard_param(name, p, r, t) for r in range(t)]
            assert torch.equal(tp.unshard_param(name, shards), p), name
    llama = GPTConfig(
        vocab_size=100,
        block_size=8,
        n_layer=1,
        n_head=4,
        n_kv_head=2,
        n_embd=16,
        arch="llama",
        ffn_hidden=24,
        tie_embeddings=False,
        make_vocab_size_divisible_by=512,
    )
    for name, p in GPT(llama).named_parameters():
        for t in (1, 2, 4):
            kv = tp.kv_replicated(llama, t)  # tp 4 > 2 key/value heads: kv_proj held whole
            shards = [tp.shard_param(name, p, r, t, kv) for r in range(t)]
            assert torch.equal(tp.unshard_param(name, shards, kv), p), name
            if name.endswith("kv_proj.weight"):
                assert shards[0].shape[0] == (16 if kv else 16 // t), (t, shards[0].shape)
    # (2, n_kv=2, head_dim=4): rank 1 of 2 gets k and v of key/value head 1
    kv = torch.arange(2 * 2 * 4.0)
    assert tp.shard_param("blocks.0.attn.kv_proj.weight", kv, 1, 2).tolist() == list(
        range(4, 8)
    ) + list(range(12, 16))
    # (3, n_head=4, head_dim=4): rank 1 of 2 gets heads 2, 3 of q, k and v
    qkv = torch.arange(3 * 16.0)
    assert tp.shard_param("blocks.0.attn.c_attn.bias", qkv, 1, 2).tolist() == list(
        range(8, 16)
    ) + list(range(24, 32)) + list(range(40, 48))


def test_bad_shapes_give_one_clear_line():
    fake = lambda t: types.SimpleNamespace(size=t, rank=0)  # errors come before any collective
    with pytest.raises(
        ValueError, match=r"^--tp 3 does not divide --n-head 4; choose --tp among 1, 2, 4$"
    ):
        tp.apply_tensor_parallel(GPT(GPTConfig(n_head=4, n_embd=32)), fake(3))
    with pytest.raises(
        ValueError, match=r"padded vocab size 256 is not divisible by --tp 3; .*128 \* tp"
    ):
        tp.apply_tensor_parallel(GPT(GPTConfig(vocab_size=200, n_head=6, n_embd=48)), fake(3))
    with pytest.raises(
        ValueError, match=r"--sequence-parallel needs --block-size 10 divisible by --tp 4"
    ):
        tp.apply_tensor_parallel(
            GPT(GPTConfig(block_size=10, make_vocab_size_divisible_by=512)), fake(4), True
        )
    with pytest.raises(ValueError, match=r"dropout > 0 under tensor parallelism needs rng="):
        tp.apply_tensor_parallel(
            GPT(GPTConfig(dropout=0.1, make_vocab_size_divisible_by=256)), fake(2)
        )
    with pytest.raises(ValueError, match=r"sequence length 6 divisible by --tp 4"):
        tp._reduce_scatter_seq(torch.zeros(1, 6, 2), fake(4))
    llama = dict(arch="llama", n_head=6, n_embd=48, make_vocab_size_divisible_by=512)
    with pytest.raises(ValueError, match=r"^--tp 2 and --n-kv-head 3: one must divide the other"):
        tp.apply_tensor_parallel(GPT(GPTConfig(n_kv_head=3, **llama)), fake(2))
    with pytest.raises(ValueError, match=r"^--tp 4 does not divide --n-head 6"):
        tp.apply_tensor_parallel(GPT(GPTConfig(n_kv_head=2, **llama)), fake(4))
    with pytest.raises(
        ValueError, match=r"^--tp 3 does not divide --ffn-hidden 100; choose --tp among 1, 2$"
    ):
        tp.apply_tensor_parallel(GPT(GPTConfig(n_kv_head=3, ffn_hidden=100, **llama)), fake(3))
