"""The range of every numeric flag of train.py, in one table (flag -> rule), checked first by checks.check.

Idea: argparse's type=float takes "inf" and "nan", and every comparison with NaN is False, so a check written
`if lr <= 0: refuse` lets NaN through and `if lr < 0` lets inf through as well; either reached the optimizer and
made every weight non-finite, and the checkpoint saved them (issue 28). Here each flag says what it must be,
a float must be finite before it is compared at all, and a flag whose default is None (off, or automatic)
may be None. One line names the flag, the value and its default as the fix.
Lesson: lessons/12-when-training-breaks.md
"""
import math

MAX_TIMEOUT = 30 * 86400  # seconds; datetime.timedelta overflows near 1e14 s, and no collective waits a month
MAX_SEED = 2**62  # torch seeds are signed 64-bit and rng.py adds 100 x pp_rank: leave room below 2**63


def _at_least(lo):
    return lambda v, c: v >= lo, f">= {lo}"


RULES = {  # flag: (whether value v is allowed under Config c, what it must be: formatted with c)
    **{name: _at_least(1) for name in ("n_layer", "n_head", "n_embd", "block_size", "batch_size", "grad_accum",
                                       "max_steps", "eval_iters", "log_every", "tp", "pp", "ep", "top_k", "cp")},
    **{name: _at_least(0) for name in ("eval_every", "save_every", "keep_last", "max_skipped", "n_kv_head",
                                       "ffn_hidden", "rank", "save_every_minutes", "weight_decay", "grad_clip",
                                       "n_experts", "shared_experts", "capacity_factor", "moe_aux_loss", "moe_z_loss",
                                       "moe_bias_balance")},
    "world": _at_least(1),
    # --warmup above --max-steps is allowed: the run only warms up (nothing non-finite), and a shared flag set
    # with a short --max-steps override (the tests' quick runs) does exactly that
    "warmup": _at_least(0),
    "seed": (lambda v, c: 0 <= v < MAX_SEED, "in [0, 2**62)"),
    "dropout": (lambda v, c: 0 <= v < 1, "in [0, 1)"),
    "offload": (lambda v, c: 0 <= v <= 1, "in [0, 1] (a share of the optimizer state)"),
    "lr": (lambda v, c: v > 0, "> 0"),
    "min_lr": (lambda v, c: 0 <= v <= c.lr, "in [0, --lr {c.lr:g}]"),
    "peak_flops": (lambda v, c: v > 0, "> 0 FLOP/s per device"),
    "rope_theta": (lambda v, c: v > 0, "> 0"),
    "rope_scaling": (lambda v, c: v > 0, "> 0 (1: no scaling)"),
    "norm_eps": (lambda v, c: v > 0, "> 0"),
    "spike_threshold": (lambda v, c: v > 1, "> 1 (a spike: loss > this x its running mean)"),
    "rollback_lr_factor": (lambda v, c: 0 < v <= 1, "in (0, 1]"),
    "collective_timeout": (lambda v, c: 0 < v <= MAX_TIMEOUT, f"> 0 and <= {MAX_TIMEOUT} seconds (30 days)"),
    "hang_timeout": (lambda v, c: 0 <= v < c.collective_timeout, ">= 0 (0: off) and below --collective-timeout "
                     "{c.collective_timeout:g} (the watchdog must fire before the collective gives up)"),
}


def check(config, defaults):
    """Raise one line for the first flag in RULES outside its range; defaults(name): the flag's default."""
    for name, (ok, text) in RULES.items():
        value, default = getattr(config, name), defaults(name)
        if value is None and default is None:
            continue  # off, or decided later (hang_timeout's default, world's under --dry-run)
        finite = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
        if not (finite and ok(value, config)):
            fix = "leave it out" if default is None else f"the default is {default:g}"
            raise ValueError(f"--{name.replace('_', '-')} must be {text.format(c=config)}, got {value}"
                             f"{'' if finite else ' (not a finite number)'}; {fix}")
