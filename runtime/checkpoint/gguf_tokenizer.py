"""Rebuild a Hugging Face `tokenizer.json` + `tokenizer_config.json` from GGUF tokenizer metadata.

llama.cpp's converter (`convert_hf_to_gguf.py`) flattens the HF tokenizer into metadata:
`tokenizer.ggml.model` (the algorithm), `.pre` (a name for the pre-tokenizer, found by hashing
the HF tokenizer's output), `.tokens` (id order), `.token_type`, `.merges` ("a b" strings, BPE
only), `.scores` (SentencePiece only), special token ids and `tokenizer.chat_template`. We turn
that back into the tokenizer the HF repository shipped, for the two models our families use:

* `gpt2`: byte-level BPE (Qwen2/Qwen3, OLMoE, DBRX-style). Tokens are stored byte-level encoded
  ("Ġthe"), except added tokens, which the converter stores as their plain text. The `.pre` name
  selects the split regex the HF `pre_tokenizer` used (`_BPE_PRE`).
* `llama`: SentencePiece BPE (Mixtral, Llama 1/2), as transformers' LlamaConverter builds it:
  "▁" for spaces, byte fallback through the `<0xXX>` tokens, and merges derived from the piece
  scores (SentencePiece keeps no merge list; a piece's score is its merge priority).

Token types (gguf.TokenType / llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined,
5 unused, 6 byte. Control tokens were HF special added tokens (or looked like `<|...|>`);
user-defined ones were non-special added tokens (Qwen3's `<think>`, `<tool_call>`). Both become
added tokens again, matched before pre-tokenization. The converter pads the token list up to the
model's vocab size with unused `[PAD{id}]` tokens; those were never in the HF tokenizer and are
left out.

Anything else (another `.model`, an unknown `.pre`, no token list) writes nothing and warns:
the conversion still succeeds, but ft-run will need --prompt-ids.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from ftkit.errors import panic_quiet, refused

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# Deriving SentencePiece merges tries every split of every piece (quadratic in a piece's length);
# real pieces are a few characters (SentencePiece's default limit is 16), so a longer one is
# corruption, not a vocabulary to spend minutes on.
MAX_PIECE_CHARS = 1024

# Split regexes as the HF tokenizer.json files have them (llama.cpp rewrites `(?i:...)` for
# std::regex; the tokenizers library takes the original).
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (  # Qwen3.5 (from llama.cpp's note of the original): marks \p{M} join letters
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CL100K = (  # tiktoken cl100k (Llama 3, DBRX and its derivatives): digits in runs of 1-3
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_O200K = (  # tiktoken o200k (gpt-oss's o200k_harmony; GGUF pre "gpt-4o"): case runs, 's after them
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_KIMI_K2 = (  # Kimi-K2 (tokenization_kimi.py's pat_str, a tiktoken vocabulary): o200k with Han runs apart
    r"[\p{Han}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK_V3 = (  # DeepSeek-V3/R1 (llama.cpp's DEEPSEEK3_LLM): digit runs of 1-3, CJK and kana, the rest
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# llama.cpp's LLAMA_VOCAB_PRE_TYPE_DEFAULT: applied in turn, each splitting the previous pieces.
# No HF tokenizer has it; a GGUF saying "default" is tokenized this way by llama.cpp itself.
_LLAMA_CPP_DEFAULT = (
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)


@dataclass(frozen=True)
class _BpePre:
    splits: tuple[str, ...]  # Split regexes before ByteLevel; () = ByteLevel's own GPT-2 regex
    nfc: bool = False  # the HF tokenizer had an NFC normalizer (llama.cpp does not normalize)
    ignore_merges: bool = False  # whole pre-tokens found in the vocab skip the merges
    add_bos: bool = False  # llama.cpp's default when tokenizer.ggml.add_bos_token is absent


_BPE_PRE: dict[str, _BpePre] = {
    # Qwen2/Qwen2.5/Qwen3 (and the Qwen-tokenizer distills): Qwen2TokenizerFast has NFC.
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _BpePre((_QWEN2,), nfc=True)),
    "qwen35": _BpePre((_QWEN35,), nfc=True),  # NFC assumed, as for Qwen2/3
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe"), _BpePre((_CL100K,), ignore_merges=True, add_bos=True)
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe"), _BpePre((_CL100K,))),
    # GLM-4.5/4.6 (llama.cpp's CHATGLM4: the cl100k split, merges as listed, no BOS)
    **dict.fromkeys(("glm4", "chatglm-bpe"), _BpePre((_CL100K,))),
    # OLMo/OLMoE-0924 and MPT derive from GPT-NeoX-20B's tokenizer: NFC (as GPT-NeoX has; not
    # checked against the OLMoE files) + ByteLevel's GPT-2 regex.
    **dict.fromkeys(("olmo", "mpt"), _BpePre((), nfc=True)),
    "gpt-2": _BpePre(()),
    "gpt-4o": _BpePre((_O200K,)),
    "kimi-k2": _BpePre((_KIMI_K2,), ignore_merges=True),  # tiktoken: a piece in the vocab is one token
    "deepseek-v3": _BpePre(_DEEPSEEK_V3),  # three splits in turn, as the HF file's Sequence  # no normalizer, merges as listed, no BOS (as llama.cpp)
    "default": _BpePre(_LLAMA_CPP_DEFAULT),
}
SUPPORTED_PRE = tuple(sorted(_BPE_PRE))


def _warn(msg: str) -> list[str]:
    warnings.warn(f"{msg}; no tokenizer written, ft-run will need --prompt-ids", stacklevel=3)
    return []


def write_tokenizer_from_gguf(metadata: dict[str, Any], out_dir: Path) -> list[str]:
    """Write tokenizer.json and tokenizer_config.json for the GGUF `metadata` into `out_dir`.

    Returns the file names written, or [] (with a warning) when the GGUF's tokenizer is one we
    cannot rebuild.
    """
    kind = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        return _warn("the GGUF has no tokenizer vocabulary")
    if any(_has_surrogates(t) for t in tokens):
        return _warn("the GGUF vocabulary has tokens that are not valid UTF-8")
    types = list(metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    if len(types) != len(tokens):
        return _warn(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    try:
        with panic_quiet():
            return _write(metadata, kind, tokens, types, Path(out_dir))
    except BaseException as e:  # a malformed vocabulary must not fail the conversion
        if not refused(e):
            raise
        for name in (TOKENIZER_JSON, TOKENIZER_CONFIG):
            (Path(out_dir) / name).unlink(missing_ok=True)
        return _warn(f"cannot rebuild the GGUF tokenizer ({type(e).__name__}: {e})")


def _write(
    metadata: dict[str, Any], kind: str, tokens: list[str], types: list[int], out_dir: Path
) -> list[str]:
    if kind == "gpt2":
        pre_name = metadata.get("tokenizer.ggml.pre", "default")
        pre = _BPE_PRE.get(pre_name)
        if pre is None:
            return _warn(
                f"GGUF pre-tokenizer {pre_name!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_PRE)})"
            )
        merges = metadata.get("tokenizer.ggml.merges")
        if not merges:
            return _warn("the GGUF byte-level BPE vocabulary has no tokenizer.ggml.merges")
        tok, add_bos = _byte_level_bpe(metadata, tokens, types, merges, pre)
        if pre_name == "default":
            warnings.warn(
                "GGUF pre-tokenizer 'default': the original HF split regex is unknown; the "
                "tokenizer written reproduces llama.cpp's fallback split",
                stacklevel=4,
            )
    elif kind == "llama":
        scores = metadata.get("tokenizer.ggml.scores")
        if not scores or len(scores) != len(tokens):
            return _warn("the GGUF SentencePiece vocabulary has no tokenizer.ggml.scores")
        longest = max(map(len, tokens))
        if longest > MAX_PIECE_CHARS:
            return _warn(f"the GGUF SentencePiece vocabulary has a piece of {longest} characters "
                         f"(at most {MAX_PIECE_CHARS})")
        tok, add_bos = _sentencepiece_bpe(metadata, tokens, types, scores)
    else:
        return _warn(f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2, llama)")

    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / TOKENIZER_JSON))
    config = _tokenizer_config(metadata, tokens, types, add_bos)
    (out_dir / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return [TOKENIZER_JSON, TOKENIZER_CONFIG]


def _has_surrogates(s: str) -> bool:
    """GGUFSource decodes strings with surrogateescape; such a token cannot go into JSON."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _is_padding(i: int, text: str, ttype: int) -> bool:
    """The converter's filler for ids past the HF vocabulary (get_vocab_base / _set_vocab_*)."""
    return ttype == UNUSED and text == f"[PAD{i}]"


def _vocab(tokens: list[str], types: list[int]) -> dict[str, int]:
    return {
        t: i
        for i, (t, ty) in enumerate(zip(tokens, types, strict=True))
        if not _is_padding(i, t, ty)
    }


def _add_tokens(tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control/unknown tokens as special added tokens, user-defined ones as plain added tokens.

    Every one is already in the model vocabulary, so each keeps its GGUF id.
    """
    special = [t for t, ty in zip(tokens, types, strict=True) if ty in (CONTROL, UNKNOWN)]
    plain = [t for t, ty in zip(tokens, types, strict=True) if ty == USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])


def _special_id(metadata: dict[str, Any], name: str, n: int) -> int | None:
    i = metadata.get(f"tokenizer.ggml.{name}_token_id")
    return i if isinstance(i, int) and 0 <= i < n else None


def _flag(metadata: dict[str, Any], name: str, default: bool) -> bool:
    v = metadata.get(f"tokenizer.ggml.{name}")
    return bool(v) if v is not None else default


def _template(tokens: list[str], bos: int | None, eos: int | None, add_bos: bool, add_eos: bool):
    """TemplateProcessing adding BOS/EOS like LlamaTokenizerFast.update_post_processor."""
    ends = [(tokens[bos], bos)] if add_bos and bos is not None else []
    ends += [(tokens[eos], eos)] if add_eos and eos is not None and eos != bos else []
    if not ends:
        return None
    b = f"{tokens[bos]}:0 " if add_bos and bos is not None else ""
    e = f" {tokens[eos]}:0" if add_eos and eos is not None else ""
    b1 = f"{tokens[bos]}:1 " if b else ""
    e1 = f" {tokens[eos]}:1" if e else ""
    return processors.TemplateProcessing(
        single=f"{b}$A:0{e}", pair=f"{b}$A:0{e} {b1}$B:1{e1}", special_tokens=ends
    )


def _byte_level_bpe(
    metadata: dict[str, Any], tokens: list[str], types: list[int], merges: list[str], pre: _BpePre
) -> tuple[Tokenizer, bool]:
    pairs = []
    for m in merges:
        cut = m.find(" ", 1)  # as llama.cpp splits them: a token may start with a space, not "Ġ"
        pairs.append((m[:cut], m[cut + 1 :]))
    tok = Tokenizer(
        models.BPE(
            vocab=_vocab(tokens, types),
            merges=pairs,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
            ignore_merges=pre.ignore_merges,
        )
    )
    if pre.nfc:
        tok.normalizer = normalizers.NFC()
    if pre.splits:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in pre.splits]
            + [
                pre_tokenizers.ByteLevel(
                    add_prefix_space=False, trim_offsets=False, use_regex=False
                )
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(
            add_prefix_space=False, trim_offsets=True, use_regex=True
        )
    tok.decoder = decoders.ByteLevel()
    n = len(tokens)
    add_bos = _flag(metadata, "add_bos_token", pre.add_bos)
    add_eos = _flag(metadata, "add_eos_token", False)
    bos, eos = _special_id(metadata, "bos", n), _special_id(metadata, "eos", n)
    byte_level = processors.ByteLevel(trim_offsets=False)
    template = _template(tokens, bos, eos, add_bos, add_eos)
    tok.post_processor = processors.Sequence([byte_level, template]) if template else byte_level
    _add_tokens(tok, tokens, types)
    return tok, add_bos and bos is not None


def _spm_merges(vocab: dict[str, int], tokens: list[str], types: list[int], scores: list[float]):
    """Merges for a SentencePiece BPE vocabulary, by descending score of the merged piece.

    Every split of a normal piece into two vocabulary pieces is a merge (transformers'
    SentencePieceExtractor / generate_merges do the same, and we order them as it does: equal
    scores put the longer left half first, then piece order, then the ids of the halves). Only
    the score order matters for the ids produced; the rest makes the merge list identical.
    """
    found = []
    for i, (piece, ty) in enumerate(zip(tokens, types, strict=True)):
        if ty != NORMAL or len(piece) < 2:
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                found.append(
                    (-scores[i], -k, -len(right), i, vocab[left], vocab[right], left, right)
                )
    found.sort(key=lambda m: m[:6])
    return [(m[6], m[7]) for m in found]


def _sentencepiece_bpe(
    metadata: dict[str, Any], tokens: list[str], types: list[int], scores: list[float]
) -> tuple[Tokenizer, bool]:
    vocab = _vocab(tokens, types)
    n = len(tokens)
    unk = _special_id(metadata, "unknown", n)
    if unk is None:
        unk = next((i for i, ty in enumerate(types) if ty == UNKNOWN), None)
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=_spm_merges(vocab, tokens, types, scores),
            dropout=None,
            unk_token=tokens[unk] if unk is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    # transformers' LlamaConverter, legacy form (what Llama 2 / Mixtral tokenizer.json files
    # hold, and what llama.cpp does: a space prefix for the text after each special token).
    prefix = _flag(metadata, "add_space_prefix", True)
    norm = [normalizers.Prepend("▁")] if prefix else []
    tok.normalizer = normalizers.Sequence([*norm, normalizers.Replace(" ", "▁")])
    dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        dec.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(dec)
    add_bos = _flag(metadata, "add_bos_token", True)  # llama.cpp's SPM default
    add_eos = _flag(metadata, "add_eos_token", False)
    bos, eos = _special_id(metadata, "bos", n), _special_id(metadata, "eos", n)
    template = _template(tokens, bos, eos, add_bos, add_eos)
    if template is not None:
        tok.post_processor = template
    _add_tokens(tok, tokens, types)
    return tok, add_bos and bos is not None


def _tokenizer_config(
    metadata: dict[str, Any], tokens: list[str], types: list[int], add_bos: bool
) -> dict[str, Any]:
    n = len(tokens)

    def name(key: str) -> str | None:
        i = _special_id(metadata, key, n)
        return tokens[i] if i is not None else None

    added = {
        str(i): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": ty != USER_DEFINED,
        }
        for i, (t, ty) in enumerate(zip(tokens, types, strict=True))
        if ty in (CONTROL, USER_DEFINED, UNKNOWN)
    }  # fmt: skip
    config: dict[str, Any] = {
        # The generic class keeps tokenizer.json as written.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": name("bos"),
        "eos_token": name("eos"),
        "pad_token": name("padding"),
        "unk_token": name("unknown"),
        "add_bos_token": add_bos,
        "add_eos_token": _flag(metadata, "add_eos_token", False),
        "clean_up_tokenization_spaces": False,
    }
    template = metadata.get("tokenizer.chat_template")
    named = {
        k.removeprefix("tokenizer.chat_template."): v
        for k, v in metadata.items()
        if k.startswith("tokenizer.chat_template.") and isinstance(v, str)
    }
    if named:  # HF's list form; the runtime picks "default"
        default = [{"name": "default", "template": template}] if template else []
        config["chat_template"] = default + [{"name": k, "template": v} for k, v in named.items()]
    elif template:
        config["chat_template"] = template
    return config
