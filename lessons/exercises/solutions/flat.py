"""Solution of exercise flat (lessons/exercises/flat.py): what nanomega/flat.py does, written
out."""

import torch


def flatten(self, tensors, dtype=None):
    # (N S,), padding stays 0
    out = torch.zeros(self.padded, dtype=dtype or self.dtype, device=self.device)
    for t, o in zip(tensors, self.offsets):
        out[o : o + t.numel()].copy_(t.detach().reshape(-1))
    return out


def views(self, flat):
    return [flat[o : o + n].view(s) for o, n, s in zip(self.offsets, self.sizes, self.shapes)]


def pieces(self):
    for i, (o, n) in enumerate(zip(self.offsets, self.sizes)):
        # parameter [o, o + n) meets this rank's [lo, hi)
        a, b = max(o, self.lo), min(o + n, self.hi)
        if a < b:
            yield i, a, b


def split_by_size(named_params, cap_bytes, alone=()):
    buckets, current, size = [], [], 0
    for name, p in named_params:
        bytes_ = p.numel() * p.element_size()
        solo = any(p is q for q in alone)
        if current and (
            solo
            or size + bytes_ > cap_bytes
            or p.dtype != current[0][1].dtype
            or any(q is current[0][1] for q in alone)
        ):
            buckets.append(current)
            current, size = [], 0
        current.append((name, p))
        size += bytes_
    return buckets + ([current] if current else [])
