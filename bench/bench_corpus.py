"""Corpus preparation (nanomega/tools/corpus.py): tokens/s against a one-process tiktoken loop over
the same text, and peak RSS for the embedded corpus x1 and x10 (bounded: the x10 run must not hold
10x the memory).

    python bench/bench_corpus.py [--scale 10] [--workers 2] [--tokenizer shakespeare-4k]

The corpus: the embedded Shakespeare repeated `scale` times, cut into ~4 kB documents, in 10 jsonl
files.
Each measurement runs in a fresh process (peak RSS = ru_maxrss of the process and of its worker
children).
"""

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nanomega import data  # noqa: E402


def make_corpus(folder, scale, files=10, doc_chars=4000):
    text = data.read_corpus(data.DEFAULT_CORPUS)
    docs = [text[i : i + doc_chars] for i in range(0, len(text), doc_chars)] * scale
    per = -(-len(docs) // files)
    for k in range(files):
        with open(folder / f"part_{k:02d}.jsonl", "w") as f:
            for d in docs[k * per : (k + 1) * per]:
                f.write(json.dumps({"text": d}) + "\n")
    return sum(len(d) for d in docs)


def child(kind, corpus, tokenizer, workers, out):
    """Runs in its own process; prints one JSON line."""
    from nanomega.tools import corpus as C

    t0 = time.perf_counter()
    # the baseline: read every document, encode it, count the tokens; one process
    if kind == "loop":
        enc, tokens = data.get_tokenizer(tokenizer), 0
        for path in data.corpus_files(corpus):
            for line in open(path):
                tokens += len(enc.encode_ordinary(json.loads(line)["text"])) + 1
    else:
        index = C.prepare(corpus, tokenizer, out, workers=workers, progress=False)
        tokens = index["splits"]["train"]["tokens"] + index["splits"]["val"]["tokens"]
    dt = time.perf_counter() - t0
    rss = [
        resource.getrusage(w).ru_maxrss / 1024
        for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    ]
    print(json.dumps(dict(kind=kind, tokens=tokens, seconds=dt, tok_s=tokens / dt, rss_mib=rss)))


def run(*args):
    out = subprocess.run(
        [sys.executable, __file__, "--child", *map(str, args)], capture_output=True, text=True
    )
    if out.returncode:
        raise RuntimeError(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--scale", type=int, default=10)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--tokenizer", default="shakespeare-4k")
    p.add_argument("--child", nargs=5)
    args = p.parse_args()
    if args.child:
        kind, corpus, tok, workers, out = args.child
        return child(kind, corpus, tok, int(workers), out)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for scale in (1, args.scale):
            folder = tmp / f"x{scale}"
            folder.mkdir()
            chars = make_corpus(folder, scale)
            loop = run("loop", folder, args.tokenizer, 1, "-")
            prep = run("prepare", folder, args.tokenizer, args.workers, tmp / f"prep{scale}")
            print(
                f"x{scale}: {chars / 1e6:.1f} M chars, {prep['tokens']:,} tokens | one-process tiktoken loop "
                f"{loop['tok_s'] / 1e6:.2f} M tok/s, peak RSS {loop['rss_mib'][0]:.0f} MiB | prepare "
                f"({args.workers} workers, shards written) {prep['tok_s'] / 1e6:.2f} M tok/s "
                f"({prep['tok_s'] / loop['tok_s']:.2f}x), peak RSS parent {prep['rss_mib'][0]:.0f} MiB, "
                f"largest worker {prep['rss_mib'][1]:.0f} MiB",
                flush=True,
            )


if __name__ == "__main__":
    main()
