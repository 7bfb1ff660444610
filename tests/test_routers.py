"""Issue 48: every router named for the models that use it, checked against transformers' own.

Claims (one process, no world; transformers builds its routers offline from small configs):
    rules     each rule of moe.ROUTERS routes as transformers' router of the model it is named after
              (the (T, E) matrix of weights, zero where not chosen): mixtral as MixtralTopKRouter,
              softmax_topk as Qwen2-MoE's and OLMoE's (norm_topk_prob False), softmax_topk_norm as
              Qwen3-MoE's, deepseek_v3 as DeepseekV3TopkRouter (4 groups, 2 allowed, a bias,
              scaling 2.5); and unlike every other model's -- but mixtral and softmax_topk_norm,
              one rule in two orders (equal to fp32 rounding, as the help says)
    groups    deepseek_v3 chooses within at most topk_group groups; without the limit it does not
    renamed   the old names compute the rule they computed (deepseek: softmax_topk_norm, qwen:
              softmax_topk); a checkpoint that recorded one resumes under the new name and no other;
              the command line maps one with a single line naming the new name
    gate      Qwen2-MoE's sparse block (shared expert x sigmoid gate) within 1e-5 of our MoE with
              --shared-expert-gate; without the gate ours differs by O(1)
    bias      in a bf16 model the routing bias stays fp32: 1000 updates of 1e-3 reach 1.0 (a bf16
              bias stalls at 0.5, where its spacing 2^-8 passes twice the step)
Tolerance: the same fp32 formulas in another order: 1e-6 on weights in [0, 2.5].
"""

import dataclasses

import pytest
import torch

from nanomega import moe, precision
from nanomega.gpt_config import GPTConfig
from nanomega.job import faults
from nanomega.model import GPT

T, E, K, H = 64, 16, 4, 16
GROUPS = (4, 2)  # deepseek_v3: 4 groups of 4 experts, 2 allowed per token


def dense(weights, experts):
    """(T, k) weights of (T, k) experts -> (T, E), zero where not chosen: order-free."""
    return torch.zeros(weights.shape[0], E).scatter(1, experts, weights)


def references():
    """{model: its transformers router, weights (E, H) and bias drawn from seed 0}."""
    transformers = pytest.importorskip("transformers", reason="the test extra: transformers")
    common = dict(hidden_size=H, num_experts_per_tok=K)
    routers = dict(
        mixtral=transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter(
            transformers.MixtralConfig(num_local_experts=E, **common)
        ),
        qwen2_moe=transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter(
            transformers.Qwen2MoeConfig(num_experts=E, norm_topk_prob=False, **common)
        ),
        olmoe=transformers.models.olmoe.modeling_olmoe.OlmoeTopKRouter(
            transformers.OlmoeConfig(num_experts=E, norm_topk_prob=False, **common)
        ),
        qwen3_moe=transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(
            transformers.Qwen3MoeConfig(num_experts=E, norm_topk_prob=True, **common)
        ),
        deepseek_v3=transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(
            transformers.DeepseekV3Config(
                n_routed_experts=E,
                n_group=GROUPS[0],
                topk_group=GROUPS[1],
                routed_scaling_factor=2.5,
                norm_topk_prob=True,
                **common,
            )
        ),
    )
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(E, H, generator=g), 0.05 * torch.randn(E, generator=g)
    with torch.no_grad():
        for r in routers.values():
            r.weight.copy_(weight)
        routers["deepseek_v3"].e_score_correction_bias.copy_(bias)
    return routers, weight, bias


# the rule each model's router computes (moe.ROUTERS)
RULE = dict(
    mixtral="mixtral",
    qwen2_moe="softmax_topk",
    olmoe="softmax_topk",
    qwen3_moe="softmax_topk_norm",
    deepseek_v3="deepseek_v3",
)


def ours(x, weight, bias, router):
    """Our route of x (T, H) as the (T, E) weight matrix (deepseek_v3: its bias and groups)."""
    v3 = router == "deepseek_v3"
    w, experts, _ = moe.route(
        x @ weight.T, K, router, bias if v3 else None, GROUPS if v3 else (1, 1), 2.5 if v3 else 1
    )
    return dense(w, experts)


def test_each_router_is_its_models_and_no_other():
    routers, weight, bias = references()
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = {m: dense(*r(x)[1:]) for m, r in routers.items()}
    for router in moe.ROUTERS:
        got = ours(x, weight, bias, router)
        for model, want in theirs.items():
            same = (got - want).abs().max().item() < 1e-6
            # mixtral's rule and softmax_topk_norm's are one rule (top-k of logits = of softmax)
            expected = RULE[model] == router or {RULE[model], router} == {
                "mixtral",
                "softmax_topk_norm",
            }
            assert same == expected, (router, model, (got - want).abs().max().item())


def test_deepseek_v3_chooses_within_topk_group_groups():
    g = torch.Generator().manual_seed(2)
    logits, bias = torch.randn(256, E, generator=g), torch.zeros(E)
    most = {}
    for limit in ((4, 1), GROUPS, (1, 1)):
        _, experts, probs = moe.route(logits, K, "deepseek_v3", bias, limit, 2.5)
        used = torch.stack([(experts // (E // 4) == i).any(-1) for i in range(4)], -1).sum(-1)
        most[limit] = used.max().item()  # the most groups one token uses
        assert torch.allclose(probs.sum(-1), torch.ones(256))  # the balance loss's affinities
    assert most == {(4, 1): 1, GROUPS: 2, (1, 1): 4}


def test_old_names_keep_their_rule_and_resume_under_the_new_one(capsys):
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(3))
    for old, new in (("deepseek", "softmax_topk_norm"), ("qwen", "softmax_topk")):
        (w0, e0, _), (w1, e1, _) = moe.route(logits, K, old), moe.route(logits, K, new)
        assert torch.equal(w0, w1) and torch.equal(e0, e1)
    assert not torch.allclose(
        dense(*moe.route(logits, K, "qwen")[:2]), dense(*moe.route(logits, K, "deepseek")[:2])
    )

    manifest = dict(step=1, layout=dict(router="deepseek"))
    assert faults.refusal("f", manifest, 9, dict(router="softmax_topk_norm")) is None
    assert "--router softmax_topk" in faults.refusal("f", manifest, 9, dict(router="softmax_topk"))

    from nanomega.job import checks, flags

    cfg = ["--arch", "llama", "--n-experts", "4", "--router", "qwen", "--device", "cpu"]
    config = checks.check(flags.parse(cfg))
    assert config.router == "softmax_topk"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--router qwen is now called softmax_topk" in err


def moe_cfg(**kw):
    return GPTConfig(
        vocab_size=64, n_layer=1, n_head=2, n_embd=H, arch="llama", ffn_hidden=24, **kw
    )


def test_qwen2_moe_shared_expert_gate():
    transformers = pytest.importorskip("transformers", reason="the test extra: transformers")
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    kw = dict(n_experts=E, top_k=K, router="softmax_topk", shared_experts=2)
    block = GPT(moe_cfg(shared_expert_gate=True, **kw), seed=4).blocks["0"].mlp
    theirs = Qwen2MoeSparseMoeBlock(
        transformers.Qwen2MoeConfig(
            hidden_size=H,
            num_experts=E,
            num_experts_per_tok=K,
            norm_topk_prob=False,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=48,
        )
    )
    f, g = 48, torch.Generator().manual_seed(6)
    with torch.no_grad():  # weights of std 0.3, so that the output is O(1)
        for p in block.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    gate_up, down = block.shared.gate_up.weight, block.shared.c_proj.weight
    with torch.no_grad():
        theirs.gate.weight.copy_(block.router.weight)
        theirs.experts.gate_up_proj.copy_(
            torch.stack([block.experts[str(e)].gate_up.weight for e in range(E)])
        )
        theirs.experts.down_proj.copy_(
            torch.stack([block.experts[str(e)].c_proj.weight for e in range(E)])
        )
        theirs.shared_expert.gate_proj.weight.copy_(gate_up[:f])
        theirs.shared_expert.up_proj.weight.copy_(gate_up[f:])
        theirs.shared_expert.down_proj.weight.copy_(down)
        theirs.shared_expert_gate.weight.copy_(block.shared_gate.weight)
        x = torch.randn(2, 8, H, generator=torch.Generator().manual_seed(5))
        want, got = theirs(x), block(x)
        block.shared_gate = None  # DeepSeek's rule: the shared experts added ungated
        ungated = block(x)
    assert (got - want).abs().max().item() < 1e-5
    assert (ungated - want).abs().max().item() > 0.1


def test_routing_bias_stays_fp32_in_a_bf16_model():
    cfg = moe_cfg(n_experts=4, top_k=2)
    model = precision.cast_model(GPT(cfg, seed=0), torch.bfloat16)
    layer = moe.layers(model)[0]
    assert layer.router.weight.dtype == torch.bfloat16
    loads = torch.tensor([[0.0, 2.0, 2.0, 4.0]])  # expert 0 under-loaded: its bias rises
    for _ in range(1000):
        moe.update_bias(model, loads, 1e-3)
    assert abs(layer.expert_bias[0].item() - 1.0) < 1e-4, layer.expert_bias  # bf16: 0.5
    assert layer.expert_bias.dtype == torch.float32


def test_group_flags_are_deepseek_v3s():
    with pytest.raises(ValueError, match="--router deepseek_v3"):
        moe.check(moe_cfg(n_experts=E, n_group=4))
    with pytest.raises(ValueError, match="--n-group 3"):
        moe.check(moe_cfg(n_experts=E, router="deepseek_v3", n_group=3, top_k=2))
    with pytest.raises(ValueError, match="--shared-experts"):
        moe.check(moe_cfg(n_experts=E, shared_expert_gate=True))
    moe.check(dataclasses.replace(moe_cfg(n_experts=E), router="deepseek_v3", n_group=4))
    with pytest.raises(ValueError, match="raise --topk-group"):
        moe.check(moe_cfg(n_experts=E, router="deepseek_v3", n_group=8, top_k=3))


def test_balance_coefficient_is_converted_to_and_from_transformers():
    """One layer, one sequence: transformers' Mixtral aux term (coefficient x load_balancing_loss,
    which is top_k x moe.balance_loss) equals ours after export, and import gives ours back."""
    pytest.importorskip("transformers", reason="the test extra: transformers")
    from nanomega.tools import hf_moe, hf_weights

    cfg = moe_cfg(n_experts=4, top_k=2, moe_aux_loss=0.01, tie_embeddings=False)
    model = GPT(cfg, seed=7).eval()
    theirs = hf_weights.to_hf({k: v.detach() for k, v in model.named_parameters()}, cfg)
    idx = torch.randint(0, cfg.vocab_size, (1, 32), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        model(idx)
        out = theirs(idx, output_router_logits=True)
    ours_term = cfg.moe_aux_loss * moe.layers(model)[0].last["aux"].item()
    theirs_term = theirs.config.router_aux_loss_coef * out.aux_loss.item()
    assert abs(theirs_term - ours_term) < 1e-6 * ours_term
    assert hf_moe.from_hf(theirs)[0].moe_aux_loss == pytest.approx(cfg.moe_aux_loss, rel=1e-12)


def test_deepseek_v3_flags_reach_the_block():
    from nanomega.job import checks, flags

    argv = ["--arch", "llama", "--n-experts", "8", "--router", "deepseek_v3", "--device", "cpu"]
    argv += ["--n-group", "4", "--topk-group", "2", "--routed-scaling", "2.5", "--n-embd", "32"]
    cfg = flags.model_config(checks.check(flags.parse(argv)))
    block = moe.layers(GPT(cfg, seed=0))[0]
    assert (block.router_kind, block.groups, block.scale) == ("deepseek_v3", (4, 2), 2.5)
    x = torch.randn(2, 8, cfg.n_embd, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert block(x).shape == x.shape
        w, _, _ = moe.route(
            block.router(x).flatten(0, 1), 2, block.router_kind, None, block.groups, block.scale
        )
    assert torch.allclose(w.sum(-1), torch.full((16,), 2.5))
