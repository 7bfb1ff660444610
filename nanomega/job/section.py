"""A flag's declaration: the Section it belongs to (one group of `--help`) says its default, help,
range and whether the model's shape takes it, as a dataclass field's metadata.

The flags themselves are declared in three tables by what they configure: job/config_model.py (the
model's shape and its experts), job/config_train.py (data, optimizer, layout) and job/config_run.py
(precision, logging, checkpoints, failures, the dry run); job/config.py joins them into Config.
Lesson: lessons/15-3d-parallelism.md
"""

import dataclasses
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout


class Section:
    """A group of flags (one group in `--help`); calling it declares one flag: a field of Config.

    default: the flag's default (a function: called when the parser is built); help: its `--help`
    line; rule: its range (ranges.py: (ok(v, config), what it must be)); model: gpt_config.GPTConfig
    takes it; names: its option strings (default: --field-name); argparse: add_argument's other
    keywords.
    """

    def __init__(self, title):
        self.title = title

    def __call__(self, default, help, rule=None, *, model=False, names=(), **argparse):
        meta = {"section": self.title, "help": help, "rule": rule, "model": model}
        meta.update(names=names, argparse=argparse)
        if callable(default):
            return dataclasses.field(default_factory=default, metadata=meta)
        return dataclasses.field(default=default, metadata=meta)


MODEL = Section("model")
EXPERTS = Section("mixture of experts (--arch llama; nanomega/moe.py, nanomega/ep.py)")
DATA = Section("data")
OPTIMIZER = Section("optimizer and schedule")
PARALLEL = Section("parallelism")
PRECISION = Section("precision, memory and kernels")
LOGGING = Section("logging and evaluation")
CHECKPOINTS = Section("checkpoints")
FAILURES = Section("failures")
DRY_RUN = Section("dry run")
