"""Document masking (nanomega/documents.py, modern.document_mask): the dense model with a document
mask against each document of the window run alone. One process, fp32, < 2 s.

Positions stay absolute under --document-mask, so "alone" means a document's own tokens at its own
window positions (GPT.forward's positions argument): the mask is then the only difference, and a
masked key contributes an exact 0 to the softmax. The two sides still sum the unmasked keys (and
every matmul) over other shapes, so in other orders: tests/tolerance.py's layout bound on the
logits, 2 likely(width) sqrt(depth) relative to the largest logit (width 4h = 128 terms, depth 2
layers x 4 + head).
"""

import pytest
import torch

from nanomega import documents, extension, fused
from nanomega.gpt_config import GPTConfig
from nanomega.model import GPT
from tolerance import likely

EOT, V, S = 0, 200, 32
BOUND = 2 * likely(128) * 9**0.5
CASES = {
    "gpt2 sdpa": {},
    "gpt2 eager": dict(attention="eager"),
    "gpt2 fused softmax": dict(attention="fused"),
    "gpt2 alibi eager": dict(alibi=True, attention="eager"),
    "llama sdpa, grouped-query": dict(arch="llama", n_kv_head=2, ffn_hidden=64),
}


def windows(seed=0, b=2, p=0.15):
    """(b, S) ids with end-of-text tokens at random places (documents of ~1/p tokens) and their
    document ids."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(1, V, (b, S), generator=gen)
    x[torch.rand(b, S, generator=gen) < p] = EOT
    return x, documents.ids(x, EOT)


def test_document_ids_count_the_end_of_text_tokens_before():
    x = torch.tensor([[5, 0, 7, 8, 0, 0, 9], [0, 1, 2, 3, 4, 5, 6]])
    assert documents.ids(x, 0).tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]


def alone(model, x, docs):
    """(b, S, V) logits: each document of each window run by itself at its window positions."""
    out = torch.empty(x.shape[0], S, model.cfg.padded_vocab_size)
    for i in range(x.shape[0]):
        for d in docs[i].unique():
            at = (docs[i] == d).nonzero().flatten()  # contiguous: a document is a run of the window
            out[i, at] = model(x[i : i + 1, at], positions=at)[0]
    return out


@pytest.mark.parametrize("case", CASES)
def test_dense_document_mask_equals_each_document_alone(case):
    cfg = GPTConfig(vocab_size=V, block_size=S, n_layer=2, n_head=4, n_embd=32, **CASES[case])
    torch.manual_seed(0)
    model = GPT(cfg)
    if cfg.attention == "fused":
        if not extension.available():
            pytest.fail("the fused kernels did not build")  # no silent skip: test_fused.py says why
        fused.apply_fused_softmax(model)
    x, docs = windows()
    assert docs.max() >= 3  # several documents per window
    with torch.no_grad():
        ref, got, plain = alone(model, x, docs), model(x, None, docs), model(x)
    scale = ref.abs().max()
    assert ((got - ref).abs().max() / scale).item() < BOUND
    # without the mask: other documents leak in
    assert ((plain - ref).abs().max() / scale).item() > 100 * BOUND
