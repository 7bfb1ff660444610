"""--attention sdpa | eager | fused: the same model whichever core computes softmax(q k^T / sqrt(d))
v.

Tolerance (fp32): the three cores compute the same sums in different orders (sdpa's fused kernel vs
an explicit softmax then a matmul), so an attention output differs by rounding: at most ~n u
relative for a sum of n terms (u = 2^-24 = 6e-8; n <= 32 keys or head dims here), i.e. <= 2e-6.
Forward outputs and gradients are compared at rtol 1e-5 (5x that bound); losses over 5 AdamW steps
at rtol 1e-5: AdamW's update lr g/sqrt(v) keeps a relative error in g relative, so 5 steps add at
most ~5 x 2e-6.
Under tp2 + sequence parallelism the same holds (test_layouts: tp changes the order of sums at
1e-7).
"""

import json
from pathlib import Path

import pytest
import torch

from nanomega import dist, fused, tp, train, worlds
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT, eager_core, sdpa_core

ROOT = Path(__file__).resolve().parent.parent
CORPUS_CHARS = 200_000  # of the embedded corpus, for conftest's `corpus`
RTOL = 1e-5  # see the module docstring
pytestmark = pytest.mark.usefixtures("one_thread")
KINDS = ("sdpa", "eager", "fused")
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
    "--max-steps",
    "5",
    "--warmup",
    "1",
    "--lr",
    "3e-3",
    "--eval-every",
    "0",
    "--log-every",
    "100",
    "--peak-flops",
    "1e11",
]


def run(corpus, out, *extra):
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
    return [
        json.loads(line)["loss"] for line in open(Path(out) / "metrics.jsonl") if '"loss"' in line
    ]


def use(gpt, kind):
    gpt.replace_op("core", sdpa_core if kind == "sdpa" else eager_core)
    if kind == "fused":
        gpt.replace_op("softmax", fused.causal_softmax)
    return gpt


@pytest.mark.parametrize("alibi", [False, True])
def test_cores_agree_forward_and_backward(alibi):
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    out = {}
    for kind in KINDS:
        torch.manual_seed(0)
        model = use(
            GPT(
                GPTConfig(
                    vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32, alibi=alibi
                )
            ),
            kind,
        )
        loss = model(x, x)
        loss.backward()
        out[kind] = (model(x), {k: p.grad for k, p in model.named_parameters()})
    for kind in ("sdpa", "fused"):
        torch.testing.assert_close(out[kind][0], out["eager"][0], rtol=RTOL, atol=RTOL * 1e-1)
        for k, g in out["eager"][1].items():
            torch.testing.assert_close(out[kind][1][k], g, rtol=RTOL, atol=1e-7, msg=f"{kind} {k}")


def test_16_bit_eager_scales_q_before_the_product():
    """fp16: q.k over d = 64 of activations 40 is 102,400 > 65,504; scaled first it is 12,800
    (lesson 09)."""
    attn = (
        GPT(GPTConfig(vocab_size=128, block_size=8, n_layer=1, n_head=2, n_embd=128))
        .blocks["0"]
        .attn
    )
    q = torch.full((1, 2, 8, 64), 40.0, dtype=torch.float16)
    for core in (eager_core, sdpa_core):
        assert core(attn, q, q, q).isfinite().all(), core.__name__


def _sp_world(corpus, root):
    """tp2 + SP in one spawned world: each core's 5-step losses; selective recompute with sdpa; and
    the dtype in which SP sums the replicated parameters' gradients of a bf16 model."""
    losses = {
        k: run(
            corpus,
            Path(root) / f"sp-{k}",
            "--tp",
            "2",
            "--sequence-parallel",
            "--batch-size",
            "4",
            "--attention",
            k,
        )
        for k in KINDS
    }
    losses["sdpa-selective"] = run(
        corpus,
        Path(root) / "sp-rec",
        "--tp",
        "2",
        "--sequence-parallel",
        "--batch-size",
        "4",
        "--recompute",
        "selective",
    )
    grid = dist.Grid(1, 1, 2)
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            vocab_size=256,
            block_size=16,
            n_layer=1,
            n_head=2,
            n_embd=16,
            make_vocab_size_divisible_by=256,
        )
    ).to(torch.bfloat16)
    tp.apply_tensor_parallel(model, grid.tp, sequence_parallel=True)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    grid.log.reset()
    model(x, x).backward()
    reduced = {
        dtype for (op, axis, dtype) in grid.log.counts if op == "all_reduce" and axis == "tp"
    }
    return losses, reduced


def test_same_losses_dense_and_tp2_sp(corpus, tmp_path):
    dense = {
        k: run(corpus, tmp_path / f"dense-{k}", "--batch-size", "4", "--attention", k)
        for k in KINDS
    }
    ref = dense["eager"]
    # it trains: the comparison can tell curves apart
    assert len(ref) == 5 and ref[-1] < ref[0] - 0.05
    for kind in ("sdpa", "fused"):
        assert dense[kind] == pytest.approx(ref, rel=RTOL), kind
    (losses, reduced), _ = worlds.launch(_sp_world, 2, corpus, str(tmp_path), timeout=600)
    for kind, curve in losses.items():
        assert curve == pytest.approx(ref, rel=RTOL), kind
    assert reduced == {"float32"}  # no bf16 all-reduce of SP gradients
