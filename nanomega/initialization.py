"""Initialization by parameter name: the dense model's values as a function of (seed, name, i),
so any rank draws any slice of them.

Idea: a rule per parameter name (init_std: GPT-2's) and a draw in which element i of a parameter
depends on (seed, name, i) alone (draw): the flattened parameter is cut into blocks of INIT_BLOCK
elements, each drawn whole by a CPU generator seeded from (seed, name, block). Neither the
parameter's size, nor its layout (a tp slice, a pipeline stage, a ZeRO-3 shard), nor the device
changes a value: GPT.init_weights (model.py) draws each parameter whole, meta.py each rank's slices,
bitwise the same values.
Formulas:
    std(name)   0.02 / sqrt(2 L) for c_proj (attention's output, the MLP's down), 0.02 for every
                other matrix, 0 for biases (zeros), None for norm scales (ones)
    w[i]        block(seed, name, i // 2^16)[i mod 2^16], each block 2^16 normals N(0, std) from a
                generator seeded by sha256(f"{seed}/{name}/{block}")
Lesson: lessons/15-3d-parallelism.md
"""

import functools
import hashlib
import math

import torch


# elements one generator draws: any element of a parameter is drawn with its block alone
INIT_BLOCK = 1 << 16


def init_std(name, n_layer):
    """GPT-2's initialization as a rule of a parameter's dense name (the same name in every layout):
    biases 0.0, norm scales (LayerNorm, RMSNorm) None (ones), residual projections (c_proj:
    attention's output, the MLP's down) N(0, 0.02/sqrt(2L)), every other matrix N(0, 0.02) -- for
    Llama's q_proj, kv_proj, gate_up too."""
    module, leaf = (["", ""] + name.split("."))[-2:]
    if leaf in ("bias", "fc_bias"):
        return 0.0
    if module.startswith("ln") or module.endswith("_norm"):  # Qwen3's q_norm, k_norm too
        return None
    return 0.02 / math.sqrt(2 * n_layer) if module == "c_proj" else 0.02


@functools.lru_cache(maxsize=4)  # consecutive runs of a tensor-parallel slice often share a block
def init_block(seed, name, k, std):
    """Block k of parameter `name`: INIT_BLOCK normals from a CPU generator seeded by (seed, name,
    k)."""
    key = int.from_bytes(hashlib.sha256(f"{seed}/{name}/{k}".encode()).digest()[:8], "little") >> 1
    return torch.empty(INIT_BLOCK, device="cpu").normal_(
        0.0, std, generator=torch.Generator().manual_seed(key)
    )


def draw(seed, name, std, start, stop):
    """Elements [start, stop) of the flattened parameter `name`, fp32 on the CPU: N(0, std) (0.0:
    zeros, None: ones). A block is always drawn whole, so element i depends on (seed, name, i) only:
    not on the parameter's size (a vocabulary padded further keeps its rows), nor the layout, nor
    the device (drawn on the host). It does depend on the host's vector kernels for normal_: AVX2
    and AVX-512 draw the same bits, a CPU without AVX2 (ATEN_CPU_CAPABILITY=default) others. The
    host holds one block beyond what it returns."""
    out = torch.empty(stop - start, device="cpu")
    if std is None or std == 0.0:
        return out.fill_(1.0 if std is None else 0.0)
    for k in range(start // INIT_BLOCK, -(-stop // INIT_BLOCK)):
        lo, hi = max(start, k * INIT_BLOCK), min(stop, (k + 1) * INIT_BLOCK)
        out[lo - start : hi - start] = init_block(seed, name, k, std)[
            lo - k * INIT_BLOCK : hi - k * INIT_BLOCK
        ]
    return out
