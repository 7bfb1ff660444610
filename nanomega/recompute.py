"""Activation recompute: save less in forward, redo part of the forward in backward.

Idea (Chen et al. 2016; Korthikanti et al. 2022): backward needs what forward saved. Full recompute
keeps only a layer's input and reruns the layer (the block's `layer` entry, checkpointed); selective
reruns only softmax(QK^T)V with its dropout (the attention `core` entry). Both are
torch.utils.checkpoint (non-reentrant) with the RNG state restored for the rerun: dropout draws the
same masks and the gradients are bitwise those of no recompute. ActivationMeter counts what autograd
really keeps.
Formula: bytes saved per layer (2-byte activations, 1-byte dropout masks, Megatron's kernels; one
home: formulas.activation_bytes_per_layer) and the compute price in matmul FLOPs of a step (forward
24bsh^2 + 4bs^2h, backward twice that):
    none       sbh (34 + 5as/h)   = 11sbh + 5as^2b (attention) + 19sbh (MLP) + 4sbh (two LayerNorms)
    selective  34 sbh             + s / (36h + 6s)   (reruns QK^T; AV is not rerun: lesson 11)
    full       2 sbh              + 1/3
Lesson: lessons/11-activation-recompute.md
"""

import itertools

import torch
from torch.utils.checkpoint import checkpoint

from .seams import describe

MODES = ("none", "full", "selective")


def apply_recompute(model, mode: str, layers: int | None = None):
    """Recompute the first `layers` blocks this model holds (all when None): "full" checkpoints
    the block's `layer` entry (its whole body), "selective" its attention `core` entry (seams.Ops).
    Works in place; applying again replaces the previous mode.

    On a pipeline stage `model.blocks` holds only that stage's layers: "first k" means the first k
    layers held by this stage (Megatron's per-stage `--recompute-num-layers`); a stage holding fewer
    than k layers recomputes all of them. k may not exceed the model's n_layer.
    """
    if mode not in MODES:
        raise ValueError(f"--recompute {mode!r} is not one of {', '.join(MODES)}")
    n_layer = model.cfg.n_layer
    if layers is not None and not 0 <= layers <= n_layer:
        raise ValueError(
            f"--recompute-layers {layers} is outside [0, n_layer={n_layer}]; "
            f"pass at most --n-layer, or leave it out to recompute every layer"
        )
    for i, (key, block) in enumerate(model.blocks.items()):
        for name in ("layer", "core"):  # undo a previous mode
            op = getattr(block.ops, name)
            if isinstance(op, Checkpointed):
                model.replace_op(name, op.inner, blocks=[key])
        if mode == "none" or (layers is not None and i >= layers):
            continue
        name = "layer" if mode == "full" else "core"
        model.replace_op(name, Checkpointed(getattr(block.ops, name)), blocks=[key])
    return model


class Checkpointed:
    """An op whose call is checkpointed (torch.utils.checkpoint, non-reentrant, the RNG state
    restored for the rerun): its forward keeps only its inputs, and backward reruns it."""

    def __init__(self, inner):
        self.inner = inner  # the entry it wraps, put back when the mode changes

    def __call__(self, *args):
        if not torch.is_grad_enabled():  # eval: nothing is saved anyway
            return self.inner(*args)
        return checkpoint(self.inner, *args, use_reentrant=False, preserve_rng_state=True)

    def __repr__(self):
        return f"recompute.Checkpointed({describe(self.inner)})"


class ActivationMeter:
    """Bytes of tensors autograd keeps for backward (parameters and buffers excluded; storages
    shared by several saved tensors counted once), live and peak: the activation memory a schedule
    holds.

        with ActivationMeter(model) as meter: train_step(...)      ->  meter.peak (bytes)

    blocks ({key: module}, e.g. model.blocks): also attribute every storage packed while inside a
    block's forward to that block, at its full size, in meter.per_block[key] = {storage pointer:
    bytes}.
    """

    def __init__(self, model, blocks=None):
        self.skip = {
            t.untyped_storage().data_ptr()
            for t in itertools.chain(model.parameters(), model.buffers())
        }
        self.storages, self.live, self.peak = (
            {},
            0,
            0,
        )  # data_ptr -> [saved tensors using it, bytes]
        self.blocks = blocks or {}
        self.per_block = {key: {} for key in self.blocks}
        self.current = None  # the block whose forward is running
        self._module_hooks = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self):
        for key, block in self.blocks.items():
            self._module_hooks.append(block.register_forward_pre_hook(self._enter(key)))
            self._module_hooks.append(block.register_forward_hook(self._leave))
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        for h in self._module_hooks:
            h.remove()
        self._module_hooks = []

    def _enter(self, key):
        return lambda module, args: setattr(self, "current", key)

    def _leave(self, module, args, output):
        self.current = None

    def _pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr == 0 or ptr in self.skip:
            return t
        if self.current is not None:
            self.per_block[self.current][ptr] = t.untyped_storage().nbytes()
        entry = self.storages.setdefault(ptr, [0, t.untyped_storage().nbytes()])
        if entry[0] == 0:
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        return _Saved(self, ptr, t)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, ptr):
        entry = self.storages[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.storages[ptr]


class _Saved:
    """A saved tensor; when autograd frees it (after its backward) the meter forgets its bytes."""

    def __init__(self, meter, ptr, tensor):
        self.meter, self.ptr, self.tensor = meter, ptr, tensor

    def __del__(self):
        self.meter._release(self.ptr)


def saved_bytes_per_layer(model, run) -> dict:
    """Call run() (a forward) and return {block key: bytes autograd saved for backward while in that
    block}, as ActivationMeter attributes them (each storage once per block, at its full size)."""
    with ActivationMeter(model, model.blocks) as meter:
        run()
    return {key: sum(storages.values()) for key, storages in meter.per_block.items()}
