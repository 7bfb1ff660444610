"""The range of every numeric flag, and the check that a value is finite and inside it.

Idea: a rule is a pair (whether value v is allowed under Config c, what it must be). Each flag
declares its rule beside its help (job/config.py); `check` walks that table first thing in
checks.check. A float must be finite before it is compared at all (NaN fails every comparison), a
flag whose default is None (off, or automatic) may be None, and a bad value is one line naming the
flag, the value and its default as the fix.
Lesson: lessons/20-when-training-breaks.md
"""

import math

# seconds; datetime.timedelta overflows near 1e14 s, and no collective waits a month
MAX_TIMEOUT = 30 * 86400
# torch seeds are signed 64-bit and rng.py adds 100 x pp_rank: leave room below 2**63
MAX_SEED = 2**62
# --dry-run's world: a million ranks builds in seconds (meta.PaperGrid finds only its own groups);
# far above it the rank tables alone outgrow a laptop's memory
MAX_WORLD = 2**20


def at_least(lo):
    return lambda v, c: v >= lo, f">= {lo}"


def within(lo, hi, note=""):
    return lambda v, c: lo <= v <= hi, f"in [{lo:,}, {hi:,}]{note}"


def above(lo, note=""):
    return lambda v, c: v > lo, f"> {lo}{note}"


def check(config, rules, defaults):
    """Raise one line for the first flag of rules ({name: rule}) outside its range; defaults(name):
    its default."""
    for name, (ok, text) in rules.items():
        value, default = getattr(config, name), defaults(name)
        if value is None and default is None:
            continue  # off, or decided later (hang_timeout's default, world's under --dry-run)

        finite = isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
        if not (finite and ok(value, config)):
            fix = "leave it out" if default is None else f"the default is {default:g}"
            raise ValueError(
                f"--{name.replace('_', '-')} must be {text.format(c=config)}, got {value}"
                f"{'' if finite else ' (not a finite number)'}; {fix}"
            )
