"""Document masking (--document-mask): a packed window's tokens attend only inside their document.

A window is cut from documents joined end to end, each ended by <|endoftext|>, so it often holds the
end of one document and the start of the next; with the mask each token attends only to the earlier
tokens of its own document (Llama 3). The ids of the whole windows travel with the batch as (x, y,
docs), and every attention takes them: the dense core's eager and sdpa forms and the three cp
methods. Positions stay absolute; the loss is unchanged.

Formula: docs[b, i]    = #{j < i : x[b, j] = eot}
         mask[b, i, j] = (j <= i) and docs[b, i] = docs[b, j]
Lesson: lessons/07-long-context.md
"""

from . import cp


def ids(x, eot):
    """(b, s) document ids of token windows x (b, s): the number of end-of-text tokens
    before each token."""
    ends = (x == eot).long()
    return ends.cumsum(1) - ends  # the end-of-text token itself closes its document


def batch(dataset, indices, axis, eot=None):
    """A micro-batch of windows `indices`: (x, y) this cp rank's tokens (cp.split), and
    with eot (the end-of-text id; --document-mask) the whole windows' document ids (b, s)
    as a third tensor."""
    x, y = dataset.get(indices)
    return cp.split((x, y), axis) + (() if eot is None else (ids(x, eot),))
