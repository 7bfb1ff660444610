"""Solution of the ring exercise: lessons/03_collectives.py:ring_all_reduce."""

import torch


def ring_all_reduce(ax, x):
    n, r = ax.size, ax.rank
    chunks, buf = list(x.chunk(n)), torch.empty(x.numel() // n, dtype=x.dtype)
    right, left = (r + 1) % n, (r - 1) % n
    for step in range(n - 1):  # after this, rank r holds the full sum of chunk (r + 1) % n
        ax.p2p(sends=[(chunks[(r - step) % n].clone(), right)], recvs=[(buf, left)])
        chunks[(r - step - 1) % n] += buf
    for step in range(n - 1):
        ax.p2p(sends=[(chunks[(r + 1 - step) % n].clone(), right)], recvs=[(buf, left)])
        chunks[(r - step) % n].copy_(buf)
    return x
