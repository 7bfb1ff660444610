"""Fused C++ kernels vs the PyTorch reference: values, gradients, odd shapes, bf16/fp16, the whole GPT, nvcc.

The extension is built once into fused.build_dir() (cold ~45 s, then ~0.05 s for every later test,
process, lesson and bench run); the CUDA sources are compiled, never run: there is no GPU here.
"""
import copy
import hashlib
import os
import shutil
import subprocess
import sysconfig

import pytest
import torch
import torch.nn.functional as F
from torch.utils import cpp_extension

from nanomega import fused, model
from nanomega.model import GPT, GPTConfig

# fp32 tolerances vs an fp64 reference: the kernels' exp is at::vec's exp_u20 (a few ulp) and their
# sums run in another order than PyTorch's, so agreement is to ~1e-6 relative, not bitwise
FP32 = dict(rtol=1e-5, atol=2e-6)
# bf16 / fp16 in and out, fp32 inside: one rounding of each output (2^-8 / 2^-11 relative) dominates
LOW = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float16: dict(rtol=3e-3, atol=3e-3)}


@pytest.fixture(scope="module")
def ext():
    """The one cached build; a build failure is a test failure here, not a skip."""
    return fused.load_extension()


def ln_ref(x, w, b):
    return F.layer_norm(x, w.shape, w, b, 1e-5)


def cases():
    """(name, fused op, reference, input shapes): widths 1, 7, 33, 1000, 4099, single rows, s_q < s_k."""
    for shape in [(4, 1), (3, 7), (1, 33), (2, 5, 1000), (1, 4099)]:
        h = shape[-1]
        yield pytest.param(fused.layer_norm, ln_ref, [shape, (h,), (h,)], id=f"layer_norm{shape}")
        yield pytest.param(fused.bias_gelu, model.bias_gelu, [shape, (h,)], id=f"bias_gelu{shape}")
    for shape in [(1, 1, 1), (2, 3, 7, 7), (2, 33, 33), (1, 5, 40), (1, 1, 4099), (1, 3, 70, 70)]:
        yield pytest.param(lambda s: fused.causal_softmax(s, 0.37), lambda s: model.causal_softmax(s, 0.37),
                           [shape], id=f"causal_softmax{shape}")


def run(op, inputs, grad):
    inputs = [t.detach().requires_grad_() for t in inputs]
    out = op(*inputs)
    out.backward(grad)
    return [out] + [t.grad for t in inputs]


@pytest.mark.parametrize("op,ref,shapes", cases())
def test_forward_backward_fp32(ext, op, ref, shapes):
    torch.manual_seed(0)
    inputs = [torch.randn(s) * 3 for s in shapes]  # * 3: GeLU's tails and the softmax's spread matter
    grad = torch.randn(ref(*inputs).shape)
    got, eager = run(op, inputs, grad), run(ref, inputs, grad)
    want = run(ref, [t.double() for t in inputs], grad.double())
    for g, e, w in zip(got, eager, want):
        assert g.dtype == torch.float32
        # ill-conditioned cases (LayerNorm of width 1: rstd = 1/sqrt(eps) amplifies rounding) get the
        # slack that eager fp32 PyTorch itself needs on the same inputs, x4
        slack = 4 * (e.double() - w).abs().max().item()
        torch.testing.assert_close(g.double(), w, rtol=FP32["rtol"], atol=FP32["atol"] + slack)


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("op,ref,shapes", cases())
def test_low_precision_matches_fp32_reference(ext, op, ref, shapes, dtype):
    torch.manual_seed(0)
    inputs = [torch.randn(s).to(dtype) for s in shapes]
    grad = torch.randn(ref(*inputs).shape).to(dtype)
    got = run(op, inputs, grad)
    want = run(ref, [t.float() for t in inputs], grad.float())
    for g, w in zip(got, want):
        assert g.dtype == dtype
        # parameter grads are sums over rows: their error grows like sqrt(rows) roundings of dx
        tol = LOW[dtype]
        torch.testing.assert_close(g.float(), w, rtol=tol["rtol"], atol=tol["atol"] * max(1, g.numel() ** 0.25))


def test_gradcheck_fp64(ext):
    torch.manual_seed(0)
    x = torch.randn(3, 2, 9, dtype=torch.float64, requires_grad=True)
    w, b = (torch.randn(9, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(lambda x, w, b: fused.layer_norm(x, w, b, 1e-5), (x, w, b))
    assert torch.autograd.gradcheck(fused.bias_gelu, (x, b))
    s = torch.randn(2, 5, 9, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s: fused.causal_softmax(s, 0.6), (s,))


def test_empty_inputs(ext):
    x, b = torch.randn(0, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    fused.bias_gelu(x, b).sum().backward()
    fused.layer_norm(x, torch.ones(8), b, 1e-5).sum().backward()
    assert b.grad.shape == (8,) and (b.grad == 0).all()
    assert fused.causal_softmax(torch.randn(0, 4, 4), 1.0).shape == (0, 4, 4)


def test_causal_softmax_never_reads_masked_scores(ext):
    s = torch.randn(2, 6, 6)
    s_inf = s.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("inf"))  # future = inf
    probs = fused.causal_softmax(s_inf, 0.5)
    torch.testing.assert_close(probs, model.causal_softmax(s, 0.5), **FP32)
    assert (probs.triu(1) == 0).all()


def test_bad_inputs_name_the_problem(ext):
    with pytest.raises(RuntimeError, match="s_q <= s_k"):
        fused.causal_softmax(torch.randn(5, 3), 1.0)
    with pytest.raises(RuntimeError, match=r"x.shape\[-1\] must equal bias.numel\(\)"):
        fused.bias_gelu(torch.randn(2, 4), torch.randn(5))
    with pytest.raises(RuntimeError, match="weight is BFloat16"):
        fused.layer_norm(torch.randn(2, 4), torch.ones(4).bfloat16(), torch.zeros(4), 1e-5)


@pytest.mark.parametrize("alibi", [False, True], ids=["learned-pos", "alibi+embed-ln"])
def test_gpt_with_fused_matches_gpt(ext, alibi):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=300, block_size=32, n_layer=2, n_head=4, n_embd=64, alibi=alibi,
                    embed_layernorm=alibi)
    ref = GPT(cfg)
    gpt = copy.deepcopy(ref)
    ln_weight = gpt.blocks["0"].ln_1.weight
    assert fused.apply_fused(gpt)
    assert isinstance(gpt.blocks["0"].ln_1, fused.FusedLayerNorm) and gpt.blocks["0"].ln_1.weight is ln_weight
    n_ln = sum(isinstance(m, fused.FusedLayerNorm) for m in gpt.modules())
    assert n_ln == 2 * cfg.n_layer + 1 + alibi and not any(type(m) is torch.nn.LayerNorm for m in gpt.modules())
    assert all(b.mlp.bias_gelu is fused.bias_gelu and b.attn.scale_mask_softmax is fused.causal_softmax
               for b in gpt.blocks.values())
    assert list(gpt.state_dict()) == list(ref.state_dict())

    idx = torch.randint(0, cfg.vocab_size, (3, 32))
    targets = torch.randint(0, cfg.vocab_size, (3, 32))
    # the same fp32 math in another order (see FP32) through 2 blocks: here logits and gradients differ
    # by < 5e-7 absolute; the tolerances leave 2-4x for other CPUs' vector widths
    torch.testing.assert_close(gpt(idx), ref(idx), rtol=1e-5, atol=2e-6)
    for m in (gpt, ref):
        m(idx, targets).backward()
    torch.testing.assert_close(gpt(idx, targets), ref(idx, targets), rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(gpt.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-5, atol=1e-6, msg=name)


def test_build_failure_falls_back_to_pytorch(monkeypatch, capsys):
    def broken(verbose=False):
        raise RuntimeError("Error building extension 'nanomega_fused_cpu'\nc++: not found")

    monkeypatch.setattr(fused, "load_extension", broken)
    fused._ext.cache_clear()
    try:
        gpt = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2))
        assert not fused.apply_fused(gpt)
        assert fused.available() is False
        assert type(gpt.blocks["0"].ln_1) is torch.nn.LayerNorm and gpt.blocks["0"].mlp.bias_gelu is model.bias_gelu
        x, b = torch.randn(2, 8), torch.randn(8)
        assert torch.equal(fused.bias_gelu(x, b), model.bias_gelu(x, b))
        err = capsys.readouterr().err.strip().splitlines()
        assert err == ["nanomega.fused: cannot build the C++ kernels (c++: not found); using the PyTorch path"]
    finally:
        fused._ext.cache_clear()  # the next caller loads the real (cached) build again


# ---- CUDA sources: compile only. There is no GPU, and CPU torch has no CUDA libraries to link. ----

def cuda_checks(nvcc, cache):
    """(source, command) for every source of the CUDA build: nvcc for .cu, the host compiler for .cpp."""
    shim = os.path.join(cache, "shim")  # CPU torch lacks the header CMake writes for a CUDA build
    os.makedirs(os.path.join(shim, "c10", "cuda", "impl"), exist_ok=True)
    with open(os.path.join(shim, "c10", "cuda", "impl", "cuda_cmake_macros.h"), "w") as f:
        f.write("#define C10_CUDA_BUILD_SHARED_LIBS\n")
    homes = [os.environ.get("CUDA_HOME", ""), os.path.dirname(os.path.dirname(os.path.realpath(nvcc))),
             "/usr/local/cuda"]
    cuda_home = next((h for h in homes if os.path.exists(os.path.join(h, "include", "cuda_runtime_api.h"))), None)
    assert cuda_home, f"no include/cuda_runtime_api.h in {homes}: set CUDA_HOME to the toolkit of {nvcc}"
    paths = cpp_extension.include_paths() + [sysconfig.get_paths()["include"], shim, fused.CSRC,
                                             os.path.join(cuda_home, "include")]
    common = ["-std=c++20", "-DNANOMEGA_WITH_CUDA", "-DTORCH_EXTENSION_NAME=nanomega_fused_cuda"]
    common += [f"-I{p}" for p in paths]
    yield "fused_cuda.cu", [nvcc, "-c", "-arch=sm_80", "-O3", "--use_fast_math", "-Xcompiler", "-fPIC",
                            *common, "-o", os.path.join(cache, "fused_cuda.o")]
    cxx = os.environ.get("CXX", "c++")
    yield "fused_cuda_bind.cpp", [cxx, "-fsyntax-only", "-fPIC", *common]
    yield "fused_cpu.cpp", [cxx, "-fsyntax-only", "-fPIC", *fused.cpu_flags(), *common]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH: the CUDA sources cannot be compiled")
def test_cuda_sources_compile():
    """Each source of the CUDA build compiles against torch's headers (cold: ~35 s of compiler CPU, the
    three jobs in parallel); a stamp keyed by the sources, torch's version and the command makes a rerun
    instant. Linking and running need CUDA torch and a GPU: not done here."""
    cache = os.path.join(fused.build_dir(), "nvcc_check")
    sources = hashlib.sha256(torch.__version__.encode())
    for name in sorted(os.listdir(fused.CSRC)):
        with open(os.path.join(fused.CSRC, name), "rb") as f:
            sources.update(name.encode() + f.read())
    jobs = []
    for src, cmd in cuda_checks(shutil.which("nvcc"), cache):
        cmd = cmd + [os.path.join(fused.CSRC, src)]
        key = hashlib.sha256((sources.hexdigest() + " ".join(cmd)).encode()).hexdigest()[:16]
        stamp = os.path.join(cache, f"{src}.{key}.ok")
        if not os.path.exists(stamp):
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            jobs.append((src, stamp, proc))
    failed = []
    for src, stamp, proc in jobs:
        out, _ = proc.communicate(timeout=600)
        if proc.returncode:
            failed.append(f"{src}:\n{out[-4000:]}")
        else:
            open(stamp, "w").close()
    assert not failed, "\n".join(failed)
