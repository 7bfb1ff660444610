"""The dense GPT: causality, initial loss, overfitting, FLOPs by hand, LR schedule."""

import math

import pytest
import torch

from nanomega.formulas import model_flops_per_token as flops_per_token
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT, alibi_slopes
from nanomega.job.flags import parse
from nanomega.train import lr_at
from tolerance import gamma

TINY = dict(vocab_size=200, block_size=16, n_layer=2, n_head=4, n_embd=32)


@pytest.mark.parametrize("alibi,embed_ln", [(False, False), (True, True)])
def test_causal(alibi, embed_ln):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, alibi=alibi, embed_layernorm=embed_ln)).eval()
    x = torch.randint(0, 200, (2, 16))
    x2 = x.clone()
    x2[:, 9:] = torch.randint(0, 200, (2, 7))
    a, b = model(x), model(x2)
    assert torch.equal(a[:, :9], b[:, :9])  # the past never sees the future: bitwise
    assert (a[:, 9:] - b[:, 9:]).abs().max() > 1e-3  # ...and the test can fail


def test_initial_loss_is_log_vocab():
    torch.manual_seed(0)
    cfg = GPTConfig(**TINY)
    model = GPT(cfg)
    x, y = torch.randint(0, 200, (8, 16)), torch.randint(0, 200, (8, 16))
    loss = model(x, y).item()
    # small init -> near-uniform logits over the real vocabulary (200 entries; the 56 padded rows
    # are masked: ln 256 - ln 200 = 0.25 > 0.1, so this fails if they take part)
    assert abs(loss - math.log(cfg.vocab_size)) < 0.1


def test_overfits_one_batch():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    x, y = torch.randint(0, 200, (4, 16)), torch.randint(0, 200, (4, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1


def test_ignore_index_and_padded_vocab():
    cfg = GPTConfig(**TINY)
    assert cfg.padded_vocab_size == 256 and GPTConfig(vocab_size=4096).padded_vocab_size == 4096
    model = GPT(cfg)
    x, y = torch.randint(0, 200, (2, 16)), torch.randint(0, 200, (2, 16))
    y2 = y.clone()
    y2[:, :8] = -1
    logits = model(x)
    ref = torch.nn.functional.cross_entropy(
        logits[:, 8:, :200].reshape(-1, 200), y[:, 8:].reshape(-1)
    )
    # the same 16 per-token losses (positive), summed in another order around 16 exact zeros: 2
    # gamma(16)
    assert torch.allclose(model(x, y2), ref, rtol=2 * gamma(16), atol=0)


def test_padded_vocab_rows_are_out_of_the_loss():
    """The loss is the one over the 200 real tokens (GPT-2's over 50,257, not 50,304): the padded
    rows get no gradient and changing them changes nothing (bitwise: they are sliced away before the
    softmax)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    x, y = torch.randint(0, 200, (2, 16)), torch.randint(0, 200, (2, 16))
    loss = model(x, y)
    loss.backward()
    ref = torch.nn.functional.cross_entropy(model(x)[..., :200].flatten(0, 1), y.flatten())
    assert torch.equal(loss, ref)
    # padded rows: no gradient, never trained
    assert model.embed.wte.weight.grad[200:].abs().max() == 0
    with torch.no_grad():
        model.embed.wte.weight[200:] = 100.0  # would dominate the softmax if it took part
    assert torch.equal(model(x, y), loss)


def test_weights_tied_and_gpt2_init():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=4096, n_layer=8, n_embd=256, n_head=4))
    assert model.head.lm_head.weight is model.embed.wte.weight
    proj = model.blocks["3"].mlp.c_proj.weight
    assert abs(proj.std().item() - 0.02 / math.sqrt(16)) < 5e-4
    assert abs(model.blocks["3"].mlp.c_fc.weight.std().item() - 0.02) < 5e-4


def test_flops_per_token_by_hand():
    cfg = GPTConfig(vocab_size=100, block_size=8, n_layer=2, n_head=2, n_embd=4)  # padded vocab 128
    model = GPT(cfg)
    # matmul parameters, counted from the modules: all parameters except position embeddings
    n = sum(p.numel() for name, p in model.named_parameters() if "wpe" not in name)
    assert n == 2 * (12 * 16 + 13 * 4) + 128 * 4 + 2 * 4
    # hand count: per layer qkv 4*12+12, proj 4*4+4, fc 4*16, fc bias 16, proj 16*4+4, 2 LN 16 = 244
    assert n == 2 * 244 + 512 + 8
    assert flops_per_token(cfg) == 6 * n + 12 * 2 * 4 * 8


def test_alibi_slopes():
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    # not a power of two: 4 from 2^(-8/4 i), then every other of the 8-head series
    s6 = alibi_slopes(6)
    assert torch.allclose(s6, torch.tensor([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]))


def test_lr_schedule():
    args = parse(["--lr", "1e-3", "--min-lr", "1e-4", "--warmup", "10", "--max-steps", "110"])
    assert lr_at(0, args) == pytest.approx(1e-4)
    assert lr_at(9, args) == pytest.approx(1e-3)
    assert lr_at(10, args) == pytest.approx(1e-3)
    assert lr_at(60, args) == pytest.approx(0.55e-3)  # half way: the mean of lr and min-lr
    assert lr_at(110, args) == pytest.approx(1e-4)
    assert lr_at(500, args) == pytest.approx(1e-4)


def test_bad_config():
    with pytest.raises(ValueError, match="--n-embd 30 is not divisible by --n-head 4"):
        GPT(GPTConfig(n_embd=30, n_head=4))
