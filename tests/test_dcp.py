"""torch.distributed.checkpoint in and out with torchtitan's Llama names (nanomega/tools/dcp.py):
export -> import is bitwise; the q/k row permutation turns our rotate-half RoPE into Meta's
interleaved one (the attention scores of torchtitan's complex rotation equal ours, fp32 rounding:
1e-5 on scores of size ~10); a DCP checkpoint of torchtitan's layout trains on here. torchtitan itself
(its model loading our export) is not installed here (not in the test extra: see the closing
note): that part is unverified.
"""

import torch

from nanomega import checkpoint, reshard, train
from nanomega.gpt_config import SHAPE_KEYS, GPTConfig
from nanomega.model import GPT
from nanomega.modern import Rotary, rope_frequencies
from nanomega.tools import dcp, hf
from test_layouts import flags

CORPUS_CHARS = 200_000
CFG = dict(
    arch="llama",
    vocab_size=4096,
    block_size=32,
    n_layer=2,
    n_head=4,
    n_kv_head=2,
    n_embd=32,
    ffn_hidden=64,
    rope_theta=500000.0,
    tie_embeddings=False,
)


def test_dcp_round_trip_is_bitwise_and_trains_on(corpus, tmp_path):
    cfg = GPTConfig(**CFG)
    weights = {k: t.detach() for k, t in GPT(cfg, seed=0).state_dict().items()}
    hf.save_dense(tmp_path / "ours", cfg, weights, {})
    dcp.export(tmp_path / "ours", tmp_path / "titan")
    back = dcp.import_(tmp_path / "titan", tmp_path / "back", 4, 500000.0, block_size=32)
    assert {k: getattr(back, k) for k in SHAPE_KEYS} == {k: getattr(cfg, k) for k in SHAPE_KEYS}
    a = reshard.full_weights(checkpoint.latest(tmp_path / "ours"))
    b = reshard.full_weights(checkpoint.latest(tmp_path / "back"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # torchtitan's names, as its Llama 3 holds them
    state = dcp.to_titan(weights, cfg)
    assert {"tok_embeddings.weight", "output.weight", "norm.weight"} <= state.keys()
    assert state["layers.1.feed_forward.w3.weight"].shape == (64, 32)
    assert state["layers.0.attention.wk.weight"].shape == (16, 32)

    # it trains on here: one step from the imported checkpoint
    argv = [
        "--arch",
        "llama",
        "--n-layer",
        "2",
        "--n-head",
        "4",
        "--n-kv-head",
        "2",
        "--n-embd",
        "32",
    ]
    argv += [
        "--ffn-hidden",
        "64",
        "--rope-theta",
        "500000",
        "--untie-embeddings",
        "--block-size",
        "32",
    ]
    argv += ["--max-steps", "1", "--batch-size", "2", "--eval-every", "0", "--peak-flops", "1e11"]
    train.main(flags(corpus, tmp_path / "back", ["--resume"], argv))
    assert checkpoint.latest(tmp_path / "back").endswith("step_000001")


def test_interleaved_rows_are_metas_rotary():
    """Scores q.k under torchtitan's rotation (complex pairs 2p, 2p+1 of the permuted rows) equal
    ours (rotate-half pairs p, p + hd/2 of our rows)."""
    torch.manual_seed(0)
    heads, hd, h, s = 4, 8, 32, 16
    wq, wk, x = torch.randn(heads * hd, h), torch.randn(heads * hd, h), torch.randn(1, s, h)
    rot = Rotary(hd, 10000.0)

    def ours(w):  # (1, heads, s, hd), rotated halves
        return rot((x @ w.t()).view(1, s, heads, hd).transpose(1, 2))

    def metas(w, permute=True):  # torchtitan's apply_rotary_emb on the interleaved rows
        w = dcp.interleave(w, heads) if permute else w
        y = (x @ w.t()).view(1, s, heads, hd // 2, 2)
        angle = torch.outer(torch.arange(s).float(), rope_frequencies(hd, 10000.0)[0])
        y = (
            torch.view_as_complex(y.contiguous())
            * torch.polar(torch.ones_like(angle), angle)[:, None]
        )
        return torch.view_as_real(y).flatten(3).transpose(1, 2)

    mine, theirs = ours(wq) @ ours(wk).transpose(-2, -1), metas(wq) @ metas(wk).transpose(-2, -1)
    torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5)
    assert torch.equal(dcp.deinterleave(dcp.interleave(wq, heads), heads), wq)
    # without the permutation the scores differ
    unpermuted = metas(wq, False) @ metas(wk, False).transpose(-2, -1)
    assert (unpermuted - mine).abs().max() > 1e-1
