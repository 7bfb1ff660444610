"""Corpora (nanomega/tools/corpus.py): many jsonl/txt files -> token shards + index, in parallel,
bounded; the shards read as one window sequence; train.py --data trains and resumes exactly from
them."""

import gzip
import hashlib
import json
import sys

import numpy as np
import pytest

from nanomega import data, train, windows
from nanomega.tools import corpus

TEXT = data.read_corpus(data.DEFAULT_CORPUS)


@pytest.fixture(scope="module")
def docs_dir(tmp_path_factory):
    """60 documents of 1-4 kB in 3 jsonl files (one gzipped), plus one .txt document of 30 kB."""
    root = tmp_path_factory.mktemp("docs")
    rng = np.random.default_rng(0)
    pos, docs = 0, []
    for _ in range(60):
        n = int(rng.integers(1000, 4000))
        docs.append(TEXT[pos : pos + n])
        pos += n
    for k in range(3):
        lines = "".join(
            json.dumps({"text": d, "id": i}) + "\n"
            for i, d in enumerate(docs[20 * k : 20 * k + 20])
        )
        if k == 1:
            (root / "b.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
        else:
            (root / f"{'ac'[k // 2]}.jsonl").write_text(lines)
    (root / "sub").mkdir()
    (root / "sub" / "d.txt").write_text(TEXT[pos : pos + 30_000])
    docs.append(TEXT[pos : pos + 30_000])  # sorted order: a.jsonl, b.jsonl.gz, c.jsonl, sub/d.txt
    return root, docs


def test_shards_hold_every_document_in_order_with_eot(docs_dir, tmp_path, capsys):
    root, docs = docs_dir
    enc = data.get_tokenizer("shakespeare-4k")
    index = corpus.prepare(root, "shakespeare-4k", tmp_path / "prep", workers=2, shard_tokens=4000)
    want = {"train": [], "val": []}
    for i, d in enumerate(docs):  # documents 0, 20, 40, 60 are held out
        want["val" if i % corpus.VAL_EVERY == 0 else "train"] += enc.encode_ordinary(d) + [
            enc.eot_token
        ]
    for split in ("train", "val"):
        shards = [s for s in index["shards"] if s["split"] == split]
        got = np.concatenate(
            [np.fromfile(tmp_path / "prep" / s["file"], np.uint16) for s in shards]
        )
        assert got.tolist() == want[split]
        assert all(s["tokens"] <= 4000 for s in shards) and len(shards) == -(
            -len(want[split]) // 4000
        )
        for s in shards:
            assert (
                hashlib.sha256((tmp_path / "prep" / s["file"]).read_bytes()).hexdigest()
                == s["sha256"]
            )
    assert index["splits"]["val"]["documents"] == 4 and index["splits"]["train"]["documents"] == 57
    assert index["dtype"] == "uint16" and index["eot"] == 4095
    assert "tok/s" in capsys.readouterr().err  # tqdm's bar, with the tokens/s postfix
    # a second prepare of the same corpus reuses the folder; a glob selects files
    assert (
        corpus.prepare(root, "shakespeare-4k", tmp_path / "prep", workers=2, shard_tokens=4000)[
            "shards"
        ]
        == index["shards"]
    )
    assert [p.name for p in data.corpus_files(str(root / "*.jsonl*"))] == [
        "a.jsonl",
        "b.jsonl.gz",
        "c.jsonl",
    ]

    # windows never cross a shard; the global index runs over the shards in order
    ds = windows.TokenDataset(data.split_paths(index, "train"), index["dtype"], 64)
    sizes = [s["tokens"] for s in index["shards"] if s["split"] == "train"]
    assert len(ds) == sum((n - 1) // 64 for n in sizes)
    x, y = ds.get([(sizes[0] - 1) // 64])  # the first window of shard 1
    assert (
        x[0].tolist() == want["train"][sizes[0] : sizes[0] + 64]
        and y[0, -1] == want["train"][sizes[0] + 64]
    )


def test_plain_progress_without_tqdm_and_bad_line(docs_dir, tmp_path, monkeypatch, capsys):
    root, _ = docs_dir
    # `import tqdm` now fails: the optional extra is absent
    monkeypatch.setitem(sys.modules, "tqdm", None)
    corpus.prepare(root / "a.jsonl", "shakespeare-4k", tmp_path / "one", workers=1)
    assert "tok/s, ETA" in capsys.readouterr().out
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(
        ValueError, match=r"bad.jsonl line 2 is not a JSON object with a string field 'text'"
    ):
        corpus.prepare(bad, "shakespeare-4k", tmp_path / "bad", workers=1)
    assert not (tmp_path / "bad").exists()
    with pytest.raises(FileNotFoundError, match=r"--corpus .*nothing\*.jsonl names no"):
        data.corpus_files(str(tmp_path / "nothing*.jsonl"))


def test_train_from_shards_resumes_exactly(docs_dir, tmp_path, one_thread):
    root, _ = docs_dir
    prep = tmp_path / "prep"
    corpus.main(
        ["--corpus", str(root), "--out", str(prep), "--workers", "2", "--shard-tokens", "5000"]
    )
    flags = [
        "--data",
        str(prep),
        "--n-layer",
        "1",
        "--n-head",
        "2",
        "--n-embd",
        "32",
        "--block-size",
        "32",
        "--batch-size",
        "8",
        "--eval-every",
        "2",
        "--eval-iters",
        "1",
        "--peak-flops",
        "1e11",
        "--max-steps",
        "4",
    ]
    train.main([*flags, "--out-dir", str(tmp_path / "a")])
    train.main([*flags, "--out-dir", str(tmp_path / "b"), "--max-steps", "2"])
    train.main([*flags, "--out-dir", str(tmp_path / "b"), "--resume"])
    losses = lambda out: [
        r["loss"] for r in map(json.loads, open(tmp_path / out / "metrics.jsonl")) if "loss" in r
    ]
    # bitwise: same windows across shards, same order after the resume
    assert losses("a") == losses("b")
