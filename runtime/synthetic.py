"""A generated Qwen-style tokenizer and ChatML template, so tests and demos need no download.

`write_tokenizer` trains a byte-level BPE in-process on the small corpus below and writes the
three files `AutoTokenizer.from_pretrained` reads. Special tokens take the first ids, so their
ids are the same constants for every vocab size and tiny model configs can name them directly.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)

# Ids are positions in this list; the BPE trainer puts special tokens first, in order.
SPECIAL_TOKENS: dict[str, int] = {
    tok: i
    for i, tok in enumerate(
        [
            "<|endoftext|>",
            "<|im_start|>",
            "<|im_end|>",
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<tool_response>",
            "</tool_response>",
        ]
    )
}
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Every byte is a base token, so any text encodes; smaller vocabularies cannot be built.
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256

# Qwen2's pre-tokenizer split: contractions, letter runs, single digits, punctuation, whitespace.
_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen3-style ChatML. Consecutive tool results share one user turn, as Qwen renders them;
# tool-call arguments may be a dict or an already-serialised JSON string.
CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
{{- '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role in ['system', 'user'] %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.reasoning_content %}
{{- '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}
{%- endif %}
{%- if message.content %}{{- message.content }}{%- endif %}
{%- for tool_call in message.tool_calls or [] %}
{%- set call = tool_call.function if tool_call.function is defined else tool_call %}
{%- if not loop.first or message.content %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}
{%- if call.arguments is string %}{{- call.arguments }}
{%- else %}{{- call.arguments | tojson }}
{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# Training text: English prose, Python, JSON and a few non-ASCII words, so merges look like a
# real tokenizer's (common words, indentation, code punctuation) at any vocab size.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A mixture of experts model routes every token to a
small number of experts chosen by a learned router, so only a fraction of the weights are used
for each step. The router scores all experts, keeps the top k, and mixes their outputs with the
normalised scores. Experts that are rarely chosen can live in host memory and be fetched when
they are needed, while the attention layers, the embeddings and the hottest experts stay on the
GPU. This is why a large model can run on one card with a big pool of system memory behind it.

When the weather is good we walk along the river and talk about books, music and the history of
the old town. She said that the library opens at nine in the morning and closes at six in the
evening, except on Sundays. They were waiting for the train when it started to rain, and nobody
had brought an umbrella. Would you like a cup of tea or coffee? I think I'll have some water.
We've been working on this project for months; it's finally ready to ship, but there's still a
lot of documentation to write. Please read the instructions carefully before you begin.

Numbers and dates: 2024-05-17, 3.14159, 42, 1000000, 0x1F, version 1.2.3, 99% of the time.
Questions, answers and short replies: yes, no, maybe, thanks, sure, of course, hello, goodbye.
Accents and scripts: café, naïve, über, Straße, résumé, 你好，世界, こんにちは, Привет, 😀 🚀.

def route(hidden, router_weight, top_k=2):
    \"\"\"Return the chosen experts and their normalised weights for every token.\"\"\"
    logits = hidden @ router_weight.T
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return experts, weights.to(hidden.dtype)


class ExpertCache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.slots: dict[int, torch.Tensor] = {}
        self.hits = 0
        self.misses = 0

    def get(self, key: int) -> torch.Tensor | None:
        if key in self.slots:
            self.hits += 1
            return self.slots[key]
        self.misses += 1
        return None

    def put(self, key: int, value: torch.Tensor) -> None:
        if len(self.slots) >= self.capacity:
            oldest = next(iter(self.slots))
            del self.slots[oldest]
        self.slots[key] = value


for i in range(10):
    if i % 2 == 0:
        print(f"even: {i}")
    else:
        print("odd", i, sep=", ")

import json
import os
from pathlib import Path

config = json.loads(Path("config.json").read_text())
print(config["hidden_size"], config.get("num_experts", 0), os.cpu_count())

{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"role": "user", "content": "What is the weather like in Paris today?"}
{"role": "assistant", "content": "It is sunny and 21 degrees in Paris."}
{"type": "function", "function": {"name": "search", "description": "Search the web",
 "parameters": {"type": "object", "required": ["query"],
  "properties": {"query": {"type": "string"}}}}}

#include <stdio.h>
int main(int argc, char **argv) {
    for (int i = 0; i < argc; ++i) {
        printf("%d: %s\\n", i, argv[i]);
    }
    return 0;
}

SELECT name, count(*) AS total FROM users WHERE active = 1 GROUP BY name ORDER BY total DESC;
$ pip install --upgrade numpy && python -m pytest -q tests/
<html><body><p class="note">Hello, world!</p></body></html>
"""


def _train(vocab_size: int) -> Tokenizer:
    # No NFC normalizer (Qwen has one), so decode(encode(s)) == s holds for every string.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    return tok


def build_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE with exactly `vocab_size` ids; the same ids for the same size."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE}, got {vocab_size}")
    tok = _train(vocab_size)  # the trainer registers SPECIAL_TOKENS as added special tokens
    # The corpus runs out of merges near 1200 ids; reserved tokens fill the rest, like the
    # unused ids at the top of real vocabularies.
    tok.add_special_tokens(
        [
            AddedToken(f"<|reserved_{i}|>", special=True, normalized=False)
            for i in range(vocab_size - tok.get_vocab_size())
        ]
    )
    assert tok.get_vocab_size() == vocab_size
    assert all(tok.token_to_id(t) == i for t, i in SPECIAL_TOKENS.items())
    return tok


def write_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab_size)
    tok.save(str(out_dir / "tokenizer.json"))
    added = {
        str(i): {
            "content": t.content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in sorted(tok.get_added_tokens_decoder().items())
    }
    config = {
        # The generic class keeps tokenizer.json as written; Qwen2Tokenizer would rebuild it.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "split_special_tokens": False,
        "errors": "replace",
    }
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    )
    special_map = {
        "additional_special_tokens": config["additional_special_tokens"],
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
    }
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
