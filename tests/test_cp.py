"""Context parallelism (nanomega/cp.py) against full attention and the single-process model.

One spawned world of 4 CPU ranks (gloo) holds the grids (cp 4), (dp 2, cp 2) and (cp 2, tp 2); every
check runs in it once and returns numbers the tests below assert on. All fp32.
Tolerance of the attention operation (tests/tolerance.py's terms): an output element is the end of a
chain of reductions -- q.k over hd terms, the softmax denominator and p.v over at most s terms, and
the online softmax's merges (at most 2 cp per query chunk, each a few roundings) -- which cp and the
dense kernel sum in two orders: 2 likely(s) relative per link, independent links adding in
quadrature: OUT = 2 likely(S) sqrt(3 + 2 cp). A score's absolute error (likely(hd) |q||k|/sqrt(hd))
is a relative error of exp(score): the bound is scaled by max(1, max |score|). Gradients chain the
same reductions twice more (dp = dout v^T, ds, ds k; s terms each):
GRAD = 2 likely(S) sqrt(6 + 2 cp), relative to the largest gradient element.
End to end: losses, gradients and (after AdamW) the weight matrices within tests/tolerance.py's
layout_rtol. A zero-initialized bias is left out of the weights: Adam moves each element by ~lr
g/|g|, and an element whose gradient is a cancelling sum (over cp ranks or over the batch) has no
relative bound of its own (test_tp's key bias).
"""

import gzip
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nanomega import checkpoint, cp, dist, documents, formulas, reshard, tp, train, worlds
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT
from tolerance import layout_rtol, likely

# the attention operation's shapes: grouped-query, 2 query heads per key head
B, H, KV, S, HD = 2, 4, 2, 32, 8
STEPS = 3
CORPUS_CHARS = 100_000  # of the embedded corpus, for conftest's `corpus`
COMMON = [
    "--n-layer",
    "2",
    "--n-head",
    "4",
    "--n-embd",
    "32",
    "--block-size",
    "32",
    "--dropout",
    "0",
    "--batch-size",
    "2",
    "--max-steps",
    "4",
    "--warmup",
    "1",
    "--lr",
    "3e-3",
    "--eval-every",
    "4",
    "--eval-iters",
    "1",
    "--log-every",
    "100",
    "--peak-flops",
    "1e11",
    "--save-every",
    "0",
]
TRAIN = {
    "cp2 x tp2, zero 1, selective recompute": [
        "--cp",
        "2",
        "--tp",
        "2",
        "--zero",
        "1",
        "--recompute",
        "selective",
    ],
    "cp2 x dp2 allgather, zero 2": ["--cp", "2", "--cp-method", "allgather", "--zero", "2"],
    "cp4 ring": ["--cp", "4"],
    # each with --global-batch 4
    "cp2 x pp2 ulysses": ["--cp", "2", "--pp", "2", "--cp-method", "ulysses"],
}
DOCS = {
    "cp2 x pp2 ulysses, documents": [
        "--cp",
        "2",
        "--pp",
        "2",
        "--cp-method",
        "ulysses",
        "--document-mask",
    ],
    "cp2 x tp2 ring, full recompute, documents": [
        "--cp",
        "2",
        "--tp",
        "2",
        "--recompute",
        "full",
        "--document-mask",
    ],
}  # on docs_corpus


def _err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _full(q, k, v, docs=None):
    """The reference: one process, the whole sequence (F.scaled_dot_product_attention), or per
    document."""
    if docs is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out = torch.empty_like(q)
    for i in range(q.shape[0]):  # each document of each sequence attended alone
        for d in docs[i].unique():
            at = (docs[i] == d).nonzero().flatten()
            out[i : i + 1, :, at] = F.scaled_dot_product_attention(
                q[i : i + 1, :, at],
                k[i : i + 1, :, at],
                v[i : i + 1, :, at],
                is_causal=True,
                enable_gqa=True,
            )
    return out


def _op(grid, axis, method, docs=False):
    """cp attention of this rank's tokens vs full attention of the whole sequence: errors, bytes,
    work."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, S, HD, generator=gen, requires_grad=True) for n in (H, KV, KV))
    dout = torch.randn(B, H, S, HD, generator=gen)
    # 3 packed documents
    ids = torch.randint(0, 3, (B, S), generator=gen).sort(1).values if docs else None
    ref = _full(q, k, v, ids)
    ref.backward(dout)
    mine = [cp.local(t.detach(), axis.size, axis.rank, dim=2).requires_grad_() for t in (q, k, v)]
    grid.log.reset()
    cp.WORK.update(pairs=0.0, flops=0)
    out = cp.attention(*mine, axis, method, docs=ids)
    fwd, pairs = grid.log.wire_bytes("cp"), cp.WORK["pairs"]
    out.backward(cp.local(dout, axis.size, axis.rank, dim=2))
    scores = (q @ k.repeat_interleave(H // KV, 1).transpose(-2, -1)).abs().max().item() / HD**0.5
    local = lambda t: cp.local(t, axis.size, axis.rank, dim=2)
    return dict(
        out=_err(out, local(ref)),
        dq=_err(mine[0].grad, local(q.grad)),
        dk=_err(mine[1].grad, local(k.grad)),
        dv=_err(mine[2].grad, local(v.grad)),
        fwd=fwd,
        bwd=grid.log.wire_bytes("cp") - fwd,
        pairs=pairs,
        scores=scores,
    )


def _bf16_bytes(grid, axis, method):
    """Bytes this rank sends in one bf16 attention, forward and backward, and the dtypes of out, dq
    and dk."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(B, n, S // axis.size, HD, generator=gen).bfloat16().requires_grad_()
        for n in (H, KV, KV)
    )
    grid.log.reset()
    out = cp.attention(q, k, v, axis, method)
    fwd = grid.log.wire_bytes("cp")
    out.backward(torch.randn(out.shape, generator=gen).bfloat16())
    return dict(
        fwd=fwd, bwd=grid.log.wire_bytes("cp") - fwd, dtypes={out.dtype, q.grad.dtype, k.grad.dtype}
    )


def _config(**kw):
    return GPTConfig(vocab_size=200, block_size=16, n_layer=2, n_head=4, n_embd=32, **kw)


def _gpt_vs_dense(grid, method="ring", docs=False, **kw):
    """The cp (x tp) GPT and the dense GPT from one seed, over STEPS AdamW steps: losses (the token
    mean over the whole sequences: the cp ranks' means averaged) and every weight, sliced by tp.
    docs: token 0 ends a document (~1 token in 6), both models take the windows' document ids
    (documents.ids)."""
    cfg = _config(make_vocab_size_divisible_by=128 * grid.tp.size, **kw)
    torch.manual_seed(1)
    dense = GPT(cfg)
    torch.manual_seed(1)
    par = GPT(cfg)
    if grid.tp.size > 1:
        tp.apply_tensor_parallel(par, grid.tp)
    cp.apply_context_parallel(par, grid.cp, method)
    opts = [
        torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6) for m in (dense, par)
    ]
    gen, err = torch.Generator().manual_seed(2), dict(loss=0.0, grad=0.0, weight=0.0)
    for _ in range(STEPS):
        idx = torch.randint(cfg.vocab_size, (2, cfg.block_size + 1), generator=gen)
        if docs:
            idx[torch.rand(idx.shape, generator=gen) < 1 / 6] = 0
        x, y = idx[:, :-1], idx[:, 1:]
        ids = documents.ids(x, 0) if docs else None
        ref = dense(x, y, ids)
        ref.backward()
        loss = par(
            cp.local(x, grid.cp.size, grid.cp.rank), cp.local(y, grid.cp.size, grid.cp.rank), ids
        )
        loss.backward()
        for p in par.parameters():  # what zero.py does over dp_cp: the cp ranks' gradients averaged
            grid.cp.all_reduce(p.grad).div_(grid.cp.size)
        mean = grid.cp.all_reduce(loss.detach().clone()) / grid.cp.size
        err["loss"] = max(err["loss"], _err(mean, ref))
        mine = dict(par.named_parameters())
        for n, p in dense.named_parameters():
            err["grad"] = max(
                err["grad"],
                _err(mine[n].grad, tp.shard_param(n, p.grad, grid.tp.rank, grid.tp.size)),
            )
        for opt in opts:
            opt.step()
            opt.zero_grad()
        # the matrices: a zero-initialized bias moved by Adam's lr g/|g|
        for n, p in dense.named_parameters():
            # on elements whose gradient is a cancelling sum is relative to lr, not to itself
            if p.dim() == 2:
                err["weight"] = max(
                    err["weight"], _err(mine[n], tp.shard_param(n, p, grid.tp.rank, grid.tp.size))
                )
    return err


def _world():
    g4, g2, g22 = dist.Grid(cp=4), dist.Grid(dp=2, cp=2), dist.Grid(cp=2, tp=2)
    res = {"rank": g4.rank}
    for method in ("ring", "allgather"):
        res[("op", 4, method)] = _op(g4, g4.cp, method)
        res[("docs", 4, method)] = _op(g4, g4.cp, method, docs=True)
        res[("bf16", 4, method)] = _bf16_bytes(g4, g4.cp, method)
    for method in cp.METHODS:
        res[("op", 2, method)] = _op(g2, g2.cp, method)
        res[("docs", 2, method)] = _op(g2, g2.cp, method, docs=True)
        res[("bf16", 2, method)] = _bf16_bytes(g2, g2.cp, method)
    # the two dp replicas run different cases side by side
    method = "ring" if g2.dp_rank == 0 else "ulysses"
    res[("gpt", 2, method)] = _gpt_vs_dense(g2, method)
    res[("gpt", 2, "allgather", "llama")] = _gpt_vs_dense(
        g2, "allgather", arch="llama", n_kv_head=2, ffn_hidden=64
    )
    res[("gpt", "2x2")] = _gpt_vs_dense(g22, "ring")
    # ring (dp 0) and ulysses (dp 1)
    res[("gpt-docs", 2, method)] = _gpt_vs_dense(g2, method, docs=True)
    res[("gpt-docs", 2, "allgather", "llama")] = _gpt_vs_dense(
        g2, "allgather", docs=True, arch="llama", n_kv_head=2, ffn_hidden=64
    )
    return res


@pytest.fixture(scope="module")
def world():
    return worlds.launch(_world, 4, timeout=240)


def _bound(n, res, grad=False):
    return 2 * likely(S) * (3 + 2 * n + 3 * grad) ** 0.5 * max(1.0, res["scores"])


@pytest.mark.parametrize(
    "case", [(4, "ring"), (4, "allgather"), (2, "ring"), (2, "allgather"), (2, "ulysses")], ids=str
)
@pytest.mark.parametrize("kind", ["op", "docs"])
def test_attention_equals_full_attention(world, case, kind):
    n, method = case
    key = (kind,) + case
    results = [res[key] for res in world if key in res]
    assert results
    for res in results:
        assert res["out"] < _bound(n, res), res
        assert max(res["dq"], res["dk"], res["dv"]) < _bound(n, res, grad=True), res


@pytest.mark.parametrize(
    "case", [(4, "ring"), (4, "allgather"), (2, "ring"), (2, "allgather"), (2, "ulysses")], ids=str
)
@pytest.mark.parametrize("kind,dtype_bytes", [("op", 4), ("bf16", 2)])
def test_bytes_equal_the_formula(world, case, kind, dtype_bytes):
    """fp32, and bf16: K, V (q, out for Ulysses) travel in bf16, dK/dV (ring, allgather) in fp32
    (grad_bytes 4)."""
    n, method = case
    assert sum((kind,) + case in res for res in world) == 4  # every rank of the world ran it
    for res in world:
        if (kind,) + case not in res:
            continue
        got = res[(kind,) + case]
        assert (got["fwd"], got["bwd"]) == formulas.cp_comm_bytes_per_layer(
            method, n, B, S, HD, H, KV, dtype_bytes, 4
        )
        assert kind == "op" or got["dtypes"] == {torch.bfloat16}, got


@pytest.mark.parametrize("n", [2, 4])
def test_work_per_rank_is_balanced(world, n):
    done = {res[("op", n, "ring")]["pairs"] for res in world}
    assert done == set(cp.pairs_per_rank(n)) == {2.0 * n}  # every rank the same: 2 cp chunk pairs
    # rank c: c + 1/2 pairs of s/cp chunks (4x bigger)
    contiguous = cp.pairs_per_rank(n, balanced=False)
    assert max(contiguous) - min(contiguous) == n - 1


@pytest.mark.parametrize(
    "key",
    [
        ("gpt", 2, "ring"),
        ("gpt", 2, "ulysses"),
        ("gpt", 2, "allgather", "llama"),
        ("gpt", "2x2"),
        ("gpt-docs", 2, "ring"),
        ("gpt-docs", 2, "ulysses"),
        ("gpt-docs", 2, "allgather", "llama"),
    ],
    ids=str,
)
def test_gpt_equals_dense_over_steps(world, key):
    tol = layout_rtol(STEPS, 200, 128, 2)
    assert sum(key in res for res in world) >= 2
    for res in world:
        if key in res:
            assert max(res[key].values()) < tol, res[key]


def test_bad_layouts_give_one_clear_line():
    with pytest.raises(ValueError, match=r"^--cp 4 needs --block-size 12 divisible by 2 x cp = 8"):
        cp.check(_config().__class__(block_size=12), 4, "ring")
    with pytest.raises(
        ValueError, match=r"^--cp-method ulysses needs --cp 8 to divide the heads per tp rank"
    ):
        cp.check(_config(), 8, "ulysses")
    with pytest.raises(
        ValueError, match=r"^--cp-method 'tree' is not one of ring, allgather, ulysses"
    ):
        cp.check(_config(), 2, "tree")
    with pytest.raises(ValueError, match=r"^--cp with --alibi or --dropout > 0"):
        cp.check(_config(dropout=0.1), 2, "ring")


def _run(corpus, out, *extra):
    """train.main's per-step losses (and last validation loss) from metrics.jsonl."""
    train.main(
        [
            *COMMON,
            "--corpus",
            str(corpus),
            "--data-cache",
            str(Path(out).parent / "cache"),
            "--out-dir",
            str(out),
            *extra,
        ]
    )
    rows = [json.loads(line) for line in open(Path(out) / "metrics.jsonl")]
    return [r["loss"] for r in rows if "loss" in r] + [
        r["val_loss"] for r in rows if "val_loss" in r
    ][-1:]


# saved at step 2 (its optimizer state sharded over dp_cp = 4 ranks)
SAVED = "cp2 x dp2 allgather, zero 2"


def _resume_copy(root, name, into):
    """A fresh out-dir `into` holding only `name`'s step-2 checkpoint (rank 0 copies, every rank
    waits)."""
    out = Path(root) / into
    world = torch.distributed.is_initialized()
    if not world or torch.distributed.get_rank() == 0:
        (out / "ckpt").mkdir(parents=True)
        shutil.copytree(
            Path(root) / _dir(name) / "ckpt" / "step_000002", out / "ckpt" / "step_000002"
        )
        (out / "ckpt" / "latest").write_text("step_000002")
    if world:
        torch.distributed.barrier()
    return out


def _dir(name):
    return name.replace(" ", "_").replace(",", "")


def _train_world(corpus, docs_corpus, root):
    got = {
        name: _run(docs_corpus, Path(root) / _dir(name), "--global-batch", "4", *flags)
        for name, flags in DOCS.items()
    }
    got |= {
        name: _run(
            corpus,
            Path(root) / _dir(name),
            "--global-batch",
            "4",
            *flags,
            *(["--save-every", "2"] if name == SAVED else []),
        )
        for name, flags in TRAIN.items()
    }
    out = _resume_copy(root, SAVED, "resumed")  # the same layout resumes it: steps 3-4 bitwise
    got["resumed"] = _run(
        corpus, out, "--global-batch", "4", *TRAIN[SAVED], "--save-every", "2", "--resume"
    )
    return got


@pytest.fixture(scope="module")
def docs_corpus(tmp_path_factory):
    """Short documents: every line of the embedded corpus's first CORPUS_CHARS characters a .jsonl
    document (~10 tokens: ~3 per 32-token window), each ended by <|endoftext|> when prepared
    (tools/corpus.py)."""
    text = gzip.open(
        Path(__file__).resolve().parent.parent / "data" / "shakespeare.txt.gz", "rt"
    ).read(CORPUS_CHARS)
    path = tmp_path_factory.mktemp("docs") / "lines.jsonl"
    path.write_text(
        "".join(json.dumps({"text": line}) + "\n" for line in text.split("\n") if line.strip())
    )
    return path


@pytest.fixture(scope="module")
def trained(corpus, docs_corpus, tmp_path_factory, one_thread):
    """One process's curves (plain; documents with and without --document-mask) and the 4-rank
    world's: every TRAIN layout, SAVED resumed from its step 2, and the DOCS layouts."""
    root = tmp_path_factory.mktemp("train")
    dense = {
        name: _run(data, root / name, "--global-batch", "4", *flags)
        for name, data, flags in [
            ("dense", corpus, []),
            ("documents", docs_corpus, ["--document-mask"]),
            ("packed", docs_corpus, []),
        ]
    }
    # the last rank logs
    return (
        root,
        dense,
        worlds.launch(_train_world, 4, corpus, docs_corpus, str(root), timeout=300)[3],
    )


def test_training_equals_one_process(trained):
    """train.py with a cp axis (composed with tp, dp/ZeRO over dp_cp, recompute, pipeline stages)
    against one process: the same windows, the loss the token mean over whole sequences -- equal
    within layout_rtol."""
    _, dense, got = trained
    # it trains: the comparison can tell curves apart
    assert dense["dense"][3] < dense["dense"][0] - 0.05
    tol = layout_rtol(5, 4096, 128, 2)
    for name in TRAIN:
        assert got[name] == pytest.approx(dense["dense"], rel=tol), name


def test_document_mask_training_equals_one_process(trained):
    """--document-mask end to end (the ids built from each window's <|endoftext|> tokens, carried
    with the batch through the pipeline, full recompute and the cp cores) on packed short documents:
    cp2 x pp2 Ulysses and cp2 x tp2 ring equal one process with the mask within layout_rtol; without
    it the curve differs."""
    _, dense, got = trained
    tol = layout_rtol(5, 4096, 128, 2)
    moved = max(abs(a / b - 1) for a, b in zip(dense["packed"], dense["documents"]))
    # the mask moves the curve (8x tol here, by the validation loss): a lost mask fails
    assert moved > 3 * tol
    for name in DOCS:
        assert got[name] == pytest.approx(dense["documents"], rel=tol), name


def test_cp_checkpoint_resumes_bitwise_and_under_cp1(trained, corpus):
    """A cp2 x dp2 ZeRO-2 run saved at step 2 and resumed in its own layout is the uninterrupted run
    bitwise (steps 3-4, the final validation loss, the final weights); resumed by one process (cp 1,
    dp 1, ZeRO-0: weights are replicated over cp, so it is a dp_cp change of 4 -> 1, resharded) it
    continues the same curve within layout_rtol, and its final weights match within test_layouts'
    bound (Adam's lr g/sqrt(v) on a near-zero gradient: 1e-4 absolute, 3% of one step of lr
    3e-3)."""
    root, _, got = trained
    assert len(got["resumed"]) == 3 and got["resumed"] == got[SAVED][2:]
    straight = reshard.full_weights(checkpoint.latest(root / _dir(SAVED)))
    resumed = reshard.full_weights(checkpoint.latest(root / "resumed"))
    assert straight.keys() == resumed.keys() and all(
        torch.equal(straight[k], resumed[k]) for k in straight
    )
    one = _run(
        corpus,
        _resume_copy(root, SAVED, "cp1"),
        "--global-batch",
        "4",
        "--save-every",
        "2",
        "--resume",
    )
    assert one == pytest.approx(got[SAVED][2:], rel=layout_rtol(5, 4096, 128, 2))
    single = reshard.full_weights(checkpoint.latest(root / "cp1"))
    for k in straight:
        torch.testing.assert_close(single[k], straight[k], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--cp", "3"],
            "world size 4 is not divisible by --tp 1 x --pp 1 x --cp 3; launch a multiple of 3 processes",
        ),
        (
            ["--cp", "2", "--tp", "2", "--cp-method", "ulysses"],
            "--cp-method ulysses needs --cp 2 to divide the heads",
        ),
        (
            ["--cp", "4", "--block-size", "12"],
            "--cp 4 needs --block-size 12 divisible by 2 x cp = 8",
        ),
        (
            ["--cp", "2", "--arch", "llama", "--rope-type", "dynamic", "--rope-scaling", "2"],
            "--rope-type dynamic with --cp 2: its frequencies follow the sequence's length",
        ),
    ],
)
def test_train_flags_refused_before_any_collective(argv, message, monkeypatch, tmp_path):
    from nanomega.job import checks, flags

    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError) as err:
        checks.check(
            flags.parse([*argv, "--n-head", "2", "--n-embd", "32", "--out-dir", str(tmp_path)])
        )
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "argv,header",
    [
        (
            ["--cp", "2", "--tp", "2", "--world", "8", "--rank", "5"],
            "dry run: rank 5 of tp 2 x pp 1 x cp 2 x dp 2 (tp 1, stage 0, cp 0, dp 1), ZeRO-1, fp32",
        ),
        (
            ["--arch", "llama", "--n-experts", "4", "--ep", "2", "--world", "4", "--rank", "3"],
            "dry run: rank 3 of tp 1 x pp 1 x dp 4 (ep 2) (tp 0, stage 0, dp 3, ep 1), ZeRO-1, fp32",
        ),
        # no cp, no ep: the line as lessons 15 quotes it
        (
            ["--tp", "2", "--pp", "2", "--world", "8", "--rank", "7"],
            "dry run: rank 7 of tp 2 x pp 2 x dp 2 (tp 1, stage 1, dp 1), ZeRO-1, fp32",
        ),
    ],
)
def test_dry_run_header_names_every_axis(argv, header, capsys, tmp_path):
    train.main(
        [
            *argv,
            "--dry-run",
            "--zero",
            "1",
            "--n-layer",
            "2",
            "--n-head",
            "4",
            "--n-embd",
            "32",
            "--block-size",
            "32",
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert capsys.readouterr().out.startswith(header + ": built on meta in ")
