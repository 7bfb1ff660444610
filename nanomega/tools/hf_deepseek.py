"""Hugging Face in and out for DeepSeek-V3: nanomega's Llama with latent attention (mla.py), dense
blocks before MoE ones (--first-k-dense) and the deepseek_v3 router <-> transformers'
DeepseekV3ForCausalLM.

A DeepSeek-V3 block is nanomega's Llama block with LatentAttention, and an MLP that is a SwiGLU of
intermediate_size in the first first_k_dense_replace blocks and moe.py's MoE after them (sigmoid
router, group-limited choice on score + e_score_correction_bias, normalized, x
routed_scaling_factor; n_shared_experts ungated shared experts). A model with latent attention and
no experts is the same class with every block dense (first_k_dense_replace = n_layer). The rotary
part: transformers rotates it interleaved (rope_interleave, DeepSeek's released layout) or in
rotate-half (ours); an interleaved folder is imported with the rotary rows of W_qb (W_q) and of
W_kva permuted (interleaved), and exported as rotate-half (rope_interleave false). The balance
loss: DeepSeek-V3's sequence-wise loss (arXiv 2412.19437, eq. 17-20) is alpha sum_i f_i P_i with
f_i = E / (k T) x the assignments of expert i, which is moe.balance_loss's E sum_e f_e P_e: the
coefficient travels unchanged, as DeepSeek's config.json names it (aux_loss_alpha; transformers'
class has no balance loss). What nanomega cannot compute is refused in one line.

    aux loss   alpha (aux_loss_alpha) = moe_aux_loss; absent: the paper's 1e-4 (Sec. 4.2)
    YaRN       rope_scaling yarn with mscale = mscale_all_dim = m (DeepSeek-V3: 1) <->
               --rope-type yarn --rope-mscale-all-dim m (mla.py: cos, sin unscaled, scores x
               mscale^2); neither given: nanomega's plain YaRN; any other RoPE scaling refused
    rotary     interleaved row j = rotate-half row (j odd: d_r/2 + j//2, even: j//2) of each head

Multi-token prediction: DeepSeek's checkpoint holds MTP module d as model.layers.{L + d}.* (enorm,
hnorm, eh_proj, a block of the block's names, shared_head.norm, and copies of the shared embedding
and head: embed_tokens, shared_head.head); a folder's are read and written so (mtp.py's Depth:
e_norm, h_norm, eh_proj, block, out_norm). transformers 5.24's class holds no MTP module: it skips
them on load (only the released model.layers.61.* without a report; other L: as unexpected keys),
so the in-memory conversion leaves them out. A folder's MoE MTP modules (DeepSeek-V3's, past
first_k_dense_replace) are skipped with one line: nanomega's are dense (mtp.check). A dense
export writes first_k_dense_replace L + D (DeepSeek's code makes a block past it MoE).

Per block i (model.layers.i.; the MoE's names as tools/hf_moe.py's, its router mlp.gate):
    blocks.i.attn.{q_a_proj, q_a_norm, q_b_proj | q_proj}   self_attn.{q_a_proj, q_a_layernorm,
                                                             q_b_proj | q_proj}
    blocks.i.attn.{kv_a_proj, kv_a_norm, kv_b_proj, c_proj}  self_attn.{kv_a_proj_with_mqa,
                                                             kv_a_layernorm, kv_b_proj, o_proj}
    blocks.i.mlp.gate_up / c_proj  (i < k)       mlp.gate_proj, up_proj / down_proj
    blocks.i.mlp.shared.gate_up / c_proj         mlp.shared_experts.gate_proj, up_proj / down_proj
    blocks.i.mlp.expert_bias (E,)                mlp.gate.e_score_correction_bias
Lesson: lessons/16-experts.md
"""

import dataclasses
import functools

import torch

from nanomega import moe
from nanomega.gpt_config import GPTConfig
from nanomega.tools.hf_llama import hf_rope, llama_config, llama_name_map
from nanomega.tools.hf_moe import expert_tensors, named_tensors, padded, part, unstacked

# ours -> transformers' names of the latent attention's pieces (self_attn.)
ATTENTION = {
    "q_proj": "q_proj",
    "q_a_proj": "q_a_proj",
    "q_a_norm": "q_a_layernorm",
    "q_b_proj": "q_b_proj",
    "kv_a_proj": "kv_a_proj_with_mqa",
    "kv_a_norm": "kv_a_layernorm",
    "kv_b_proj": "kv_b_proj",
    "c_proj": "o_proj",
}
# ours -> DeepSeek's names of an MTP module's own pieces (model.layers.{L + d}.; its block's
# names are a block's); the released checkpoint also holds copies of the shared embedding and
# head there (embed_tokens, shared_head.head): written on export, read as the shared ones
MTP = {
    "e_norm.weight": "enorm.weight",
    "h_norm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "out_norm.weight": "shared_head.norm.weight",
}
SHARED = {
    "embed.wte.weight": "embed_tokens.weight",
    "head.lm_head.weight": "shared_head.head.weight",
}
GATE_UP = ("gate", "up")
# transformers normalizes the two latents with this eps whatever rms_norm_eps says
LATENT_EPS = 1e-6
# why a RoPE scaling other than YaRN with mscale = mscale_all_dim (DeepSeek-V3's: 1 and 1) is refused
YARN = (
    "nanomega reads DeepSeek's YaRN (rope_type yarn, mscale = mscale_all_dim: cos and sin "
    "unscaled, every score x mscale^2, transformers' yarn_apply_mscale; --rope-mscale-all-dim) or "
    "plain YaRN (neither given)"
)
ALPHA = 1e-4  # DeepSeek-V3's balance coefficient (arXiv 2412.19437 Sec. 4.2), where none is given


def interleaved(module, w, cfg, inverse=False):
    """W's rotary rows in DeepSeek's interleaved order (x_0, x_{d/2}, x_1, ...) from our
    rotate-half one (inverse: back): each head's last d_r rows of W_qb (W_q), the last d_r of
    W_kva; any other module's W unchanged."""
    d_n, d_r, _ = cfg.mla_dims
    order = torch.arange(d_r).view(2, -1).t().flatten()  # interleaved row j <- rotate-half row
    order = order.argsort() if inverse else order
    if module in ("q_proj", "q_b_proj"):
        heads = w.view(cfg.n_head, d_n + d_r, -1)
        return torch.cat((heads[:, :d_n], heads[:, d_n:][:, order]), 1).flatten(0, 1)
    if module == "kv_a_proj":
        return torch.cat((w[: cfg.kv_lora_rank], w[cfg.kv_lora_rank :][order]))
    return w


def deepseek_v3_config(c: dict, mtp=0) -> GPTConfig:
    """The GPTConfig of a transformers DeepSeek-V3 config (its dict) with `mtp` MTP modules; what
    nanomega cannot compute: one line."""
    layers, k = (
        c["num_hidden_layers"],
        min(c.get("first_k_dense_replace") or 0, c["num_hidden_layers"]),
    )
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    rule = rope.get("rope_type", rope.get("type", "default"))
    m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
    deepseek_yarn = rule == "yarn" and m == m_all and (m or 0) > 0
    bad = [
        why
        for is_bad, why in [
            (
                not c.get("norm_topk_prob", True),
                "norm_topk_prob false (nanomega's deepseek_v3 normalizes the chosen scores)",
            ),
            (
                c.get("scoring_func", "sigmoid") != "sigmoid"
                or c.get("topk_method", "noaux_tc") != "noaux_tc",
                "scoring_func / topk_method other than sigmoid / noaux_tc (DeepSeek-V3's)",
            ),
            (c.get("moe_layer_freq", 1) != 1, "moe_layer_freq (nanomega: every block after k)"),
            (
                rule not in ("default", "yarn")
                or (rule == "yarn" and (m or m_all) and not deepseek_yarn),
                f"RoPE scaling {rule!r} with mscale {m}, mscale_all_dim {m_all}: {YARN}",
            ),
            (
                (c.get("quantization_config") or {}).get("quant_method") is not None,
                "quantization_config (block-scaled FP8 weights with their weight_scale_inv: "
                "dequantize them to bf16 first, as DeepSeek's fp8_cast_bf16.py does)",
            ),
            (
                c.get("rms_norm_eps", LATENT_EPS) != LATENT_EPS,
                f"rms_norm_eps {c.get('rms_norm_eps')} (transformers normalizes the latents with "
                f"{LATENT_EPS}; nanomega: one eps)",
            ),
        ]
        if is_bad
    ]
    if bad:
        raise ValueError(
            f"this DeepSeek-V3 differs from nanomega's: {'; '.join(bad)}; it cannot be imported "
            f"exactly"
        )

    # the Llama part (head_dim is d_r there; MLA has no key/value heads), then MLA and the MoE
    moe_blocks = k < layers
    f = c["moe_intermediate_size"] if moe_blocks else c["intermediate_size"]
    # DeepSeek's YaRN: the Llama part reads plain YaRN; the score scale is MLA's
    key = "rope_parameters" if c.get("rope_parameters") else "rope_scaling"
    plain = {k: v for k, v in rope.items() if k not in ("mscale", "mscale_all_dim")}
    base = llama_config({**c, key: plain or None, "head_dim": None, "intermediate_size": f})
    mla = dict(
        mtp_num_layers=mtp,
        rope_mscale_all_dim=float(m_all) if deepseek_yarn else 0.0,
        moe_aux_loss=c.get("aux_loss_alpha", ALPHA),
        n_kv_head=0,
        kv_lora_rank=c["kv_lora_rank"],
        q_lora_rank=c.get("q_lora_rank") or 0,
        qk_nope_head_dim=c["qk_nope_head_dim"],
        qk_rope_head_dim=c["qk_rope_head_dim"],
        v_head_dim=c["v_head_dim"],
    )
    if not moe_blocks:
        return dataclasses.replace(base, **mla)
    return dataclasses.replace(
        base,
        **mla,
        n_experts=c["n_routed_experts"],
        top_k=c["num_experts_per_tok"],
        router="deepseek_v3",
        n_group=c.get("n_group") or 1,
        topk_group=c.get("topk_group") or 1,
        routed_scaling=float(c.get("routed_scaling_factor", 1.0)),
        shared_experts=c.get("n_shared_experts") or 0,
        first_k_dense=k,
        dense_ffn_hidden=c["intermediate_size"] if k else 0,
    )


def rope_table(cfg: GPTConfig):
    """The rope_scaling table of cfg (hf_llama.hf_rope's), DeepSeek's YaRN with its mscale and
    mscale_all_dim; None without scaling."""
    table = hf_rope(cfg)
    m = cfg.rope_mscale_all_dim
    return table | dict(mscale=m, mscale_all_dim=m) if table and m else table


def check(cfg: GPTConfig):
    """One line for a latent-attention model transformers' DeepseekV3ForCausalLM cannot hold."""
    if cfg.n_experts and moe.rule(cfg.router) != "deepseek_v3":
        raise ValueError("DeepSeek-V3 routes with --router deepseek_v3: train with it to export")
    if cfg.shared_expert_gate or cfg.capacity_factor:
        raise ValueError(
            "DeepSeek-V3 has no --shared-expert-gate and drops no token (--capacity-factor)"
        )
    if cfg.norm_eps != LATENT_EPS or (cfg.rope_scaling != 1.0 and cfg.rope_type != "yarn"):
        raise ValueError(
            f"DeepSeek-V3's transformers class normalizes the latents with eps {LATENT_EPS}, and "
            f"nanomega exports its RoPE scaling as YaRN only: train with --norm-eps {LATENT_EPS} "
            "and --rope-type yarn (or no --rope-scaling) to export"
        )


def block_names(cfg: GPTConfig, ours, theirs, experts):
    """{nanomega name: (transformers names)} of one block: ours, theirs its two prefixes
    ("blocks.i.", "model.layers.i."); experts: an MoE block (its experts apart: hf_tensors)."""
    out = {
        ours + "ln_1.weight": (theirs + "input_layernorm.weight",),
        ours + "ln_2.weight": (theirs + "post_attention_layernorm.weight",),
    }
    for mine, name in ATTENTION.items():
        if mine not in ("q_proj", "q_a_proj", "q_a_norm", "q_b_proj") or (
            (mine == "q_proj") != bool(cfg.q_lora_rank)
        ):
            out[f"{ours}attn.{mine}.weight"] = (f"{theirs}self_attn.{name}.weight",)
    if not experts:
        out[ours + "mlp.gate_up.weight"] = tuple(f"{theirs}mlp.{p}_proj.weight" for p in GATE_UP)
        out[ours + "mlp.c_proj.weight"] = (theirs + "mlp.down_proj.weight",)
        return out
    out[ours + "mlp.router.weight"] = (theirs + "mlp.gate.weight",)
    out[ours + "mlp.expert_bias"] = (theirs + "mlp.gate.e_score_correction_bias",)
    if cfg.shared_experts:
        shared = f"{theirs}mlp.shared_experts."
        out[ours + "mlp.shared.gate_up.weight"] = tuple(f"{shared}{p}_proj.weight" for p in GATE_UP)
        out[ours + "mlp.shared.c_proj.weight"] = (shared + "down_proj.weight",)
    return out


def names(cfg: GPTConfig, mtp=True):
    """{nanomega name: (transformers names)} of every weight but the stacked experts (routing
    biases included); mtp: with the MTP modules, model.layers.{L + d}.* (a folder holds them,
    transformers' class does not)."""
    out = dict(llama_name_map(0, cfg.tie_embeddings))  # the embedding, final norm, (head)
    for i in range(cfg.n_layer):
        out |= block_names(cfg, f"blocks.{i}.", f"model.layers.{i}.", cfg.is_moe(i))
    for d in range(cfg.mtp_num_layers if mtp else 0):
        ours, theirs = f"mtp.depths.{d}.", f"model.layers.{cfg.n_layer + d}."
        out |= {ours + k: (theirs + v,) for k, v in MTP.items()}
        out |= block_names(cfg, ours + "block.", theirs, experts=False)  # mtp.check: dense
    return out


def hf_model(cfg: GPTConfig):
    """(transformers DeepseekV3Config, DeepseekV3ForCausalLM, names(cfg)) of a latent-attention
    Llama (rotate-half rotary rows: rope_interleave false)."""
    import transformers

    check(cfg)
    v, (d_n, d_r, d_v), D = cfg.vocab_size, cfg.mla_dims, cfg.mtp_num_layers
    hf_cfg = transformers.DeepseekV3Config(
        vocab_size=v,
        hidden_size=cfg.n_embd,
        intermediate_size=cfg.dense_ffn if cfg.n_experts else cfg.ffn,
        moe_intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_head,
        n_shared_experts=cfg.shared_experts,
        n_routed_experts=cfg.n_experts or 2,  # unused without MoE blocks
        routed_scaling_factor=cfg.routed_scaling,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        num_experts_per_tok=cfg.top_k,
        # dense blocks: all, the MTP modules' too (DeepSeek's code makes a block past it MoE)
        first_k_dense_replace=cfg.first_k_dense if cfg.n_experts else cfg.n_layer + D,
        norm_topk_prob=True,
        kv_lora_rank=cfg.kv_lora_rank,
        q_lora_rank=cfg.q_lora_rank or None,
        qk_nope_head_dim=d_n,
        qk_rope_head_dim=d_r,
        v_head_dim=d_v,
        max_position_embeddings=cfg.block_size,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        rope_scaling=rope_table(cfg),
        rope_interleave=False,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        num_mtp_layers=D,  # config.json: num_nextn_predict_layers, DeepSeek's name
        aux_loss_alpha=cfg.moe_aux_loss,  # DeepSeek's own config.json key (module docstring)
        seq_aux=True,
        bos_token_id=v - 1,
        eos_token_id=v - 1,
    )
    hf_cfg.architectures = ["DeepseekV3ForCausalLM"]
    return hf_cfg, transformers.DeepseekV3ForCausalLM, names(cfg)


def hf_tensors(cfg: GPTConfig, mtp=True):
    """[(transformers name, [nanomega names], make)] of a DeepSeek-V3 (hf_weights.hf_tensors);
    mtp: with the MTP modules and their copies of the shared embedding and head, as DeepSeek's
    checkpoint holds them."""
    head = "embed.wte.weight" if cfg.tie_embeddings else "head.lm_head.weight"
    copy = functools.partial(part, 0, 1, True, cfg.vocab_size)  # the first V rows
    copies = [
        (f"model.layers.{cfg.n_layer + d}.{theirs}", [head if "head" in ours else ours], copy)
        for d in range(cfg.mtp_num_layers if mtp else 0)
        for ours, theirs in SHARED.items()
    ]
    return (
        named_tensors(names(cfg, mtp), cfg.vocab_size)
        + expert_tensors(cfg, filter(cfg.is_moe, range(cfg.n_layer)))
        + copies
    )


def expected_tensors(cfg: GPTConfig, found):
    """{name: shape} of every tensor a DeepSeek-V3 folder of cfg holds (hf_check), from our model's
    shapes (meta: nothing allocated); found: the folder's {name: (shape, file)}, whose MTP modules
    nanomega does not read (cfg without them: MoE ones) are taken as they are, as transformers
    skips them."""
    from nanomega.model import GPT

    with torch.device("meta"):
        ours = GPT(cfg, seed=0).state_dict()
    ours["head.lm_head.weight"] = ours.get("head.lm_head.weight", ours["embed.wte.weight"])
    want = {
        name: tuple(make([ours[n] for n in mine]).shape) for name, mine, make in hf_tensors(cfg)
    }
    skipped = {
        k: s for k, (s, _) in found.items() if mtp_layer(k, cfg.n_layer) >= cfg.mtp_num_layers
    }
    if any(".mlp.experts.0.gate_proj." in k for k in found):  # as transformers saves: per expert
        want = dict(per_expert(want))
    return want | skipped


def per_expert(want):
    """(name, shape) of {name: shape} with each layer's stacked experts (E, 2f, h), (E, h, f) as
    transformers saves them: experts.j.{gate, up}_proj (f, h), experts.j.down_proj (h, f)."""
    for name, shape in want.items():
        if name.endswith("experts.gate_up_proj"):
            e, f2, h = shape
            stem = name.removesuffix("gate_up_proj")
            yield from (
                (f"{stem}{j}.{p}_proj.weight", (f2 // 2, h)) for j in range(e) for p in GATE_UP
            )
        elif name.endswith("experts.down_proj"):
            stem = name.removesuffix("down_proj")
            yield from ((f"{stem}{j}.down_proj.weight", shape[1:]) for j in range(shape[0]))
        else:
            yield name, shape


def mtp_layer(name, n_layer):
    """d of a tensor in MTP module d (model.layers.{n_layer + d}.*), else -1."""
    layer = name.split(".")[2] if name.startswith("model.layers.") else ""
    return int(layer) - n_layer if layer.isdigit() and int(layer) >= n_layer else -1


def mtp_depths(c: dict, found):
    """(the MTP modules nanomega reads from a folder, why any it holds are skipped or None): c its
    config.json, found its tensors' names. The modules whose tensors are there (transformers
    writes num_mtp_layers 1 and no module); an MoE block in one (DeepSeek-V3's) is skipped, as
    transformers skips them, nanomega's being dense (mtp.check)."""
    layers, k = c["num_hidden_layers"], c.get("first_k_dense_replace") or 0
    D = c.get("num_nextn_predict_layers", c.get("num_mtp_layers")) or 0
    held = [d for d in range(D) if f"model.layers.{layers + d}.eh_proj.weight" in found]
    if held and layers + max(held) >= k:  # DeepSeek's code: a block past k is MoE
        return 0, (
            f"its {len(held)} MTP module(s) model.layers.{layers}+ hold MoE blocks, which "
            f"nanomega's MTP modules do not (dense only; transformers skips them too): skipped"
        )
    return len(held), None


def from_hf(model, mtp=None):
    """(GPTConfig, nanomega full weights and routing biases) from a transformers
    DeepseekV3ForCausalLM; an interleaved one's rotary rows permuted to rotate-half. mtp: a
    folder's MTP modules' tensors {transformers name: tensor} (the class holds none), or None."""
    mtp = mtp or {}
    depths = len(
        {mtp_layer(k, model.config.num_hidden_layers) for k in mtp if k.endswith(".eh_proj.weight")}
    )
    cfg = deepseek_v3_config(model.config.to_dict(), depths)
    theirs = {k: t.detach().float() for k, t in model.state_dict().items()}
    theirs |= {k: t.float() for k, t in mtp.items()}
    weights = {ours: torch.cat([theirs[n] for n in hf]) for ours, hf in names(cfg).items()}
    if model.config.rope_interleave:
        for name in weights:
            module = name.split(".")[-2]
            if ".attn." in name:
                weights[name] = interleaved(module, weights[name], cfg, inverse=True)

    experts = unstacked(theirs, cfg, filter(cfg.is_moe, range(cfg.n_layer)))
    return cfg, padded(weights | experts, cfg)
