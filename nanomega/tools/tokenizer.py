"""Byte-level BPE, trained here: the `shakespeare-4k` tokenizer in tiktoken's rank-file format.

Text is cut into pre-tokens by GPT-2's regex, so merges never cross a word boundary; each distinct
pre-token is a sequence of bytes (ids 0..255), and training repeatedly merges the most frequent
adjacent pair into a new token until the vocabulary is full. A token's rank is the step it was made
at; tiktoken encodes by merging, inside each pre-token, the lowest-ranked pair first. to_hf /
from_hf exchange such an encoding with Hugging Face's tokenizer.json.

Formulas:
    training cost   sum over merges of (words containing the pair) * (word length)
                    instead of merges * corpus size
    vocabulary      256 bytes + 3839 merges = 4095 mergeable ranks, + <|endoftext|>
                    = 4096 = 32 * 128 (no padding rows for tensor parallelism up to tp = 32:
                    GPTConfig pads to 128 * tp)
Lesson: lessons/01-dense-model.md
"""

import argparse
import base64
import heapq
import os
import time
from collections import Counter, defaultdict
from pathlib import Path

import regex  # tiktoken's own dependency; the stdlib re has no \p{L}

# The encoding's pattern, special token and rank file are data.py's (get_tokenizer loads them); this
# module only learns the ranks, from data.py's training split.
from nanomega.data import (
    DEFAULT_CORPUS,
    ENDOFTEXT,
    GPT2_PATTERN,
    RANK_FILE,
    read_corpus,
    split_train_val,
)

VOCAB_SIZE = 4096  # mergeable ranks + the one special token


def _merge(word, a, b, new):
    """Replace every non-overlapping (a, b) in `word` (left to right) by `new`."""
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
            out.append(new)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return out


def train_bpe(text: str, n_ranks: int) -> dict[bytes, int]:
    """Return tiktoken mergeable ranks {token bytes: rank}: the 256 bytes, then merges until
    n_ranks."""
    if n_ranks < 256:
        raise ValueError(f"a byte-level BPE needs at least 256 ranks, got {n_ranks}")
    counts = Counter(regex.findall(GPT2_PATTERN, text))
    words = [list(piece.encode("utf-8")) for piece in counts]
    freqs = list(counts.values())
    vocab = [bytes([i]) for i in range(256)]  # vocab[id] = token bytes; id == rank
    rank_of = {tok: i for i, tok in enumerate(vocab)}

    pair_count = Counter()
    where = defaultdict(set)  # pair -> indices of the words that contain (or once contained) it
    for i, (word, f) in enumerate(zip(words, freqs)):
        for pair in zip(word, word[1:]):
            pair_count[pair] += f
            where[pair].add(i)
    heap = [(-c, pair) for pair, c in pair_count.items()]  # most frequent first, ties: smallest ids
    heapq.heapify(heap)

    while len(vocab) < n_ranks and heap:
        neg_count, (a, b) = heapq.heappop(heap)
        if pair_count.get((a, b), 0) != -neg_count:
            continue  # stale entry: the count changed after it was pushed (a fresher one is queued)
        merged = vocab[a] + vocab[b]
        # tiktoken needs each byte string once: should a pair spell an existing token, reuse its id
        # (HF tokenizers' trainer guards the same way; it never happens on this corpus).
        new = rank_of.setdefault(merged, len(vocab))
        if new == len(vocab):
            vocab.append(merged)
        delta = Counter()
        for i in where.pop((a, b)):
            old, f = words[i], freqs[i]
            word = _merge(old, a, b, new)
            if len(word) == len(old):
                continue  # the pair left this word in an earlier merge
            for pair in zip(old, old[1:]):
                delta[pair] -= f
            for pair in zip(word, word[1:]):
                delta[pair] += f
                where[pair].add(i)
            words[i] = word
        for pair, d in delta.items():
            if d:
                pair_count[pair] += d
                if pair_count[pair] > 0:
                    heapq.heappush(heap, (-pair_count[pair], pair))
                else:
                    del pair_count[pair]
    return rank_of


def save_ranks(ranks: dict[bytes, int], path: Path) -> None:
    """Write `base64(token) rank` lines in rank order (tiktoken.load.load_tiktoken_bpe reads
    them)."""
    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    lines = [f"{base64.b64encode(tok).decode()} {rank}\n" for tok, rank in by_rank]
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(lines))
    os.replace(tmp, path)  # atomic: a reader sees the old file or the new one, never half of one


def to_hf(enc):
    """An HF fast tokenizer equal to a GPT-2-pattern tiktoken Encoding, or None if it has
    no such equivalent."""
    if enc._pat_str != GPT2_PATTERN or set(enc._special_tokens) != {ENDOFTEXT}:
        return None
    import transformers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    # 5.16 and older read a file by path only
    if not hasattr(TikTokenConverter, "load_tiktoken_bpe"):
        raise ValueError(
            f"writing the tokenizer needs transformers >= 5.17 (installed: "
            f"{transformers.__version__}); pip install -U 'nanomega[hf]'"
        )
    conv = TikTokenConverter(pattern=GPT2_PATTERN, extra_special_tokens=[ENDOFTEXT])
    # the ranks we already hold, not a file or URL
    conv.load_tiktoken_bpe = lambda _: enc._mergeable_ranks
    return PreTrainedTokenizerFast(
        tokenizer_object=conv.converted(),
        bos_token=ENDOFTEXT,
        eos_token=ENDOFTEXT,
        unk_token=ENDOFTEXT,
        model_max_length=None,
    )


def from_hf(src):
    """(ranks {token bytes: rank}, None) of the GPT-2-layout byte-level BPE in folder `src`
    (tokenizer.json or vocab.json); (None, why not) when data.get_tokenizer would encode otherwise;
    (None, None) when `src` has none."""
    from nanomega.tools.hf_check import read_json  # (its one line names a file that is not JSON)

    src = Path(src)
    # the BPE vocabulary, and the special tokens kept apart from it
    if (src / "tokenizer.json").is_file():
        spec = read_json(src / "tokenizer.json")
        pre = spec.get("pre_tokenizer") or {}
        parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        kinds = [p.get("type") for p in parts]
        splits = [p.get("pattern", {}).get("Regex") for p in parts if p.get("type") == "Split"]
        # GPT-2's own: the pattern built in
        if not (
            kinds == ["ByteLevel"]
            and parts[0].get("use_regex", True)
            or kinds == ["Split", "ByteLevel"]
            and splits == [GPT2_PATTERN]
        ):  # ours (to_hf)
            how = (
                f"splits text by {str(splits[0])[:40]!r}..."
                if splits
                else f"pre-tokenizes with {pre.get('type')}"
            )
            return None, f"tokenizer.json {how} instead of GPT-2's pattern"
        model = spec.get("model") if isinstance(spec.get("model"), dict) else {}
        if model.get("type") != "BPE":
            return None, f"tokenizer.json is a {model.get('type')} model, not a BPE"
        vocab = dict(
            model.get("vocab", {}),
            **{t["content"]: t["id"] for t in spec.get("added_tokens", [])},
        )
    elif (src / "vocab.json").is_file():  # GPT-2's original files: vocab.json (+ merges.txt)
        vocab = read_json(src / "vocab.json")
    else:
        return None, None
    # byte <-> the printable character HF shows
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    dec = {v: k for k, v in bytes_to_unicode().items()}
    ranks = {
        bytes(dec[ch] for ch in t): i
        for t, i in vocab.items()
        if t != ENDOFTEXT and set(t) <= dec.keys()
    }
    if sorted(ranks.values()) != list(range(len(ranks))) or vocab.get(ENDOFTEXT) != len(ranks):
        return None, f"its ids are not GPT-2's layout (ranks 0..n-1, then {ENDOFTEXT})"
    return ranks, None


def main():
    parser = argparse.ArgumentParser(description="Train the byte-level BPE on the training split.")
    parser.add_argument("--corpus", default=str(DEFAULT_CORPUS))
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE, help="ranks + <|endoftext|>")
    parser.add_argument("--out", default=str(RANK_FILE))
    args = parser.parse_args()
    # never learn merges from validation text
    train_text, _ = split_train_val(read_corpus(args.corpus))
    t0 = time.perf_counter()
    ranks = train_bpe(train_text, args.vocab_size - 1)
    seconds = time.perf_counter() - t0
    save_ranks(ranks, Path(args.out))
    print(
        f"trained {len(ranks)} ranks (+{ENDOFTEXT} = vocab {len(ranks) + 1}) on {len(train_text):,} "
        f"characters in {seconds:.1f} s -> {args.out}"
    )


if __name__ == "__main__":
    main()
