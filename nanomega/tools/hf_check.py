"""The one checked way in from Hugging Face: a folder's config.json, its tensors and its tokenizer
files checked before a weight is read into a model, and before anything is written.

Idea: an import trusts nothing in the folder. Each refusal is one ValueError line naming the file
and the field or the tensor (tools/hf.py turns it into one line on stderr, exit 2):
    config.json   JSON and an object; each field nanomega reads present (or one transformers
                  defaults), of its type, in its range (FIELDS); then the shape as training checks
                  it (GPTConfig.validate, moe.check), its flags named by the file's fields
    tensors       every tensor the config implies present with its exact shape, nothing else
                  (read from the safetensors headers: no weight is loaded)
    the load      transformers' own report (output_loading_info): any missing, unexpected or
                  mismatched key refused by name; its progress bars, warnings and logging kept off
                  the console (quiet)
Formulas (the tensors a config implies, per block; hd = h / heads, f the MLP width):
    llama    q, o (h, h)   k, v (kv hd, h)   gate, up (f, h)   down (h, f)   norms (h)
    qwen2    a llama's + biases q (h), k, v (kv hd);   qwen3: a llama's + q_norm, k_norm (hd)
    mixtral  router (E, h); experts (E, 2f, h) and (E, h, f), or per expert w1, w3 (f, h), w2 (h, f)
    qwen2_moe  mixtral's stacked experts; shared gate, up (n f, h), down (h, n f); its gate (1, h)
    qwen3_moe  qwen3's attention, mixtral's stacked experts; mlp_only_layers: llama's MLP (f_dense)
    olmoe    mixtral's stacked experts; q_norm (h), k_norm (kv hd)
    deepseek_v3  what hf_deepseek writes for our model's shapes (+ the MTP modules it skips)
    gpt2     c_attn (h, 3h)  c_fc (h, 4h)  c_proj (h, h), (4h, h): Conv1D's (in, out), biases
Lesson: lessons/02-the-modern-block.md
"""

import contextlib
import json
import re
import warnings
from pathlib import Path

import torch

from nanomega import moe
from nanomega.tools import hf_deepseek
from nanomega.tools.hf_fields import FIELD_OF_FLAG, FIELDS

# the weights files transformers reads, in its order of preference: (the shards' index, one file)
WEIGHTS = (
    ("model.safetensors.index.json", "model.safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model.bin"),
)
# tensors a folder may hold that transformers ignores: GPT-2's causal-mask buffers, old Llamas'
# rotary frequencies
IGNORED = re.compile(r"\.attn\.(masked_)?bias$|\.rotary_emb\.inv_freq$")


def read_json(path):
    """The JSON object in `path`, or one line naming the file."""
    try:
        value = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not JSON ({e}); copy or export the folder again") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: a JSON {type(value).__name__}, not an object")
    return value


def check_fields(path, c, kind):
    """Each field nanomega reads of a `kind` config.json (dict c): present, of its type, in
    range."""
    for field, (required, (what, ok)) in FIELDS[kind].items():
        if c.get(field) is None:
            if required:
                raise ValueError(f"{path}: no {field} (nanomega reads it: {what})")
            continue
        if not ok(c[field]):
            raise ValueError(f"{path}: {field} {c[field]!r} must be {what}")


def check_shape(path, cfg, kind):
    """The GPTConfig read from `path` checked as training checks it (its validation and the MoE
    checks), the refusal naming the file's fields."""
    try:
        cfg.validate()
        moe.check(cfg)
    except ValueError as e:
        table = FIELD_OF_FLAG["gpt2" if kind == "gpt2" else "llama"]
        flags = re.findall(r"--([a-z-]+)", str(e))
        fields = [table[f.replace("-", "_")] for f in flags if f.replace("-", "_") in table]
        named = f" (in this file: {', '.join(dict.fromkeys(fields))})" if fields else ""
        raise ValueError(f"{path}: {e}, as nanomega reads it{named}; fix the file") from None
    return cfg


def expected_tensors(cfg, kind, names):
    """{name: shape} of every tensor a `kind` folder of GPTConfig cfg holds; names: the folder's
    (which of Mixtral's two expert layouts, and GPT-2's prefix)."""
    v, h, f, L = cfg.vocab_size, cfg.n_embd, cfg.ffn, cfg.n_layer
    if kind == "deepseek_v3":  # from our model's shapes (and the MTP modules it skips)
        return hf_deepseek.expected_tensors(cfg, names)
    if kind == "gpt2":
        out = {"wte.weight": (v, h), "wpe.weight": (cfg.block_size, h)}
        out |= {"ln_f.weight": (h,), "ln_f.bias": (h,)}
        block = {"ln_1.weight": (h,), "ln_1.bias": (h,), "ln_2.weight": (h,), "ln_2.bias": (h,)}
        block |= {"attn.c_attn.weight": (h, 3 * h), "attn.c_attn.bias": (3 * h,)}
        block |= {"attn.c_proj.weight": (h, h), "attn.c_proj.bias": (h,)}
        block |= {"mlp.c_fc.weight": (h, f), "mlp.c_fc.bias": (f,)}
        block |= {"mlp.c_proj.weight": (f, h), "mlp.c_proj.bias": (h,)}
        out |= {f"h.{i}.{k}": s for i in range(L) for k, s in block.items()}
        # transformers writes GPT-2 under transformer.; OpenAI's files have no prefix
        prefix = "transformer." if any(n.startswith("transformer.") for n in names) else ""
        return {prefix + k: s for k, s in out.items()}

    # a Llama (a Mixtral's attention and norms are a Llama's)
    kv = cfg.kv_heads * (h // cfg.n_head)
    out = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (v, h)
    block = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
    block |= {"self_attn.q_proj.weight": (h, h), "self_attn.o_proj.weight": (h, h)}
    block |= {"self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h)}
    if cfg.qkv_bias:  # Qwen2
        block |= {"self_attn.q_proj.bias": (h,), "self_attn.k_proj.bias": (kv,)}
        block["self_attn.v_proj.bias"] = (kv,)
    if cfg.qk_norm:  # Qwen3
        block |= {"self_attn.q_norm.weight": (h // cfg.n_head,)}
        block["self_attn.k_norm.weight"] = (h // cfg.n_head,)
    if cfg.qk_norm_whole:  # OLMoE: over the whole projections
        block |= {"self_attn.q_norm.weight": (h,), "self_attn.k_norm.weight": (kv,)}
    # Qwen3-MoE's first blocks (mlp_only_layers): a dense MLP of their own width
    dense = {"mlp.gate_proj.weight": (cfg.dense_ffn, h), "mlp.up_proj.weight": (cfg.dense_ffn, h)}
    dense["mlp.down_proj.weight"] = (h, cfg.dense_ffn)
    first = {f"model.layers.{i}.{k}": s for i in range(cfg.first_k_dense) for k, s in dense.items()}
    if not cfg.n_experts:  # a dense MLP: Llama, Qwen2, Qwen3
        block |= {"mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h)}
        block["mlp.down_proj.weight"] = (h, f)
    elif any(".block_sparse_moe." in n for n in names):  # Mixtral as released (and saved by HF)
        e = cfg.n_experts
        block["block_sparse_moe.gate.weight"] = (e, h)
        for j in range(e):
            w = f"block_sparse_moe.experts.{j}."
            block |= {w + "w1.weight": (f, h), w + "w3.weight": (f, h), w + "w2.weight": (h, f)}
    elif any(".mlp.experts.0.gate_proj." in n for n in names):  # Qwen2-MoE as saved: per expert
        block["mlp.gate.weight"] = (cfg.n_experts, h)
        for j in range(cfg.n_experts):
            w = f"mlp.experts.{j}."
            block |= {w + "gate_proj.weight": (f, h), w + "up_proj.weight": (f, h)}
            block[w + "down_proj.weight"] = (h, f)
    else:  # transformers 5's stacked experts
        block["mlp.gate.weight"] = (cfg.n_experts, h)
        block["mlp.experts.gate_up_proj"] = (cfg.n_experts, 2 * f, h)
        block["mlp.experts.down_proj"] = (cfg.n_experts, h, f)
    if kind == "qwen2_moe":  # the shared experts, one SwiGLU n f wide, and their (1, h) gate
        nf = f * cfg.shared_experts
        block |= {
            "mlp.shared_expert.gate_proj.weight": (nf, h),
            "mlp.shared_expert_gate.weight": (1, h),
        }
        block |= {
            "mlp.shared_expert.up_proj.weight": (nf, h),
            "mlp.shared_expert.down_proj.weight": (h, nf),
        }
    experts = {k for k in block if k.startswith("mlp.")} if cfg.n_experts else set()
    blocks = {
        f"model.layers.{i}.{k}": s
        for i in range(L)
        for k, s in block.items()
        if cfg.is_moe(i) or k not in experts  # the first_k_dense blocks: `first`'s MLP
    }
    return out | blocks | first


def tensor_shapes(src):
    """{name: (shape, file)} of the folder's weights files (safetensors, or PyTorch's .bin; one, or
    the shards its index lists), read from their headers (.bin: memory-mapped): no weight is
    read."""
    from safetensors import safe_open

    src = Path(src)
    for index, single in WEIGHTS:
        if (src / index).is_file():
            weight_map = read_json(src / index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{src / index}: no weight_map object")
            files = sorted(set(weight_map.values()))
            break
        if (src / single).is_file():
            files = [single]
            break
    else:
        raise ValueError(
            f"{src}: no model.safetensors nor pytorch_model.bin (nor their index); save_pretrained "
            f"writes one"
        )

    shapes = {}
    for name in files:
        try:
            if name.endswith(".safetensors"):
                with safe_open(src / name, "pt") as f:
                    shapes |= {k: (tuple(f.get_slice(k).get_shape()), name) for k in f.keys()}
            else:
                state = torch.load(src / name, map_location="cpu", mmap=True, weights_only=True)
                shapes |= {k: (tuple(t.shape), name) for k, t in state.items()}
        except Exception as e:  # truncated, missing or another format: the library's own type
            first = (str(e).strip().splitlines() or [""])[0][:200]
            raise ValueError(
                f"{src}: its weights cannot be read ({src / name}: {type(e).__name__}: {first}); "
                f"copy or export the folder again"
            ) from None
    return shapes


def _listed(what, items):
    """'2 tensors missing: a, b' (the first three named)."""
    n = f"{len(items)} tensor{'s' if len(items) > 1 else ''}"
    return f"{n} {what}: " + ", ".join(items[:3]) + (", ..." if len(items) > 3 else "")


def check_tensors(src, cfg, kind):
    """Every tensor the config implies present with its shape, nothing else: one line naming the
    file and the first tensors that differ."""
    found = tensor_shapes(src)
    want = expected_tensors(cfg, kind, found)
    tied = "lm_head.weight" if cfg.tie_embeddings else None  # an old save's copy: tied anyway
    missing = [f"{k} {want[k]}" for k in want if k not in found]
    extra = [k for k in found if k not in want and k != tied and not IGNORED.search(k)]
    wrong = [
        f"{k} {found[k][0]} (config.json: {want[k]})"
        for k in want
        if k in found and found[k][0] != want[k]
    ]
    # the file named: the one holding a tensor that differs, else the folder's one weights file
    # (sharded: its index)
    held = sorted({f for _, f in found.values()}) or ["model.safetensors"]
    index = WEIGHTS[0 if held[0].endswith(".safetensors") else 1][0]
    files = sorted({found[k][1] for k in extra + [w.split()[0] for w in wrong]})
    files = files or (held if len(held) == 1 else [index])
    problems = [
        _listed(what, items)
        for what, items in (
            ("missing", missing),
            ("unexpected", extra),
            ("of another shape", wrong),
        )
        if items
    ]
    if problems:
        raise ValueError(
            f"{Path(src) / files[0]}: {'; '.join(problems)}; nanomega imports a folder "
            f"whose weights are all there, as its config.json says"
        )


def check_load_report(src, info):
    """transformers' loading info (from_pretrained(..., output_loading_info=True)): anything it
    did not load as saved, named."""
    problems = [
        _listed(what, sorted(map(str, info.get(key) or ())))
        for key, what in (
            ("missing_keys", "missing (transformers would draw them at random)"),
            ("unexpected_keys", "unexpected"),
            ("mismatched_keys", "of another shape"),
            ("error_msgs", "not loaded"),
        )
        if info.get(key)
    ]
    if problems:
        raise ValueError(f"{src}: transformers' load report: {'; '.join(problems)}")


@contextlib.contextmanager
def quiet(transformers):
    """transformers' progress bars, warnings and logging off the console (restored after): a
    problem is ours to name, in one line."""
    log = transformers.utils.logging
    verbosity, bars = log.get_verbosity(), log.is_progress_bar_enabled()
    log.set_verbosity(log.CRITICAL + 1)
    log.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.set_verbosity(verbosity)
        if bars:
            log.enable_progress_bar()
