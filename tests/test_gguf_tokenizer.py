"""Tokenizers rebuilt from GGUF metadata encode and decode like the HF tokenizers they came from.

The GGUF vocabularies are written the way llama.cpp's convert_hf_to_gguf.py writes them
(`_gpt2_vocab` follows ModelBase.get_vocab_base and does_token_look_special; SentencePiece
vocabularies follow _set_vocab_sentencepiece), with gguf.SpecialVocab for merges, special ids
and the chat template.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from ftkit.runtime.checkpoint.gguf import GGUFSource
from ftkit.runtime.checkpoint.gguf_tokenizer import _CL100K, write_tokenizer_from_gguf
from ftkit.runtime.engine.tokenizer import Tokenizer as RuntimeTokenizer
from ftkit.runtime.synthetic import CHAT_TEMPLATE, CORPUS, EOS_TOKEN, PAD_TOKEN, write_tokenizer
from ftkit.tools.convert.pipeline import convert, prepare
from gguf_fixtures import write_gguf_from_hf

TT = gguf.TokenType
SAMPLES = [
    "Hello, world! It's a test; we'll see what they've done.",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "   leading spaces, trailing spaces   \n\n  \t \r\n end",
    "1234567890 3.14159 1,000,000 2025-01-01 0x1F",
    "naïve café — 東京 Москва 😀👍🏽 ∑ x² ℕ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n<think>\nok</think>",
    'tool:<tool_call>{"name": "f"}</tool_call><|endoftext|>trailing',
    "SHOUTING I'M AND DON'T 's 'S",
    "",
    " ",
    "a\n\n\nb",
    *CORPUS.splitlines()[:40],
]


def _gpt2_vocab(tok: Tokenizer, n_vocab: int) -> tuple[list[str], list[int]]:
    """convert_hf_to_gguf ModelBase.get_vocab_base for a byte-level BPE."""
    reverse = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    added = tok.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(TT.UNUSED)
            continue
        token = reverse[i]
        if i in added:
            if not added[i].normalized:  # stored pre-normalized
                token = tok.decode(
                    tok.encode(token, add_special_tokens=False).ids, skip_special_tokens=False
                )
            looks_special = token.startswith("<|") and token.endswith("|>")
            types.append(TT.CONTROL if added[i].special or looks_special else TT.USER_DEFINED)
        else:
            types.append(TT.NORMAL)
        tokens.append(token)
    return tokens, types


def _minimal_gguf(path: Path, add_vocab) -> Path:
    w = gguf.GGUFWriter(path=None, arch="llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    add_vocab(w)
    w.write_header_to_file(path=path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_gpt2_vocab(w: gguf.GGUFWriter, hf_dir: Path, pre: str, n_vocab: int | None = None) -> None:
    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    tokens, types = _gpt2_vocab(tok, n_vocab or tok.get_vocab_size(with_added_tokens=True))
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(hf_dir, load_merges=True, n_vocab=len(tokens)).add_to_gguf(w)


def _rebuild(gguf_path: Path, out: Path) -> list[str]:
    return write_tokenizer_from_gguf(GGUFSource(gguf_path).metadata, out)


def _assert_same(original: Tokenizer, rebuilt: Tokenizer, samples=SAMPLES) -> None:
    for text in samples:
        ids = original.encode(text, add_special_tokens=False).ids
        assert rebuilt.encode(text, add_special_tokens=False).ids == ids, text
        assert rebuilt.encode(text).ids == original.encode(text).ids, text
        for skip in (False, True):
            assert rebuilt.decode(ids, skip_special_tokens=skip) == original.decode(
                ids, skip_special_tokens=skip
            ), text


@pytest.fixture(scope="module")
def qwen_hf(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("hf-tok")
    write_tokenizer(d, 1300)  # merges run out near 1200: reserved special tokens fill the top
    return d


def test_qwen2_byte_level_bpe(qwen_hf, tmp_path):
    path = _minimal_gguf(tmp_path / "m.gguf", lambda w: (
        w.add_tokenizer_model("gpt2"), _add_gpt2_vocab(w, qwen_hf, "qwen2", n_vocab=1320)
    ))  # fmt: skip
    out = tmp_path / "tok"
    assert _rebuild(path, out) == ["tokenizer.json", "tokenizer_config.json"]
    original = Tokenizer.from_file(str(qwen_hf / "tokenizer.json"))
    rebuilt = Tokenizer.from_file(str(out / "tokenizer.json"))
    _assert_same(original, rebuilt)
    # Same vocabulary and added tokens; the converter's [PAD] filler is not carried.
    assert rebuilt.get_vocab(with_added_tokens=True) == original.get_vocab(with_added_tokens=True)
    assert {i: (t.content, t.special) for i, t in rebuilt.get_added_tokens_decoder().items()} == {
        i: (t.content, t.special) for i, t in original.get_added_tokens_decoder().items()
    }
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == CHAT_TEMPLATE
    assert (cfg["eos_token"], cfg["pad_token"], cfg["bos_token"]) == (EOS_TOKEN, PAD_TOKEN, None)
    assert cfg["add_bos_token"] is False
    # The runtime tokenizer renders the chat template as from the HF directory.
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert RuntimeTokenizer(out).chat(messages) == RuntimeTokenizer(qwen_hf).chat(messages)


def test_user_defined_tokens_are_not_special(tmp_path):
    """Qwen3's <think>/<tool_call> are non-special added tokens: USER_DEFINED in the GGUF."""
    hf = tmp_path / "hf"
    write_tokenizer(hf, 300)
    plain = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
    data = json.loads((hf / "tokenizer.json").read_text())
    for a in data["added_tokens"]:
        a["special"] = a["content"] not in plain
    (hf / "tokenizer.json").write_text(json.dumps(data))
    original = Tokenizer.from_file(str(hf / "tokenizer.json"))
    path = _minimal_gguf(tmp_path / "m.gguf", lambda w: (
        w.add_tokenizer_model("gpt2"), _add_gpt2_vocab(w, hf, "qwen2")
    ))  # fmt: skip
    types = GGUFSource(path).metadata["tokenizer.ggml.token_type"]
    assert types[original.token_to_id("<think>")] == TT.USER_DEFINED
    assert types[original.token_to_id("<|im_end|>")] == TT.CONTROL
    _rebuild(path, tmp_path / "tok")
    rebuilt = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    _assert_same(original, rebuilt)
    ids = original.encode("<|im_start|><think>x</think>", add_special_tokens=False).ids
    assert rebuilt.decode(ids, skip_special_tokens=True) == "<think>x</think>"


def _byte_level_original(
    tmp_path: Path, split: pre_tokenizers.PreTokenizer, nfc=False, ignore=False
):
    tok = Tokenizer(models.BPE(ignore_merges=ignore))
    tok.pre_tokenizer = split
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    if nfc:
        tok.normalizer = normalizers.NFC()
    hf = tmp_path / "hf"
    hf.mkdir()
    tok.save(str(hf / "tokenizer.json"))
    cfg = {"eos_token": "<|endoftext|>", "pad_token": "<|pad|>", "bos_token": None}
    (hf / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tok, hf


# gpt-oss's tokenizer.json Split regex (tiktoken's o200k), written out here apart from the module's
O200K = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# Kimi-K2's tokenization_kimi.py pat_str (a tiktoken vocabulary): `&&` intersects the letter classes with non-Han
KIMI_K2 = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
])  # fmt: skip


# DeepSeek-V3's tokenizer.json: three Splits in sequence
DEEPSEEK_V3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
)


@pytest.mark.parametrize("pre", ["olmo", "dbrx", "llama-bpe", "gpt-4o", "glm4", "deepseek-v3", "kimi-k2"])
def test_other_byte_level_pre_tokenizers(pre, tmp_path):
    if pre == "olmo":  # GPT-NeoX-20B style: ByteLevel's own regex
        split = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    elif pre == "deepseek-v3":
        split = pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(r), behavior="isolated") for r in DEEPSEEK_V3),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    else:
        split = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex({"gpt-4o": O200K, "kimi-k2": KIMI_K2}.get(pre, _CL100K)), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    original, hf = _byte_level_original(
        tmp_path, split, nfc=pre == "olmo", ignore=pre in ("llama-bpe", "kimi-k2")
    )
    path = _minimal_gguf(tmp_path / "m.gguf", lambda w: (
        w.add_tokenizer_model("gpt2"), _add_gpt2_vocab(w, hf, pre)
    ))  # fmt: skip
    _rebuild(path, tmp_path / "tok")
    rebuilt = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    digits = ["12345678", "x 1234 y", "a 12 b 1234567", "HelloWorld CamelCase's ABCdef a/b\n/c", "東京タワーへ 123456 ひらがな.Test",
              "中文English混合 汉字abc 北京市 Pascal", "Ünïcode ÄÖÜ's 你好,世界!\n\n"]
    texts = [s for s in SAMPLES if "<" not in s] + digits
    _assert_same(original, rebuilt, texts)
    # the pieces too: a small vocabulary may merge the same across a split the regex moved
    assert all(original.pre_tokenizer.pre_tokenize_str(t) == rebuilt.pre_tokenizer.pre_tokenize_str(t) for t in texts)


def test_unsupported_writes_nothing(qwen_hf, tmp_path):
    path = _minimal_gguf(tmp_path / "m.gguf", lambda w: (
        w.add_tokenizer_model("gpt2"), _add_gpt2_vocab(w, qwen_hf, "some-new-pre")
    ))  # fmt: skip
    meta = GGUFSource(path).metadata
    with pytest.warns(UserWarning, match="'some-new-pre' is not supported.*--prompt-ids"):
        assert write_tokenizer_from_gguf(meta, tmp_path / "a") == []
    with pytest.warns(UserWarning, match="model 'bert' is not supported"):
        assert (
            write_tokenizer_from_gguf({**meta, "tokenizer.ggml.model": "bert"}, tmp_path / "b")
            == []
        )
    with pytest.warns(UserWarning, match="no tokenizer vocabulary"):
        assert write_tokenizer_from_gguf({"tokenizer.ggml.model": "gpt2"}, tmp_path / "c") == []
    bad = {**meta, "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.merges": ["Ġ zzz"]}
    with pytest.warns(UserWarning, match="cannot rebuild.*zzz"):
        assert write_tokenizer_from_gguf(bad, tmp_path / "d") == []
    assert not list((tmp_path / "d").glob("*"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    # The converter still works: no side files.
    with pytest.warns(UserWarning, match="--prompt-ids"):
        assert GGUFSource(path).side_files() == []


# SentencePiece BPE (Mixtral / Llama 2): the reference tokenizer.json is built the way
# transformers' LlamaConverter builds it from tokenizer.model, merges from the piece scores.


def _sentencepiece_original(tmp_path: Path) -> tuple[Tokenizer, list[str], list[float], list[int]]:
    from transformers.tokenization_utils_base import generate_merges

    train = Tokenizer(models.BPE(unk_token="<unk>"))
    train.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    train.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>"], show_progress=False)
    train.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    trained = sorted(train.get_vocab().items(), key=lambda kv: kv[1])
    pieces = [t for t, _ in trained if t != "<unk>"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [TT.UNKNOWN, TT.CONTROL, TT.CONTROL] + [TT.BYTE] * 256 + [TT.NORMAL] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]  # SentencePiece BPE scores
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = generate_merges(vocab, dict(zip(tokens, scores, strict=True)))
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)
    ])  # fmt: skip
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens[:3]])
    return tok, tokens, scores, types


def test_llama_sentencepiece_bpe(tmp_path):
    original, tokens, scores, types = _sentencepiece_original(tmp_path)
    n_vocab = len(tokens) + 3  # the converter pads up to the config's vocab_size

    def add(w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens + [f"[PAD{i}]" for i in range(len(tokens), n_vocab)])
        w.add_token_scores(scores + [-1000.0] * 3)
        w.add_token_types(types + [TT.UNUSED] * 3)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)
        w.add_add_eos_token(False)
        w.add_chat_template(
            "{{ bos_token }}{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}"
        )

    path = _minimal_gguf(tmp_path / "m.gguf", add)
    out = tmp_path / "tok"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "default" pre is normal for SentencePiece: no warning
        assert _rebuild(path, out) == ["tokenizer.json", "tokenizer_config.json"]
    rebuilt = Tokenizer.from_file(str(out / "tokenizer.json"))
    samples = [s.replace("<|im_start|>", "<s>").replace("<|im_end|>", "</s>") for s in SAMPLES]
    _assert_same(original, rebuilt, samples + ["\x00\x7f byte fallback 😀", "</s>a <s> b<unk>"])
    assert (
        original.encode("hi").ids[0] == 1 and rebuilt.encode("hi").ids == original.encode("hi").ids
    )
    assert (
        json.loads(rebuilt.to_str())["model"]["merges"]
        == json.loads(original.to_str())["model"]["merges"]
    )
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"], cfg["unk_token"]) == ("<s>", "</s>", "<unk>")
    assert cfg["add_bos_token"] is True
    rt = RuntimeTokenizer(out)
    assert rt.chat([{"role": "user", "content": "hi"}]) == "<s>[INST] hi [/INST]"


def test_convert_carries_tokenizer(hf_checkpoint, tmp_path, monkeypatch):
    """ftw-convert on a GGUF with a vocabulary writes tokenizer.json into the FTW directory."""
    hf = hf_checkpoint("qwen3_moe")
    original_add = gguf.GGUFWriter.add_tokenizer_model

    def add_tokenizer_model(self, model: str) -> None:  # where the converter writes its vocab
        original_add(self, model)
        _add_gpt2_vocab(
            self, hf, "qwen2", json.loads((hf / "config.json").read_text())["vocab_size"]
        )

    monkeypatch.setattr(gguf.GGUFWriter, "add_tokenizer_model", add_tokenizer_model)
    src = tmp_path / "m.gguf"
    write_gguf_from_hf(hf, src, "F32")
    out = tmp_path / "m.ftw"
    manifest = convert(prepare(src), out)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(manifest.files)
    original = Tokenizer.from_file(str(hf / "tokenizer.json"))
    rebuilt = Tokenizer.from_file(str(out / "tokenizer.json"))
    _assert_same(original, rebuilt)
    rt, ref = RuntimeTokenizer(out), RuntimeTokenizer(hf)
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert rt.chat(messages) == ref.chat(messages)
    assert rt.special_token("eos_token") == ref.special_token("eos_token") == EOS_TOKEN
