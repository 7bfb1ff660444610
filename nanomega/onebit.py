"""1-bit Adam: after a warm-up, the momentum crosses the data-parallel link as signs, not floats.

Adam's variance v settles early in training; once frozen, Adam is a momentum method with a fixed
per-element step size, and the momentum tolerates a biased compressor if the compression error is
carried into the next step (error feedback). Tang et al. 2021, "1-bit Adam: Communication
Efficient Large-Scale Training with Adam's Convergence Speed" (arXiv:2102.02888), Algorithm 1;
DeepSpeed's OnebitAdam and its compressed all-reduce are the reference implementation.
    warm-up (step <= W)  the engine averages g over dp; AdamW as usual (m, v, bias corrections)
    after W              v (and its bias correction) frozen; each rank's LOCAL g:
                         m <- b1 m + (1 - b1) g;  m <- compressed_mean(m);  p <- p - lr m^ / (sqrt(v^) + eps)
    compress(x)          per chunk of n: signs (0 counts as +), scale s = |x|_1 / n: the multiple of
                         the signs nearest x, so |x - C(x)|^2 = |x|^2 - |x|_1^2 / n < |x|^2, a
                         contraction (Karimireddy et al. 2019, "Error Feedback Fixes SignSGD",
                         arXiv:1901.09847; DeepSpeed takes s = |x|_2 / sqrt(n), not one)
    compressed_mean      worker: x = m + e_w, send chunk j's signs + scale to rank j (all-to-all),
                         e_w <- x - C(x); server j: y = mean of the N chunks + e_s, e_s <- y - C(y),
                         all-gather C(y)'s signs + scales
    wire bytes per rank  2 (N-1)/N n/8 + 8 (N-1)  (n: momentum elements, padded to 8 N)
                         vs fp32 all-reduce 2 (N-1)/N 4 n: 32x fewer
The errors e_w, e_s live here, not in the optimizer state: a checkpoint holds AdamW's m, v, step
(a resume starts the errors at zero, as DeepSpeed's does). Stage 0 only (the momentum is whole).
Lesson: lessons/18-one-bit-adam.md
"""

import math

import torch

WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)  # bit i of a byte: 2^i


def pack(bits):
    """A bool tensor of 8k elements -> k bytes, element 8j + i in bit i of byte j."""
    return (bits.view(-1, 8).to(torch.uint8) * WEIGHTS.to(bits.device)).sum(1, dtype=torch.uint8)


def unpack(codes):
    """k bytes -> 8k signs as +-1.0 (bit set: +1)."""
    bits = codes.unsqueeze(1).bitwise_and(WEIGHTS.to(codes.device)).ne(0)
    return bits.view(-1).float() * 2 - 1


def compress(x, chunks):
    """x (n elements, n a multiple of 8 chunks) -> (sign codes, n/8 bytes; one fp32 scale per
    chunk: its mean |x|, summed in fp64 and rounded once)."""
    rows = x.view(chunks, -1)
    scales = (rows.double().abs().sum(1) / rows.shape[1]).float()
    return pack(x >= 0), scales


def decompress(codes, scales):
    """The compressed tensor: each chunk's signs times its scale (fp32)."""
    return (unpack(codes).view(scales.numel(), -1) * scales.unsqueeze(1)).view(-1)


def padded(n, world):
    """Elements the compressed all-reduce moves: n padded to a multiple of 8 x world."""
    return -(-n // (8 * world)) * 8 * world


def wire_bytes(n, world):
    """Bytes one rank sends per compressed mean of n elements (dist.RING's counting): signs and
    scales all-to-all, then all-gathered."""
    if world == 1:
        return 0.0
    return 2 * (world - 1) / world * padded(n, world) / 8 + 2 * 4 * (world - 1)


class CompressedMean:
    """The error-compensated compressed mean over an Axis (the paper's compressed all-reduce):
    worker error over the whole buffer, server error over this rank's chunk."""

    def __init__(self, axis, n, device=None):
        self.axis, self.n, self.padded = axis, n, padded(n, axis.size)
        self.worker_error = torch.zeros(self.padded, device=device)  # (n_pad,)
        self.server_error = torch.zeros(self.padded // axis.size, device=device)  # (n_pad / N,)

    def __call__(self, m):
        """m (n,) fp32 -> the compressed mean over the axis (n,), the errors carried."""
        world, chunk = self.axis.size, self.padded // self.axis.size
        x = torch.nn.functional.pad(m, (0, self.padded - self.n)) + self.worker_error  # (n_pad,)

        # worker: compress, keep the error, send chunk j's signs and scale to rank j
        codes, scales = compress(x, world)  # (n_pad/8,) uint8, (N,)
        self.worker_error = x - decompress(codes, scales)
        got, got_scales = torch.empty_like(codes), torch.empty_like(scales)
        self.axis.all_to_all(got, codes)  # (N chunks of n_pad/8N,) every rank's chunk of mine
        self.axis.all_to_all(got_scales, scales)

        # server: the mean of my chunk over the ranks, its error carried, compressed again
        y = decompress(got, got_scales).view(world, chunk).sum(0) / world + self.server_error
        codes, scale = compress(y, 1)  # (n_pad/8N,), (1,)
        self.server_error = y - decompress(codes, scale)

        # everyone: every server's chunk
        all_codes = codes.new_empty(world * codes.numel())
        all_scales = scale.new_empty(world)
        self.axis.all_gather(all_codes, codes)
        self.axis.all_gather(all_scales, scale)
        return decompress(all_codes, all_scales)[: self.n]


class OneBitAdam(torch.optim.Optimizer):
    """AdamW for `warmup` steps, then 1-bit Adam (see the module docstring). Options: lr, betas,
    eps, weight_decay (decoupled), warmup. The engine (zero.ZeroEngine, stage 0) calls
    communicate(axis): the momentum's axis; while `local` is true it leaves the gradients local."""

    DEFAULTS = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, warmup=100)

    def __init__(self, params, **options):
        super().__init__(params, dict(self.DEFAULTS, **options))
        self.mean = None  # CompressedMean once communicate() gives the axis

    def communicate(self, axis):
        """The axis the momentum is averaged over after the warm-up (the gradients' dp axis)."""
        params = [p for g in self.param_groups for p in g["params"]]
        self.mean = CompressedMean(axis, sum(p.numel() for p in params), params[0].device)

    def steps(self):
        """Steps taken (every parameter's state agrees)."""
        for group in self.param_groups:
            for p in group["params"]:
                if "step" in self.state[p]:
                    return int(self.state[p]["step"])
        return 0

    def local(self):
        """Whether the next step's gradients stay local (the warm-up is over): the engine asks."""
        return self.steps() >= self.param_groups[0]["warmup"]

    @torch.no_grad()
    def step(self, closure=None):
        frozen = self.local()
        params = [(g, p) for g in self.param_groups for p in g["params"]]

        # the momentum (both phases), the variance (warm-up only)
        for group, p in params:
            state, (b1, b2) = self.state[p], group["betas"]
            if not state:
                state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p))
                state["exp_avg_sq"] = torch.zeros_like(p)
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            state["step"] += 1
            state["exp_avg"].lerp_(g, 1 - b1)
            if not frozen:
                state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)

        # after the warm-up: the momenta averaged over the ranks, compressed (one flat buffer)
        if frozen and self.mean is not None:
            momenta = [self.state[p]["exp_avg"] for _, p in params]
            flat = self.mean(torch.cat([m.reshape(-1) for m in momenta]))
            for m, v in zip(momenta, flat.split([m.numel() for m in momenta])):
                m.copy_(v.view_as(m))

        # the update: v's bias correction stops at the warm-up's last step
        for group, p in params:
            state, (b1, b2) = self.state[p], group["betas"]
            t = int(state["step"])
            bc1, bc2 = 1 - b1**t, 1 - b2 ** min(t, group["warmup"])
            p.mul_(1 - group["lr"] * group["weight_decay"])
            denom = (state["exp_avg_sq"].sqrt() / math.sqrt(bc2)).add_(group["eps"])  # AdamW's
            p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / bc1)


def check(stage, offload, ep, pp, dtype):
    """One line for what 1-bit Adam cannot take here, or None."""
    if stage:
        return (
            f"--optimizer onebit with --zero {stage}: 1-bit Adam compresses the whole momentum "
            f"of each rank (as DeepSpeed's, which takes no ZeRO); use --zero 0"
        )
    if offload or ep > 1 or pp > 1:
        return (
            "--optimizer onebit with --offload / --ep / --pp: built for one replica group over "
            "dp x cp (dense weights only, no host step); leave those out"
        )
    if dtype == "fp16":
        return (
            "--optimizer onebit with --dtype fp16: after the warm-up each rank's gradient is "
            "local, and the loss scaler's skip decision would differ per rank; use bf16"
        )
    return None
