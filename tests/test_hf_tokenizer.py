"""The tokenizer of an imported HF model: a Llama 3-style tokenizer.json (byte-level BPE with Llama
3's split pattern, <|begin_of_text|> and <|end_of_text|> added after the merges, as Llama 3 lays
them out) built offline with the tokenizers library, shipped beside a random Llama; imported,
used to prepare the data, fine-tune 2 steps, resume a third (its fingerprint checked; another
tokenizer.json of the same size refused in one line), sample and export.

The encoding is the library's own: nanomega's prepared tokens are tokenizers' ids of the same
text (whole splits compared: the chunked encoding is the whole one), exactly.
"""

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip(
    "transformers", reason="the hf extra (transformers, safetensors, tokenizers) is not installed"
)
import transformers  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from nanomega import checkpoint, data, train  # noqa: E402
from nanomega.tools import hf, sample  # noqa: E402

CORPUS_CHARS = 200_000
# Llama 3's pre-tokenizer split (its tokenizer.json; cl100k's pattern)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
MERGES = 510  # + 2 special tokens = 512 ids
TRAIN = [
    "--block-size",
    "32",
    "--batch-size",
    "4",
    "--eval-every",
    "0",
    "--warmup",
    "1",
    "--peak-flops",
    "1e11",
    "--log-every",
    "100",
    "--save-every",
    "2",
]


def llama3_style_tokenizer(text, folder, eos=EOS):
    """A byte-level BPE of MERGES ids trained on text, split by Llama 3's pattern, BOS and EOS
    added after it; saved as folder/tokenizer.json + tokenizer_config.json (BOS, EOS)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=MERGES, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([text], trainer)
    tok.add_special_tokens([BOS, eos])
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(bos_token=BOS, eos_token=eos)))
    return folder / "tokenizer.json"


def test_a_llama3_tokenizer_prepares_trains_resumes_and_samples(corpus, tmp_path, capsys):
    text = corpus.read_text()
    src = tmp_path / "llama-src"
    tok_file = llama3_style_tokenizer(text, src)
    enc = data.get_tokenizer(str(tok_file))
    assert enc.n_vocab == MERGES + 2 and (enc.bos_token, enc.eot_token) == (MERGES, MERGES + 1)
    # its special tokens' spellings in text are text for data, special tokens for a prompt
    assert enc.encode_ordinary(EOS) != [enc.eot_token] and enc.encode(EOS, "all") == [enc.eot_token]

    # a random Llama of this vocabulary beside it: imported with its tokenizer.json
    config = transformers.LlamaConfig(
        vocab_size=enc.n_vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(src)
    out = tmp_path / "ft"
    cfg, tok = hf.import_(src, out)
    assert tok == str(out.resolve() / "tokenizer.json")
    assert Path(tok).read_bytes() == tok_file.read_bytes()

    # prepare: the library's ids of each split, exactly
    def argv(tokenizer, steps):
        paths = ["--corpus", str(corpus), "--out-dir", str(out), "--data-cache", str(tmp_path)]
        shape = hf.train_flags(cfg).split()
        return [
            *TRAIN,
            *shape,
            *paths,
            "--tokenizer",
            tokenizer,
            "--max-steps",
            str(steps),
            "--resume",
        ]

    meta = data.prepare(corpus, tok, tmp_path)
    library = Tokenizer.from_file(tok)
    for split, part in zip(("train", "val"), data.split_train_val(text)):
        ids = np.fromfile(meta[f"{split}_bin"], dtype=meta["dtype"]).tolist()
        assert ids == library.encode(part, add_special_tokens=False).ids

    # fine-tune 2 steps from the imported checkpoint (its fingerprint compared), then resume a third
    train.main(argv(tok, 2))
    train.main(argv(tok, 3))
    steps = [json.loads(line).get("step") for line in open(out / "metrics.jsonl")]
    assert steps[-1] == 3 and 3 not in steps[:-1]
    manifest = checkpoint.read_manifest_json(checkpoint.latest(out))
    assert manifest["layout"]["tokenizer_sha256"] == data.sha256_file(tok)

    # another tokenizer.json of the same size (EOS spelled otherwise): one line, nothing trained
    other = llama3_style_tokenizer(text, tmp_path / "other", eos="<|eot|>")
    assert data.get_tokenizer(str(other)).n_vocab == enc.n_vocab
    with pytest.raises(ValueError, match=r"--allow-tokenizer-change") as e:
        train.main(argv(str(other), 4))
    assert "another token table" in str(e.value) and "\n" not in str(e.value)

    # sample with its own vocabulary; export: the tokenizer.json goes out as it came in
    capsys.readouterr()
    sample.main(["--out-dir", str(out), "--prompt", "ROMEO:", "--max-new-tokens", "8"])
    assert capsys.readouterr().out.startswith("ROMEO:")
    to, with_tok = hf.export(out, tmp_path / "export")
    assert with_tok and (Path(to) / "tokenizer.json").read_bytes() == tok_file.read_bytes()
    fast = transformers.AutoTokenizer.from_pretrained(to)
    assert (fast.bos_token, fast.eos_token) == (BOS, EOS)
    assert fast.encode(text[:2000], add_special_tokens=False) == enc.encode_ordinary(text[:2000])
