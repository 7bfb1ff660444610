"""Activation recompute: save less in forward, redo part of the forward in backward.

Idea (Chen et al. 2016; Korthikanti et al. 2022): backward needs what forward saved. Per transformer layer,
with 2-byte activations and 1-byte dropout masks (s sequence, b micro-batch, h hidden, a heads):

    none       sbh (34 + 5as/h) bytes = 11sbh + 5as^2b (attention) + 19sbh (MLP) + 4sbh (two LayerNorms)
    selective  34 sbh    recompute only softmax(QK^T)V with its dropout; its inputs Q, K, V are saved anyway
    full       2 sbh     keep only the layer's input; rerun the whole layer at the start of its backward

Compute price, in matmul FLOPs of one training step per layer (forward 24bsh^2 + 4bs^2h, backward twice
that): full reruns the forward, +1/3; selective reruns QK^T (2bs^2h), + s / (36h + 6s) -- the AV matmul is
not rerun because torch's non-reentrant checkpoint stops as soon as the last saved tensor is rebuilt (its
inputs are saved before it runs); Megatron's selective recompute reruns both (4bs^2h).
Both rely on torch.utils.checkpoint (non-reentrant) with the RNG state saved at forward and restored for
the rerun, so dropout draws the same masks and the gradients are bitwise those of no recompute.
The 34 and 5 assume Megatron's kernels (1-byte dropout masks, 2-byte softmax output); `activation_bytes`
takes the bytes per element as arguments, and `saved_bytes_per_layer` measures what autograd really keeps.
Lesson: lessons/07-activation-recompute.md
"""
import itertools

import torch
from torch.utils.checkpoint import checkpoint

MODES = ("none", "full", "selective")


def apply_recompute(model, mode: str, layers: int | None = None):
    """Recompute the first `layers` blocks this model holds (all when None): "full" wraps Block.forward,
    "selective" wraps CausalSelfAttention.core. Works in place; applying again replaces the previous mode.

    On a pipeline stage `model.blocks` holds only that stage's layers: "first k" means the first k layers
    held by this stage (Megatron's per-stage `--recompute-num-layers`); a stage holding fewer than k layers
    recomputes all of them. k may not exceed the model's n_layer.
    """
    if mode not in MODES:
        raise ValueError(f"--recompute {mode!r} is not one of {', '.join(MODES)}")
    n_layer = model.cfg.n_layer
    if layers is not None and not 0 <= layers <= n_layer:
        raise ValueError(f"--recompute-layers {layers} is outside [0, n_layer={n_layer}]; "
                         f"pass at most --n-layer, or leave it out to recompute every layer")
    for i, block in enumerate(model.blocks.values()):
        _unwrap(block, "forward")
        _unwrap(block.attn, "core")
        if mode == "none" or (layers is not None and i >= layers):
            continue
        if mode == "full":
            _wrap(block, "forward")
        else:
            _wrap(block.attn, "core")
    return model


def _wrap(module, name):
    """Replace module.<name> (per instance, so parameter names do not change) by a checkpointed call."""
    fn = getattr(module, name)  # the bound method, or a function another module swapped in

    def recomputed(*args):
        if not torch.is_grad_enabled():  # eval: nothing is saved anyway
            return fn(*args)
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)

    recomputed.recompute_prev = module.__dict__.get(name)  # an instance override to put back, or None
    setattr(module, name, recomputed)


def _unwrap(module, name):
    current = module.__dict__.get(name)
    if current is None or not hasattr(current, "recompute_prev"):
        return
    if current.recompute_prev is None:
        delattr(module, name)
    else:
        setattr(module, name, current.recompute_prev)


def recomputed_layers(model) -> dict:
    """{layer name: "full" | "selective"} for the blocks currently wrapped (for logs and tests)."""
    out = {}
    for key, block in model.blocks.items():
        if hasattr(block.__dict__.get("forward"), "recompute_prev"):
            out[key] = "full"
        elif hasattr(block.attn.__dict__.get("core"), "recompute_prev"):
            out[key] = "selective"
    return out


def activation_bytes(s, b, h, a, mode="none", act=2, mask=1, probs=2):
    """Bytes one layer saves for backward (dropout > 0), by Korthikanti et al.'s count, per element:
    act  activations (2 in bf16)                 11sbh + 19sbh + 4sbh -> (16 act + 2 mask) sbh
    mask each of the 2 + 1 dropout masks (1 as a CUDA bool mask; CPU torch keeps the mask in `act` bytes)
    probs the softmax output (2 with Megatron's fused softmax; model.causal_softmax keeps it in fp32: 4)
    The attention core adds (probs + mask + act) a s^2 b: the softmax output, its mask, its dropped output.
    """
    if mode == "full":
        return act * s * b * h
    linear = (16 * act + 2 * mask) * s * b * h
    return linear if mode == "selective" else linear + (probs + mask + act) * a * s * s * b


def saved_bytes_per_layer(model, run) -> dict:
    """Call run() (a forward) and return {block key: bytes autograd saved for backward while in that block}.

    Measured with torch.autograd.graph.saved_tensors_hooks: every tensor packed for backward, parameters and
    buffers excluded, each storage counted once at its full size (views of one tensor share a storage).
    """
    skip = {t.untyped_storage().data_ptr() for t in itertools.chain(model.parameters(), model.buffers())}
    storages, current = {}, [None]  # block key -> {storage pointer: bytes}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if current[0] is not None and ptr not in skip:
            storages.setdefault(current[0], {})[ptr] = t.untyped_storage().nbytes()
        return t

    def enter(key):
        return lambda module, args: current.__setitem__(0, key)

    hooks = [h for key, block in model.blocks.items()
             for h in (block.register_forward_pre_hook(enter(key)),
                       block.register_forward_hook(lambda *_: current.__setitem__(0, None)))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    finally:
        for h in hooks:
            h.remove()
    return {key: sum(storages.get(key, {}).values()) for key in model.blocks}
