"""The dense model's swappable ops: a table per block, and one call that replaces an entry.

Idea: the dense model computes with a few ops; each block (and the embedding, and the head) holds
them in a table, `Ops`. A technique replaces entries through GPT.replace_op, never a method or an
attribute of a module:
    entry       signature -> result                            replaced by
    linear      (x, weight, bias=None) -> x W^T + b            (FP8: every matmul of a weight)
    core        (attn, q, k, v, docs) -> (b, nh, s, hd)        context parallel, selective recompute
    softmax     (scores, scale) -> probs, the eager core's     fused kernels
    norm        LayerNorm (x, w, b, eps), RMSNorm (x, w, eps)  fused kernels
    activation  bias-GeLU (x, bias), SwiGLU (gate_up)          fused kernels
    loss        (logits, targets) -> mean loss                 tensor parallel (vocab-parallel)
    positions   (s) -> (s,) positions, None: 0 .. s-1          context parallel
    layer       (body, *args) -> body(*args)                   full recompute
The modules keep their parameters (names, shapes and initialization stay the dense model's) and call
the table: Linear is nn.Linear whose forward is ops.linear; tp.py's linears keep their communication
and call the same entry for their local matmul; one that runs its own backward (the sequence-parallel
linear) asks the entry for dX and dW by their roles (dgrad, wgrad). `print(model.ops_table())`
shows every entry.
Lesson: lessons/01-dense-model.md
"""

import functools
from dataclasses import dataclass, fields
from typing import Callable

import torch.nn as nn
import torch.nn.functional as F


def call(body, *args):
    """The default `layer` entry: run the block's body as it is (full recompute checkpoints it)."""
    return body(*args)


def in_order(s):
    """The default `positions` entry: None, the tokens 0 .. s-1 in order (the fast path)."""
    return None


def layer_norm(x, weight, bias, eps=1e-5):
    """LayerNorm over the last dim: nn.LayerNorm's forward as a function of its parameters."""
    return F.layer_norm(x, weight.shape, weight, bias, eps)


@dataclass
class Ops:
    """One table of swappable ops (the module docstring); an entry its piece does not use is
    None."""

    linear: Callable | None = None
    core: Callable | None = None
    softmax: Callable | None = None
    norm: Callable | None = None
    activation: Callable | None = None
    loss: Callable | None = None
    positions: Callable | None = None
    layer: Callable | None = None

    def replace(self, name, fn):
        """Replace entry `name` (an unknown name is an error, not a new entry)."""
        check_name(name)
        setattr(self, name, fn)

    def entries(self):
        """{name: fn} of the entries in use."""
        entries = {f.name: getattr(self, f.name) for f in fields(self)}
        return {name: fn for name, fn in entries.items() if fn is not None}


def describe(fn) -> str:
    """A short name for an entry: module.qualname ("model.sdpa_core", "F.linear"), a partial by its
    function, a wrapper (recompute.Checkpointed) by its repr."""
    if isinstance(fn, functools.partial):
        return describe(fn.func)
    if not hasattr(fn, "__qualname__"):
        return repr(fn)
    module = {"torch._C._nn": "F", "torch.nn.functional": "F"}.get(fn.__module__, fn.__module__)
    return f"{module.removeprefix('nanomega.')}.{fn.__qualname__}"


def check_name(name):
    """One line for a name that is no entry of the table."""
    names = [f.name for f in fields(Ops)]
    if name not in names:
        raise ValueError(f"no op {name!r}; the entries are {', '.join(names)}")


def replace(tables, name, fn, blocks=None):
    """Entry `name` becomes fn in every table of {key: Ops} using it (blocks: only these keys)."""
    check_name(name)
    for key, ops in tables.items():
        if (blocks is None or key in blocks) and getattr(ops, name) is not None:
            ops.replace(name, fn)


def render(tables) -> str:
    """One line per table and entry naming its function; consecutive blocks alike are one row."""
    rows = []  # [label, {entry: description}]
    for key, ops in tables.items():
        entries = {name: describe(fn) for name, fn in ops.entries().items()}
        if key.isdigit() and rows and rows[-1][0].startswith("blocks ") and rows[-1][1] == entries:
            rows[-1][0] = f"{rows[-1][0].split('-')[0]}-{key}"
        else:
            rows.append([f"blocks {key}" if key.isdigit() else key, entries])
    return "\n".join(
        f"{key:<12} {name:<10} {fn}" for key, entries in rows for name, fn in entries.items()
    )


def dgrad(linear, grad, weight):
    """dX = dY W by the linear entry, for a caller running its own backward (tp's sequence-parallel
    linear): the entry's own dgrad if it has one (fp8_linear.FP8: each operand in its role's
    format), else linear(dY, W^T)."""
    return linear.dgrad(grad, weight) if hasattr(linear, "dgrad") else linear(grad, weight.t())


def wgrad(linear, grad, x, weight):
    """dW = dY^T X likewise: the entry's own wgrad, else linear(dY^T, X^T) (tokens flattened)."""
    if hasattr(linear, "wgrad"):
        return linear.wgrad(grad, x, weight)
    return linear(grad.flatten(0, -2).t(), x.flatten(0, -2).t())


class Linear(nn.Linear):
    """nn.Linear (the same parameters, names, shapes and initialization) whose matmul is the
    entry."""

    def __init__(self, in_features, out_features, bias=True, *, ops: Ops):
        super().__init__(in_features, out_features, bias=bias)
        self.ops = ops

    def forward(self, x):
        return self.ops.linear(x, self.weight, self.bias)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (affine, over the last dim) whose arithmetic is ops.norm."""

    def __init__(self, h, eps=1e-5, *, ops: Ops):
        super().__init__(h, eps)
        self.ops = ops

    def forward(self, x):
        return self.ops.norm(x, self.weight, self.bias, self.eps)
