"""Document masking: a packed window's tokens attend only inside their own document (--document-mask).

Idea: the token stream is documents joined end to end, each ended by the tokenizer's <|endoftext|>
(tools/corpus.py writes one after every document), and a window (data.py) is cut from it wherever it falls: it
often holds the end of one document, its <|endoftext|> and the start of the next. Plain causal attention lets
the second document's tokens read the first's; with a document mask each token attends only to the earlier
tokens of its own document -- the causal mask intersected with a block-diagonal one (Llama 3: "an attention mask
that prevents self-attention between different documents within the same sequence"). The loss is unchanged:
every target is still predicted (the <|endoftext|> token, last of its document, predicts the next one's first
token from its own document alone).
The ids travel with the batch: (x, y, docs) instead of (x, y), docs (b, s) of the whole windows even under
context parallelism (cp.attention masks each chunk pair from them; cp.split cuts only x and y). Every attention
takes them: the dense core's eager and sdpa forms (model.py, the mask modern.document_mask) and the three cp
methods (cp.py, per chunk pair).
Positions stay absolute: a document starting at window position p sees positions p, p+1, ... (learned or
rotary): Megatron's --reset-attention-mask without its --reset-position-ids; the mask alone separates them.
Formula: docs[b, i] = #{j < i : x[b, j] = eot}     mask[b, i, j] = (j <= i) and docs[b, i] = docs[b, j]
Lesson: lessons/15-long-context.md
"""
from . import cp


def ids(x, eot):
    """(b, s) document ids of token windows x (b, s): the number of end-of-text tokens before each
    token."""
    ends = (x == eot).long()
    return ends.cumsum(1) - ends  # the end-of-text token itself closes its document


def batch(dataset, indices, axis, eot=None):
    """A micro-batch of windows `indices`: (x, y) this cp rank's tokens (cp.split), and with eot
    (the end-of-text id; --document-mask) the whole windows' document ids (b, s) as a third
    tensor."""
    x, y = dataset.get(indices)
    return cp.split((x, y), axis) + (() if eot is None else (ids(x, eot),))
