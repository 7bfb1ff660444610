"""MoE checkpoints (issue 30): an expert-parallel run resumes bitwise, and reshards to another ep
size.

One spawned world of 2 (dp2 ep2: each rank holds 2 of the 4 experts), three runs of train.main:
    full       4 steps, a checkpoint every 2, DeepSeek-V3's bias balancing on (the bias is a buffer, moved
               outside autograd: it must be saved, or a resumed run routes otherwise)
    resumed    step 2 of `full`, resumed under the same layout: losses, weights and biases bitwise `full`'s
    ep1        step 2 of `full`, resumed at ep 1 under ZeRO-1 (every rank holds every expert, their optimizer
               state sharded over dp): losses within tolerance.layout_rtol of `full` (the expert gradients are
               summed in another order), the routing biases equal (integer loads: the same routing)
    pp2        the same at pp 2 (each stage restores and saves its own layer's bias: a table gathered over pp)
tools/sample.py loads the biases with the weights (a model routed without them samples otherwise).
Saving at ZeRO-0 also checks that an expert held by dp rank 1 is saved (its replicas are its edp
ranks).
"""

import json
import shutil
from pathlib import Path

import torch
import torch.distributed as td

from nanomega import checkpoint, reshard, train, worlds
from nanomega.tools import sample
from tolerance import layout_rtol

CORPUS_CHARS = 100_000
STEPS = 4
ARGV = [
    "--arch",
    "llama",
    "--n-layer",
    "2",
    "--n-head",
    "4",
    "--n-embd",
    "32",
    "--ffn-hidden",
    "64",
    "--block-size",
    "16",
    "--n-experts",
    "4",
    "--top-k",
    "2",
    "--moe-aux-loss",
    "0.01",
    "--moe-bias-balance",
    "0.01",
    "--batch-size",
    "2",
    "--grad-accum",
    "2",
    "--dropout",
    "0",
    "--max-steps",
    str(STEPS),
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
    "--device",
    "cpu",
]
RTOL = layout_rtol(STEPS - 2, vocab=4096, width=64, depth=9)


def runs(corpus, root):
    """Inside the spawned world: the three runs in turn (one start-up for all)."""

    def go(name, *extra):
        train.main(
            [
                *ARGV,
                "--corpus",
                str(corpus),
                "--data-cache",
                str(Path(root) / "cache"),
                "--out-dir",
                str(Path(root) / name),
                *extra,
            ]
        )

    go("full", "--ep", "2", "--zero", "0")
    for name in ("resumed", "ep1", "pp2"):
        if td.get_rank() == 0:
            shutil.copytree(
                Path(root) / "full" / "ckpt" / "step_000002",
                Path(root) / name / "ckpt" / "step_000002",
            )
        td.barrier()
    go("resumed", "--ep", "2", "--zero", "0", "--resume")
    go("ep1", "--ep", "1", "--zero", "1", "--resume")
    go("pp2", "--pp", "2", "--grad-accum", "4", "--resume")
    return True


def losses(out):
    return {
        r["step"]: r["loss"] for r in map(json.loads, open(out / "metrics.jsonl")) if "loss" in r
    }


def last(out):
    """(full weights, routing-bias table) of a run's newest checkpoint."""
    folder = checkpoint.latest(out)
    return reshard.full_weights(folder), checkpoint.load_shard(folder, 0)["moe_bias"]


def test_moe_resume_bitwise_and_reshard_to_ep1(corpus, tmp_path):
    worlds.launch(runs, 2, corpus, tmp_path, timeout=600)
    full, resumed, ep1, pp2 = (losses(tmp_path / n) for n in ("full", "resumed", "ep1", "pp2"))
    (w_full, b_full), (w_res, b_res), (w_ep1, b_ep1), (_, b_pp2) = (
        last(tmp_path / n) for n in ("full", "resumed", "ep1", "pp2")
    )
    assert sorted(full) == list(range(1, STEPS + 1)) and sorted(resumed) == sorted(ep1) == sorted(
        pp2
    ) == [3, 4]
    saved = checkpoint.load_shard(tmp_path / "full" / "ckpt" / "step_000002", 1)["moe_bias"]
    # what the resume must restore: the bias moved (0.01 a step) in both layers
    assert (saved != 0).sum() >= 4
    assert [resumed[s] for s in (3, 4)] == [full[s] for s in (3, 4)], (resumed, full)
    assert w_full.keys() == w_res.keys() and all(torch.equal(w_full[k], w_res[k]) for k in w_full)
    assert any(".experts.3." in k for k in w_full)  # the experts of dp rank 1 were saved
    assert torch.equal(b_full, b_res)
    for s in (3, 4):
        assert abs(ep1[s] - full[s]) <= RTOL * full[s], (s, ep1, full, RTOL)
        assert abs(pp2[s] - full[s]) <= RTOL * full[s], (s, pp2, full, RTOL)
    assert (
        w_ep1.keys() == w_full.keys() and torch.equal(b_ep1, b_full) and torch.equal(b_pp2, b_full)
    )
    # sampling routes as training did: the biases come along
    model, _ = sample.load_model(tmp_path / "full")
    assert torch.equal(
        torch.stack([model.blocks[str(i)].mlp.expert_bias for i in range(2)]), b_full
    )
