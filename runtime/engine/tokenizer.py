"""Tokenizer from `tokenizer.json` and the chat template from `chat_template.jinja` (where
transformers saves it now: gpt-oss and other recent checkpoints ship it so, and it wins over the
config's, as in transformers) or `tokenizer_config.json`.

Both files come with the model, so they are read as untrusted input: a file the tokenizers
library cannot read, a config whose special tokens or templates have the wrong type, a template
that does not compile: each is a TokenizerError naming the file, raised when the model loads
(ft-diagnose and ftw-convert load the same files the same way first).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from ftkit.errors import InputError, panic_quiet, refused

from ..checkpoint.jsonfile import read_object, type_name

TOKENIZER_JSON, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
MAX_TOKENIZER_BYTES = 512 << 20  # a 256k-token vocabulary with its merges is about 30 MB
MAX_TEMPLATE = 1 << 20  # chat templates are a few KB, the longest about 100 KB
SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


class TokenizerError(InputError):
    """A tokenizer file that cannot be used as it is."""


def _raise(message: str) -> None:
    raise ValueError(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(format: str) -> str:
    """transformers' template global: gpt-oss's template writes "Current date: " with it."""
    return datetime.now().strftime(format)


def compile_template(source: str, where: str) -> Template:
    """A chat template compiled as the runtime renders it; TokenizerError when it cannot be."""
    if len(source) > MAX_TEMPLATE:
        raise TokenizerError(f"{where}: chat template of {len(source)} characters (at most {MAX_TEMPLATE})")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    try:
        return env.from_string(source)
    except (TemplateError, RecursionError) as e:  # jinja's parser recurses once per nesting level
        raise TokenizerError(f"{where}: chat template does not compile ({type(e).__name__}: {e})") from None


def default_template(config: dict[str, Any], where: str) -> str | None:
    """The chat template a tokenizer config names: a string, or the "default" of HF's list of
    {"name", "template"} (None when there is none)."""
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        if not all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in template):
            raise TokenizerError(f"{where}: chat_template is a list, but not of {{name, template}} objects")
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"{where}: chat_template is {type_name(template)}, not a string")
    return template


def _template_file(path: Path) -> str:
    """A chat_template.jinja's text; TokenizerError when it is too long or not UTF-8."""
    try:
        size = path.stat().st_size
        if size > 4 * MAX_TEMPLATE:  # 4 bytes a character at the most in UTF-8
            raise TokenizerError(f"{path}: {size} bytes (a chat template has at most {MAX_TEMPLATE} characters)")
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise TokenizerError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read: {e.strerror or e}") from None


def _check_special(config: dict[str, Any], where: str) -> None:
    for key in SPECIAL_KEYS:
        v = config.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if v is not None and not isinstance(v, str):
            raise TokenizerError(f"{where}: {key} is {type_name(v)}, not a token (a string or {{content}})")


def _load(path: Path) -> HFTokenizer:
    try:
        size = path.stat().st_size
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read: {e.strerror or e}") from None
    if size > MAX_TOKENIZER_BYTES:
        raise TokenizerError(f"{path}: {size} bytes, more than the {MAX_TOKENIZER_BYTES} a tokenizer may have")
    try:
        with panic_quiet():
            return HFTokenizer.from_file(str(path))
    except BaseException as e:  # a plain Exception for every file it refuses, or a Rust panic
        if not refused(e):
            raise
        raise TokenizerError(f"{path}: not a tokenizer the tokenizers library reads ({e})") from None


class Tokenizer:
    def __init__(self, model_dir: Path):
        path = Path(model_dir) / TOKENIZER_JSON
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir}: no tokenizer.json (use --prompt-ids)")
        self.tok = _load(path)
        added = self.tok.get_added_tokens_decoder()
        self.added_ids = frozenset(added)
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        cfg_path = Path(model_dir) / TOKENIZER_CONFIG
        self.config: dict[str, Any] = read_object(cfg_path, TokenizerError) if cfg_path.is_file() else {}
        _check_special(self.config, str(cfg_path))
        jinja = Path(model_dir) / TEMPLATE_FILE
        where = jinja if jinja.is_file() else cfg_path
        # its text picks the tool-call parser
        self.template_source = _template_file(jinja) if jinja.is_file() else default_template(self.config, str(cfg_path))
        self.template = compile_template(self.template_source, str(where)) if self.template_source else None

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, text: str | None) -> int | None:
        return self.tok.token_to_id(text) if text else None

    def special_token(self, key: str) -> str | None:
        v = self.config.get(key)
        return v.get("content") if isinstance(v, dict) else v

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special)

    def chat(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
             add_generation_prompt: bool = True, **kwargs: Any) -> str:
        if self.template is None:
            raise ValueError("this model has no chat template; pass a raw prompt instead")
        return self.template.render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
            bos_token=self.special_token("bos_token") or "", eos_token=self.special_token("eos_token") or "",
            **kwargs,
        )


class StreamDecoder:
    """Turns a growing token list into text deltas without splitting UTF-8 characters.

    Each step decodes only a short window: the tokens since the last emitted delta plus the ones
    before them (as context, so tokenizers that render a leading space by context stay right),
    so a long generation costs linear, not quadratic, decoding work."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True, keep: frozenset[int] = frozenset()):
        """`keep`: special token ids shown even when skipping specials (tool-call and think
        tags, which some tokenizers mark special but whose text a parser needs)."""
        self.tok, self.skip, self.keep = tokenizer, skip_special, keep
        self.ids: list[int] = []
        self.text = ""
        self.prefix = 0  # window start: context already emitted
        self.read = 0  # tokens before this are emitted

    def _decode(self, ids: list[int]) -> str:
        if self.keep and self.skip:
            return self.tok.decode([t for t in ids if t in self.keep or t not in self.tok.special_ids], False)
        return self.tok.decode(ids, self.skip)

    def push(self, token: int) -> str:
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix : self.read])
        now = self._decode(self.ids[self.prefix :])
        if now.endswith("\ufffd") or len(now) <= len(before):  # incomplete character: wait
            return ""
        delta = now[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        self.text += delta
        return delta
