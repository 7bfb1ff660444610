"""Multi-head latent attention (MLA; DeepSeek-V2, arXiv 2405.04434 Sec. 2.1; DeepSeek-V3, arXiv
2412.19437 Sec. 2.1.1): keys and values rebuilt from one small latent per token.

Idea: instead of 2 a d_h key/value numbers per token and layer, a token keeps a latent c_kv (d_c)
and one rotary key k_r (d_r) that every head shares; each head's no-rope key and its value are c_kv
times an up-projection. RoPE cannot pass through that up-projection (the inference form folds it
into the query), so the position lives in the decoupled k_r alone. Queries go through a low-rank
latent too (d_q, with its RMSNorm), or one projection when q_lora_rank = 0. Training computes the
expanded form below; transformers' DeepseekV3Attention is the same arithmetic, its rotary part
rotated in rotate-half layout (rope_interleave = false; an interleaved checkpoint is the same model
with its rotary rows permuted).
Formulas (h hidden, a heads, d_n / d_r / d_v the no-rope, rotary and value head sizes):
    q          = RMSNorm(x W_qa) W_qb                      (a (d_n + d_r));  d_q = 0: x W_q
    [c_kv, k_r] = x W_kva                                  (d_c + d_r)
    [k_n, v]   = RMSNorm(c_kv) W_kvb                       (a (d_n + d_v))
    head i     softmax([q_n,i, R q_r,i] . [k_n,i, R k_r] / sqrt(d_n + d_r), causal) v_i;  out W_o
    YaRN       DeepSeek's (--rope-mscale-all-dim m): R unscaled, every score x (0.1 m ln s + 1)^2,
               applied to q (transformers' yarn_apply_mscale; s the --rope-scaling factor)
    parameters h d_q + d_q + d_q a (d_n + d_r) + h (d_c + d_r) + d_c + d_c a (d_n + d_v) + a d_v h
    KV cache   (d_c + d_r) elements per token and layer    (multi-head: 2 a d_h)
    tensor parallel: W_qb (or W_q), W_kvb by heads, W_o by rows; W_qa, W_kva and both norms whole
               on every rank, each rank's heads' share of their gradient summed over tp (tp.py)
Lesson: lessons/02-the-modern-block.md
"""

import torch
import torch.nn as nn

from .modern import RMSNorm
from .seams import Linear, Ops


class LatentAttention(nn.Module):
    """The Llama block's attention as MLA: CausalSelfAttention's interface (forward, project, core;
    n_head, head_dim, attn_drop, slopes for the cores), its parameters named as below."""

    def __init__(self, cfg, ops: Ops, rotary):
        super().__init__()
        h, a, eps = cfg.n_embd, cfg.n_head, cfg.norm_eps
        self.nope, self.rope, self.v_dim = cfg.mla_dims
        self.kv_lora = cfg.kv_lora_rank
        # the cores read n_head and head_dim (their scale 1/sqrt(d_n + d_r)); no ALiBi
        self.n_head, self.head_dim, self.slopes = a, self.nope + self.rope, None
        self.ops, self.rotary = ops, rotary
        self.score_scale = cfg.mla_score_scale  # DeepSeek's YaRN (gpt_config); 1: none
        q_out = a * self.head_dim
        if cfg.q_lora_rank:  # queries through their latent: down, RMSNorm, up
            self.q_a_proj = Linear(h, cfg.q_lora_rank, bias=False, ops=ops)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, eps, ops=ops)
            self.q_b_proj = Linear(cfg.q_lora_rank, q_out, bias=False, ops=ops)  # (a, d_n + d_r)
        else:
            self.q_proj = Linear(h, q_out, bias=False, ops=ops)
        # keys and values: the latent and the shared rotary key, then each head's k_n and v
        self.kv_a_proj = Linear(h, self.kv_lora + self.rope, bias=False, ops=ops)
        self.kv_a_norm = RMSNorm(self.kv_lora, eps, ops=ops)
        kv_out = a * (self.nope + self.v_dim)  # laid out (a, d_n + d_v)
        self.kv_b_proj = Linear(self.kv_lora, kv_out, bias=False, ops=ops)
        self.c_proj = Linear(a * self.v_dim, h, bias=False, ops=ops)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x, docs=None, positions=None):  # SP: x (b, s/tp, h), gathered in project
        q, k, v = self.project(x, positions)  # (b, a, s, d_n + d_r) twice, (b, a, s, d_v)
        b, s = q.shape[0], q.shape[2]
        y = self.core(q, k, v, docs).transpose(1, 2).reshape(b, s, self.n_head * self.v_dim)
        return self.resid_drop(self.c_proj(y))

    def project(self, x, positions=None):
        # queries, each head's [no-rope | rotary] parts
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))  # (b, s, a (d_n + d_r))
        b, s = q.shape[:2]
        q_n, q_r = q.view(b, s, -1, self.head_dim).transpose(1, 2).split([self.nope, self.rope], -1)

        # the latent and the shared rotary key; each head's no-rope key and value from the latent
        c_kv, k_r = self.kv_a_proj(x).split(
            [self.kv_lora, self.rope], -1
        )  # (b, s, d_c), (b, s, d_r)
        kv = self.kv_b_proj(self.kv_a_norm(c_kv)).view(b, s, -1, self.nope + self.v_dim)
        k_n, v = kv.transpose(1, 2).split([self.nope, self.v_dim], -1)  # (b, a, s, d_n), (.., d_v)

        # rotary positions on the rotary parts only; k_r is one head that every head reads
        pos = self.ops.positions(s) if positions is None else positions
        q_r, k_r = self.rotary(q_r, pos), self.rotary(k_r[:, None], pos)  # k_r (b, 1, s, d_r)
        q = torch.cat((q_n, q_r), -1)
        if self.score_scale != 1.0:  # DeepSeek's YaRN: every score x mscale^2, through q
            q = q * self.score_scale
        k = torch.cat((k_n, k_r.expand(-1, k_n.shape[1], -1, -1)), -1)
        return q, k, v.contiguous()

    def core(self, q, k, v, docs=None):
        """The table's attention core on this module's heads (what selective recompute
        recomputes)."""
        return self.ops.core(self, q, k, v, docs)
