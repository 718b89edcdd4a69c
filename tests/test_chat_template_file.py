"""Chat templates as recent checkpoints ship them: in `chat_template.jinja` beside the tokenizer
(gpt-oss's, which transformers prefers over tokenizer_config.json's), calling transformers'
`strftime_now` global (gpt-oss's template writes the current date with it); a bad template file
is a TokenizerError naming it, from ft-run's loader and from ft-diagnose alike."""

from __future__ import annotations

import json
import shutil
from datetime import datetime
from pathlib import Path

import pytest

from ftkit.runtime.engine.tokenizer import (
    TEMPLATE_FILE,
    Tokenizer,
    TokenizerError,
    compile_template,
)
from ftkit.runtime.synthetic import write_tokenizer

# a harmony-shaped template of our own: a system message with the date, then each turn
HARMONY_LIKE = (
    '{{- "<|start|>system<|message|>Current date: " + strftime_now("%Y-%m-%d") + "<|end|>" }}'
    "{%- for m in messages %}{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)


def _model_dir(tmp_path: Path, in_config: bool) -> Path:
    d = tmp_path / "tok"
    write_tokenizer(d, 512)
    if not in_config:  # as transformers saves it now: the config without a template
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        del cfg["chat_template"]
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def test_the_template_file_is_read_and_strftime_now_renders_today(tmp_path):
    d = _model_dir(tmp_path, in_config=False)
    (d / TEMPLATE_FILE).write_text(HARMONY_LIKE)
    text = Tokenizer(d).chat([{"role": "user", "content": "hi"}])
    today = datetime.now().strftime("%Y-%m-%d")
    assert text == f"<|start|>system<|message|>Current date: {today}<|end|><|start|>user<|message|>hi<|end|><|start|>assistant"


def test_the_template_file_wins_over_the_configs(tmp_path):
    d = _model_dir(tmp_path, in_config=True)
    assert Tokenizer(d).template_source != HARMONY_LIKE
    (d / TEMPLATE_FILE).write_text(HARMONY_LIKE)
    assert Tokenizer(d).template_source == HARMONY_LIKE


@pytest.mark.parametrize(("content", "match"), [
    (b"\xff\xfe not utf-8", "not UTF-8"),
    (b"{% for m in messages %}never closed", "does not compile"),
    (b"x" * (4 << 20) + b"x", "a chat template has at most"),
])
def test_a_bad_template_file_is_refused_naming_it(tmp_path, content, match):
    d = _model_dir(tmp_path, in_config=True)
    (d / TEMPLATE_FILE).write_bytes(content)
    with pytest.raises(TokenizerError, match=match) as e:
        Tokenizer(d)
    assert TEMPLATE_FILE in str(e.value)


def test_diagnose_reports_a_bad_template_file(tmp_path, hf_checkpoint):
    from ftkit.tools.diagnose.report import diagnose

    d = tmp_path / "ckpt"
    shutil.copytree(hf_checkpoint("olmoe"), d)
    assert diagnose(d)["verdict"] == "PASS"
    (d / TEMPLATE_FILE).write_text("{% if %}")
    report = diagnose(d)
    assert report["verdict"] == "FAIL"
    assert any(TEMPLATE_FILE in p and "does not compile" in p for p in report["problems"]), report["problems"]


def test_strftime_now_in_a_gguf_template_compiles():
    """llama.cpp's GGUF of gpt-oss carries the same template in its metadata."""
    compile_template(HARMONY_LIKE, "gguf").render(messages=[], add_generation_prompt=False)
