"""Solution of the flash exercise: lessons/12_flash.py:flash_forward."""

import importlib

import torch

tile_scores = importlib.import_module("12_flash").tile_scores  # lessons/ is on the grader's path


def flash_forward(q, k, v, block):
    b, a, s, d = q.shape
    out, lse = torch.empty_like(q), torch.empty(b, a, s, dtype=q.dtype)
    for i in range(s // block):
        m = torch.full((b, a, block), float("-inf"), dtype=q.dtype)  # running max per row
        l = torch.zeros(b, a, block, dtype=q.dtype)  # running sum of exp(score - m)
        acc = torch.zeros(b, a, block, d, dtype=q.dtype)  # running sum of exp(score - m) v
        for j in range(i + 1):  # causal: key blocks after the query block are never computed
            t = tile_scores(q, k, i, j, block)
            m_new = torch.maximum(m, t.amax(-1))
            p = torch.exp(t - m_new[..., None])
            rescale = torch.exp(m - m_new)  # 0 on the first tile (m = -inf), then <= 1
            l = l * rescale + p.sum(-1)
            acc = acc * rescale[..., None] + p @ v[..., j * block : (j + 1) * block, :]
            m = m_new
        out[..., i * block : (i + 1) * block, :] = acc / l[..., None]
        lse[..., i * block : (i + 1) * block] = m + torch.log(l)
    return out, lse
