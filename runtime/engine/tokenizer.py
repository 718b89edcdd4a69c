"""Tokenizer from `tokenizer.json` and the chat template from `tokenizer_config.json`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


def _raise(message: str) -> None:
    raise ValueError(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


class Tokenizer:
    def __init__(self, model_dir: Path):
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir}: no tokenizer.json (use --prompt-ids)")
        self.tok = HFTokenizer.from_file(str(path))
        added = self.tok.get_added_tokens_decoder()
        self.added_ids = frozenset(added)
        self.special_ids = frozenset(i for i, t in added.items() if t.special)
        cfg_path = Path(model_dir) / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = _tojson
        self.template = env.from_string(template) if template else None

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
