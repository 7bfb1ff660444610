"""train.py's command line read into the frozen Config: the parser generated from the
declarations (job/config.py), once.

Idea: nothing about a flag is written twice. FLAGS are Config's fields that declare a section, in
their order; `parser` makes one `--help` group per section and one option per flag; RANGES is the
table of their declared ranges (ranges.check walks it); `model_config` takes the fields declared
model=True as the GPT's shape. `parse` reads the command line once (frozen: no module rewrites a
flag later), and --model fills the shape flags not given from a preset (job/presets.py);
job/checks.py then refuses a bad Config before any collective and fills in the derived values
(dp = world / (tp x pp x cp), the vocabulary, ...).
Lesson: lessons/15-3d-parallelism.md
"""

import argparse
import dataclasses
import sys
import typing

from nanomega.gpt_config import GPTConfig
from nanomega.job import presets
from nanomega.job.config import Config

FLAGS = [f for f in dataclasses.fields(Config) if "section" in f.metadata]  # --help's order
RANGES = {f.name: f.metadata["rule"] for f in FLAGS if f.metadata["rule"]}  # ranges.check's table


def default(name):
    """The flag's default (read from the environment now, for --device)."""
    f = next(f for f in FLAGS if f.name == name)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def options(f):
    """The flag's option strings: --field-name unless it declares its own."""
    return f.metadata["names"] or ("--" + f.name.replace("_", "-"),)


def kind(f):
    """How argparse reads the flag: a bool is a switch, else a value of the field's type."""
    if "action" in f.metadata["argparse"]:
        return {}
    if f.type is bool:
        return {"action": "store_true"}
    value_type = next(t for t in typing.get_args(f.type) or (f.type,) if t is not type(None))
    return {} if value_type is str else {"type": value_type}


class Parser(argparse.ArgumentParser):
    """argparse whose errors (an unknown flag, a value of the wrong type) are one ValueError line,
    said once by rank 0 (lifecycle.entrypoint), instead of the usage block printed by every rank."""

    def error(self, message):
        raise ValueError(f"{message}; `python nanomega/train.py --help` lists the flags")


def parser():
    """The flags, generated from Config: one group per section in `--help`, one flag per field."""
    p = Parser(description="Train a GPT with any tp x pp x dp x ZeRO layout.")
    groups = {}
    for f in FLAGS:
        title, meta = f.metadata["section"], f.metadata
        if title not in groups:
            groups[title] = p.add_argument_group(title)
        groups[title].add_argument(
            *options(f),
            dest=f.name,
            default=default(f.name),
            help=meta["help"],
            **kind(f),
            **meta["argparse"],
        )
    return p


def parse(argv=None):
    """The command line as a Config; --model fills the shape flags not given."""
    argv = sys.argv[1:] if argv is None else argv
    values = vars(parser().parse_args(argv))
    if values["model"] in presets.PRESETS:
        values.update(preset_shape(values["model"], argv))
    return Config(**values)


def preset_shape(model, argv):
    """--model NAME: the preset's shape for every shape flag not given on the command line
    (vocabulary excepted: the tokenizer decides it)."""
    given = {f.name for f in FLAGS if named(f, argv)}
    shape = presets.PRESETS[model]
    return {k: v for k, v in shape.items() if k != "vocab_size" and k not in given}


def named(f, argv):
    """Whether the command line gives the flag (--flag VALUE or --flag=VALUE)."""
    return any(tok == opt or tok.startswith(opt + "=") for opt in options(f) for tok in argv)


def model_config(config, vocab_size=None):
    """The GPT's shape (gpt_config.GPTConfig): the flags declared model=True; its vocabulary:
    vocab_size, else the Config's (the tokenizer's, once checked; 4096 before)."""
    shape = {f.name: getattr(config, f.name) for f in FLAGS if f.metadata["model"]}
    return GPTConfig(
        vocab_size=vocab_size or config.vocab_size,
        make_vocab_size_divisible_by=128 * config.tp,
        **shape,
    )
