"""Multi-token prediction (mtp.py): DeepSeek-V3's D modules, their loss averaged over the whole
step's valid targets, against one process.

One process: the loss is DeepSeek-V3's (arXiv 2412.19437 Sec. 2.2), written out here with loops
over tokens and documents (an invalid position's input is a stand-in here: that it changes nothing
shows no valid target reads one); a step split into micro-batches over two dp ranks (a stand-in dp
axis that adds the other rank's counts) has the one-batch gradient; planted, a rank's own count
(Megatron-LM #7452's bug) or each micro-batch's own mean has not. Parameters, FLOPs (torch's
FlopCounterMode) and the planner's count are formulas.py's, exactly.
End to end (train.py on short documents with --document-mask, so each rank's and micro-batch's
valid MTP targets differ): dp2 (micro-batches of 2), dp2 ZeRO-3 with full recompute (of 4), pp2
1F1B and ZB-H1 (the modules and the tied head's copy on the last stage; ZB-H1 defers their weight
gradients too), tp2 and tp2 + SP (the MTP blocks split as the trunk's, the lookup and the loss
vocabulary-parallel) equal one process (one micro-batch of 8): losses, the first step's gradient
norm, the validation loss and the final weights, the MTP modules' included.
Tolerances (tests/tolerance.py): gradients of one batch in two orders, gradient_rtol relative to the
largest element; layouts, layout_rtol for D + L = 4 blocks (5 reductions of <= 64 terms each) and
the 3 heads; weights within 1e-4 as tests/test_layouts.py (1% of one Adam step at lr 1e-2:
the planted rank-local count moves the embedding 3e-2 off).
"""

import json

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from nanomega import checkpoint, documents, formulas, mtp, reshard, train, worlds
from nanomega.gpt_config import SHAPE_KEYS, GPTConfig
from nanomega.model import GPT
from nanomega.tools import cost
from test_cp import docs_corpus  # noqa: F401 (a fixture: ~10-token documents)
from test_layouts import curve, flags, run_layouts
from tolerance import gradient_rtol, layout_rtol

CORPUS_CHARS = 100_000
EOT, D, LAMBDA = 255, 2, 0.3


def mtp_cfg(**kw):
    base = dict(arch="llama", n_layer=2, n_head=4, n_embd=32, ffn_hidden=64, block_size=16)
    return GPTConfig(**{**base, "vocab_size": 256, "mtp_num_layers": D, **kw})


def batch(rows=4, seed=0, ignored=False):
    """(x, y, document ids): documents of 2-7 tokens, so rows have different valid MTP targets;
    ignored: a few LM targets -1 too."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, EOT, (rows, 17), generator=g)
    x[torch.rand(x.shape, generator=g) < 0.25] = EOT
    x, y = x[:, :-1], x[:, 1:].clone()
    if ignored:
        y[torch.rand(y.shape, generator=g) < 0.1] = -1
    return x, y, documents.ids(x, EOT)


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_close_grads(got, ref, tokens, cfg):
    tol = gradient_rtol(tokens, cfg.vocab_size, 64, 5 * (cfg.n_layer + D) + D + 1, 10**5)
    for n, g in ref.items():
        torch.testing.assert_close(got[n], g, rtol=tol, atol=tol * g.abs().max(), msg=n)


def test_loss_is_deepseek_v3s_formula():
    cfg = mtp_cfg(mtp_loss_scaling_factor=LAMBDA)
    x, y, docs = batch(ignored=True)
    b, s = y.shape

    # ours: the LM loss returned, the MTP loss in its backward
    model = GPT(cfg, seed=0)
    loss = model(x, y, docs)
    loss.backward()
    with torch.no_grad():
        assert torch.equal(loss, GPT(cfg, seed=0)(x, y, docs))  # the reported loss: the LM's

    # the formula, position by position: token i + k in token i's document, neither ignored
    ref = GPT(cfg, seed=0)
    h = ref.embed(x)
    for block in ref.blocks.values():
        h = block(h, docs)
    total, per_depth = ref.head(h, y), []
    for k, depth in enumerate(ref.mtp.depths.values(), start=1):
        tokens, goal = torch.zeros_like(y), torch.full_like(y, -1)
        for r in range(b):
            for i in range(s - k):
                if y[r, i + k - 1] >= 0 and y[r, i + k] >= 0 and docs[r, i + k] == docs[r, i]:
                    tokens[r, i], goal[r, i] = y[r, i + k - 1], y[r, i + k]
        h = depth(h, ref.embed.wte(tokens), docs)
        logits = ref.head.lm_head(depth.out_norm(h))[goal >= 0]
        per_depth.append(F.cross_entropy(logits[:, : cfg.vocab_size], goal[goal >= 0]))
        total = total + LAMBDA / D * per_depth[-1]
    total.backward()

    # the step's row: each depth's mean cross-entropy (one process: the axes add nothing)
    one = Axis()
    one.size = 1
    row = mtp.step_stats(model, type("Grid", (), dict(device=x.device, dp_cp=one, pp=one)))
    want = [ce.item() for ce in per_depth]
    assert row["mtp_loss_depths"] == pytest.approx(want, rel=1e-5)
    assert row["mtp_loss"] == pytest.approx(sum(want) / D, rel=1e-5) and model.mtp.booked is None
    assert_close_grads(grads(model), grads(ref), b * s, cfg)
    assert model.mtp.depths["1"].eh_proj.weight.grad.abs().max() > 0


class Axis:
    """A stand-in dp axis of 2 ranks: its all-reduce returns the step's counts over both (total),
    or this rank's own (None: the all-reduce left out)."""

    def __init__(self, total=None):
        self.size, self.total = 2, total

    def all_reduce(self, t):
        return t.clone() if self.total is None else self.total.clone()


def test_micro_batches_and_ranks_count_the_whole_step():
    """One batch of 4 rows (one process, one micro-batch) against 2 ranks x 2 micro-batches of one
    row: the same gradient when each depth's loss is over the step's count. Planted, each fails:
    a rank's own count (Megatron-LM #7452), each micro-batch's own mean."""
    cfg = mtp_cfg(mtp_loss_scaling_factor=LAMBDA)
    x, y, docs = batch()
    rows = torch.stack([(mtp.shifted(y, k, docs)[1] >= 0).sum(1) for k in (1, 2)])  # (D, b)
    assert len(set(rows.sum(0).tolist())) > 1  # the rows' valid targets differ

    one = GPT(cfg, seed=0)
    one(x, y, docs).backward()

    def split(plant=None):
        model = GPT(cfg, seed=0)
        axis = Axis(None if plant == "rank" else rows.sum(1))
        grid = type("Grid", (), dict(device=x.device, dp_cp=axis))
        per_rank = []
        for rank in range(2):
            model.zero_grad()
            mbs = [tuple(t[i : i + 1] for t in (x, y, docs)) for i in (2 * rank, 2 * rank + 1)]
            mtp.prepare(model, grid, mbs)
            if plant == "micro-batch":
                model.mtp.weights = None  # each micro-batch's mean over its own count
            for mb in mbs:
                (model(*mb) / len(mbs)).backward()
            per_rank.append(grads(model))
        return {n: (per_rank[0][n] + per_rank[1][n]) / 2 for n in per_rank[0]}

    assert_close_grads(split(), grads(one), x.numel(), cfg)
    for plant in ("rank", "micro-batch"):
        with pytest.raises(AssertionError):
            assert_close_grads(split(plant), grads(one), x.numel(), cfg)


def test_parameters_flops_and_the_planners_count():
    for mla in ({}, dict(kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8, v_head_dim=6)):
        cfg = mtp_cfg(**mla)
        model = GPT(cfg, seed=0)
        held = sum(p.numel() for n, p in model.named_parameters() if n.startswith("mtp."))
        assert formulas.mtp_params(cfg) == held > 0

        # FLOPs: the matmuls of a forward and backward, counted by torch (norm scales: no matmul)
        x, y, docs = batch()
        with FlopCounterMode(display=False) as counter:
            model(x, y, docs).backward()
        norms = sum(p.numel() for p in model.parameters() if p.dim() == 1)
        assert counter.get_total_flops() == x.numel() * (
            formulas.model_flops_per_token(cfg) - 6 * norms
        )

        # the planner: the whole model, and the modules on the last of 2 stages
        shape = cost.Model.from_shape({k: getattr(cfg, k) for k in SHAPE_KEYS})
        assert cost.n_params(shape) == sum(p.numel() for p in model.parameters())
        first, last = cost.stage_params(shape, pp=2)
        assert last - first == formulas.mtp_params(cfg) + cfg.n_embd  # + the final norm


def test_refused_in_one_line():
    with pytest.raises(ValueError, match="--mtp-num-layers 2: multi-token prediction modules are"):
        mtp_cfg(arch="gpt2", ffn_hidden=0).validate()
    cfg = mtp_cfg()
    for kw, match in [
        (dict(cp=2), "with --cp 2: a chunk's last tokens need the tokens k ahead"),
        (dict(tp=2, pp=2), "with --tp 2 and --pp 2: the last stage's copy of the embedding is"),
        (dict(pp=2), None),
        (dict(tp=2), None),
    ]:
        if match is None:
            mtp.check(cfg, **kw)  # pp: the last stage has the head's tied copy; tp: split
            continue
        with pytest.raises(ValueError, match=match):
            mtp.check(cfg, **kw)
    with pytest.raises(ValueError, match="--untie-embeddings: the last stage holds no embedding"):
        mtp.check(mtp_cfg(tie_embeddings=False), pp=2)
    with pytest.raises(ValueError, match="--n-experts: an MoE block in an MTP module"):
        mtp.check(mtp_cfg(n_experts=4))
    with pytest.raises(ValueError, match="predicts past the window"):
        mtp.check(mtp_cfg(mtp_num_layers=16))


COMMON = ["--arch", "llama", "--n-layer", "2", "--n-head", "4", "--n-embd", "32"]
COMMON += ["--ffn-hidden", "64", "--block-size", "32", "--document-mask", "--max-steps", "4"]
COMMON += ["--warmup", "1", "--lr", "1e-2", "--eval-every", "4", "--eval-iters", "2"]
COMMON += ["--log-every", "100", "--peak-flops", "1e11", "--save-every", "4"]
COMMON += ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.5"]
LAYOUTS = [  # global batch 8: one process takes it as one micro-batch
    ("dp2", ["--batch-size", "2", "--grad-accum", "2"]),
    ("dp2-zero3-full", ["--zero", "3", "--recompute", "full", "--batch-size", "4"]),
    ("pp2-1f1b", ["--pp", "2", "--schedule", "1f1b", "--batch-size", "2", "--grad-accum", "4"]),
    ("pp2-zb-h1", ["--pp", "2", "--schedule", "zb-h1", "--batch-size", "2", "--grad-accum", "4"]),
    ("tp2", ["--tp", "2", "--batch-size", "2", "--grad-accum", "4"]),
    ("tp2-sp", ["--tp", "2", "--sequence-parallel", "--batch-size", "4", "--grad-accum", "2"]),
]
RTOL = layout_rtol(4, vocab=4096, width=64, depth=5 * 4 + 3)


def rows(out):
    return [json.loads(line) for line in open(out / "metrics.jsonl") if '"grad_norm"' in line]


def test_dp2_with_uneven_targets_pp2_and_tp2_equal_one_process(docs_corpus, tmp_path):  # noqa: F811
    # one process first: it prepares the corpus's cache, which the world's ranks then read
    dense = tmp_path / "dense"
    train.main(flags(docs_corpus, dense, ["--batch-size", "8", "--grad-accum", "1"], COMMON))
    worlds.launch(run_layouts, 2, docs_corpus, tmp_path, LAYOUTS, None, COMMON, timeout=600)
    (ref, ref_val), b = curve(dense), reshard.full_weights(checkpoint.latest(dense))
    assert ref[-1] < ref[0] - 0.05  # it trains, and the curves can be told apart
    assert (b["mtp.depths.1.out_norm.weight"] - 1).abs().max() > 1e-3  # the last module learns
    n = sum(v.numel() for v in b.values())
    grad_tol = gradient_rtol(8 * 32, 4096, 64, 5 * 4 + 3, n)
    for name, _ in LAYOUTS:
        losses, val = curve(tmp_path / name)
        assert losses == pytest.approx(ref, rel=RTOL) and val == pytest.approx(ref_val, rel=RTOL)
        first = rows(tmp_path / name)[0]["grad_norm"]
        assert first == pytest.approx(rows(dense)[0]["grad_norm"], rel=grad_tol), name
        # the MTP loss in each step's row: over the whole step's targets, whatever the layout
        got, want = (
            [x for r in rows(o) for x in r["mtp_loss_depths"]] for o in (tmp_path / name, dense)
        )
        assert len(got) == 4 * D and got == pytest.approx(want, rel=RTOL), name
        a = reshard.full_weights(checkpoint.latest(tmp_path / name))
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(
                a[k], b[k], rtol=1e-4, atol=1e-4, msg=lambda m: f"{name} {k}: {m}"
            )


def test_dry_run_planner_bytes_are_the_engine_bytes():
    """One MTP module on a 4-layer Llama of h 4096 on paper: the planner counts it on the last of 2
    pipeline stages and split by tp2 as the trunk's layers (its projection and norms whole), as
    each rank's engine holds it (the module is ~200 MB in bf16: a module off fails)."""
    from test_meta import assert_planner_is_engine, dry_run

    base = ["--arch", "llama", "--n-layer", "4", "--n-embd", "4096", "--n-head", "32"]
    base += ["--mtp-num-layers", "1", "--zero", "1", "--dtype", "bf16", "--world", "4"]
    for layout in (["--pp", "2"], ["--tp", "2"]):
        for rank in (0, 3):
            assert_planner_is_engine(dry_run([*base, *layout, "--rank", str(rank)]))


# the compositions tests/fuzz.py does not draw with MTP: 4 blocks, so that pp2 x 2 chunks has one each
COMMON4 = [*COMMON, "--n-layer", "4"]
MORE = [
    ("pp2-gpipe", ["--pp", "2", "--schedule", "gpipe", "--batch-size", "2", "--grad-accum", "4"]),
    (
        "pp2-interleaved",
        ["--pp", "2", "--schedule", "interleaved", "--virtual-stages", "2"]
        + ["--batch-size", "2", "--grad-accum", "4"],
    ),
    ("dp2-offload", ["--zero", "1", "--offload", "1", "--batch-size", "2", "--grad-accum", "2"]),
    ("dp2-muon", ["--optimizer", "muon", "--batch-size", "2", "--grad-accum", "2"]),
]


def test_gpipe_interleaved_offload_and_muon_equal_one_process(docs_corpus, tmp_path):  # noqa: F811
    """MTP with the GPipe and interleaved schedules (the modules on the last chunk), ZeRO-Offload's
    CPU Adam and Muon (the MTP blocks' matrices stay on AdamW, as the embedding and head: Muon
    takes model.blocks) at dp2 = one process (Muon's: one process under Muon), 4 steps."""
    refs = {"adamw": [], "muon": ["--optimizer", "muon"]}
    for name, extra in refs.items():
        train.main(flags(docs_corpus, tmp_path / name, ["--batch-size", "8", *extra], COMMON4))
    worlds.launch(run_layouts, 2, docs_corpus, tmp_path, MORE, None, COMMON4, timeout=600)
    rtol = layout_rtol(4, vocab=4096, width=64, depth=5 * 6 + 3)
    for name, _ in MORE:
        ref = tmp_path / ("muon" if "muon" in name else "adamw")
        (losses, val), (want, want_val) = curve(tmp_path / name), curve(ref)
        assert losses == pytest.approx(want, rel=rtol) and val == pytest.approx(want_val, rel=rtol)
        got, want = (
            [x for r in rows(o) for x in r["mtp_loss_depths"]] for o in (tmp_path / name, ref)
        )
        assert got == pytest.approx(want, rel=rtol), name
