"""Issue 48: the planner's time and activation models count DeepSeek-V3's pieces -- latent
attention (mla.py), the MTP modules on the last stage (mtp.py) and the first first_k_dense blocks'
dense MLP (moe.py) -- as the trainer's FLOPs formula does.

Claim: with a time model that prices one FLOP at one second (matmul fraction 1, no memory-bound
term, no recompute, eager attention, one GPU, one micro-batch), tools/cost_time.step_time's step is
formulas.model_flops_per_token x the micro-batch's tokens (the count MFU uses, which test_mtp and
test_mla hold equal to torch's FlopCounterMode), less what the time model leaves out by design:
the RMSNorm scales (2h a block, h the final norm, 3h an MTP module) and, for experts, the router's
E x h (the stand-in, cost_moe.stand_in, is the dense Llama of the active width). Exact (float64
sums of integers). Planted, each pricing left out fails it.
"""

import dataclasses

import pytest

from nanomega import formulas
from nanomega.tools import cost, cost_moe, cost_time

ONE_FLOP = cost_time.TimeModel(matmul=1.0, elem=0.0, score=0.0)
GPU = cost.GPU(peak_flops=1.0, memory=1e30, hbm_bw=1.0, intra_bw=1.0, inter_bw=1.0)
RUN = cost.Run(global_batch=1, micro_batch=1, recompute="none", attention="eager", sp=False)
MLA = dict(kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
BASE = dict(n_layer=4, n_embd=64, n_head=4, vocab_size=256, seq_len=32, arch="llama")
MOE = dict(n_experts=8, top_k=2, shared_experts=1, first_k_dense=1, dense_ffn_hidden=96)


def step_flops(model):
    priced = cost_moe.stand_in(model) if model.n_experts else model
    return cost_time.step_time(priced, GPU, 1, 1, 1, 0, RUN, ONE_FLOP).step


def formula_flops(model):
    """The trainer's count, less the norms' scales and the router (left out by design)."""
    cfg, h, s = model.config(), model.n_embd, model.seq_len
    norms = 2 * h * model.n_layer + h + 5 * h * model.mtp_num_layers
    router = model.n_experts * h * cost_moe.moe_layers(model)
    return s * formulas.model_flops_per_token(cfg, s) - 6 * s * (norms + router)


@pytest.mark.parametrize(
    "shape",
    [dict(MLA), dict(MLA, mtp_num_layers=2), dict(MLA, **MOE), dict(MOE), dict(ffn_hidden=80)],
    ids=["mla", "mla-mtp", "mla-moe-dense", "moe-dense", "llama"],
)
def test_step_time_prices_the_formulas_flops(shape):
    model = cost.Model(**BASE, **shape)
    assert step_flops(model) == pytest.approx(formula_flops(model), rel=1e-12, abs=0)


@pytest.mark.parametrize(
    "plant", ["multi-head core", "no MTP", "dense blocks as MoE"], ids=lambda p: p.replace(" ", "-")
)
def test_a_pricing_left_out_fails(plant, monkeypatch):
    shape = dict(MLA, mtp_num_layers=2) if plant == "no MTP" else dict(MLA, **MOE)
    model = cost.Model(**BASE, **shape)
    if plant == "multi-head core":
        monkeypatch.setattr(cost_time, "core_widths", lambda m: (m.n_embd, m.n_embd))
    elif plant == "no MTP":
        model = dataclasses.replace(model, mtp_num_layers=0)
    else:
        monkeypatch.setattr(
            cost_moe,
            "stand_in",
            lambda m: dataclasses.replace(
                m, n_experts=0, ffn_hidden=(m.top_k + m.shared_experts) * m.ffn, first_k_dense=0
            ),
        )
    want = formula_flops(cost.Model(**BASE, **shape))
    assert step_flops(model) != pytest.approx(want, rel=1e-6)
