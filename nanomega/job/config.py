"""train.py's flags joined into one frozen Config: each flag once, with its help and its range beside it.

Idea: a field of Config is a flag. Its declaration says everything about it: its section (one group
of `--help`: job/section.py), default, help, range (job/ranges.py) and whether the model's shape
(gpt_config.GPTConfig) takes it. The flags are declared in three tables by what they configure:
job/config_model.py, job/config_train.py, job/config_run.py; Config joins them, and its own fields
are the values checks.check derives (dp, the vocabulary, ...). What reads the declarations (the
parser, the range table, `model_config`) is job/flags.py; a new flag is one field in its table.
Lesson: lessons/15-3d-parallelism.md
"""

import dataclasses

from nanomega.job.config_model import ModelFlags
from nanomega.job.config_run import RunFlags
from nanomega.job.config_train import TrainFlags


# a dataclass collects its bases' fields from the last base to the first: the model's flags come
# first in `--help`, then the training's, then the run's
@dataclasses.dataclass(frozen=True)
class Config(RunFlags, TrainFlags, ModelFlags):
    """Every flag of train.py, by section; then the values checks.check derives from them."""

    # derived by checks.check: dp = world / (tp x pp x cp); the tokenizer's vocabulary;
    # --inject-fault as (kind, rank, step); (and in the flags above: grad_accum from --global-batch,
    # global_batch, hang_timeout's default, resume)
    dp: int = 1
    vocab_size: int = 4096
    fault: tuple | None = None
    eot: int | None = None  # --document-mask: the tokenizer's end-of-text id, ending each document
