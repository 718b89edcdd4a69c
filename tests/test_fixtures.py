"""The generated checkpoints load in transformers, and each damage builder does what it says."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoTokenizer

import fixtures as fx
from ftkit.runtime import synthetic

LAYOUTS = [{}, {"sharded": True}, {"stacked": True}, {"sharded": True, "stacked": True}]
PROMPT = torch.tensor([[1, 50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150]])


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(ckpt.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.mark.parametrize("layout", LAYOUTS, ids=["single", "sharded", "stacked", "stacked-sharded"])
@pytest.mark.parametrize("name", list(fx.TINY_CONFIGS))
def test_checkpoint_loads_and_matches_single_file(hf_checkpoint, name: str, layout: dict) -> None:
    ckpt = hf_checkpoint(name, **layout)
    model = fx.load_reference(ckpt)
    with torch.no_grad():
        logits = model(PROMPT).logits
    assert logits.shape == (1, PROMPT.shape[1], 320)
    assert torch.isfinite(logits).all()
    # Visible weights: logits vary well beyond rounding and predictions vary across positions.
    assert logits.std() > 1.0 and len(set(logits.argmax(-1)[0].tolist())) > 4

    if layout.get("sharded"):
        assert len(list(ckpt.glob("*.safetensors"))) >= 3
        assert (ckpt / "model.safetensors.index.json").exists()
    names = set(_tensors(ckpt))
    stacked = bool(layout.get("stacked")) or name in fx.STACKED_ON_DISK
    assert any("experts.gate_up_proj" in n for n in names) == stacked

    single = fx.load_reference(hf_checkpoint(name))
    ref_state = single.state_dict()
    assert all(torch.equal(v, ref_state[k]) for k, v in model.state_dict().items())
    with torch.no_grad():
        # Same weights, but BLAS may block differently on differently aligned (mmapped) buffers.
        torch.testing.assert_close(logits, single(PROMPT).logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize(
    ("name", "gate", "up", "down", "prefix"),
    [
        ("qwen3_moe", "gate_proj", "up_proj", "down_proj", "mlp"),
        ("qwen2_moe", "gate_proj", "up_proj", "down_proj", "mlp"),
        ("mixtral", "w1", "w3", "w2", "block_sparse_moe"),
    ],
)
def test_stacked_layout_is_gate_rows_then_up_rows(
    hf_checkpoint, name, gate, up, down, prefix
) -> None:
    per_expert = _tensors(hf_checkpoint(name))
    stacked = _tensors(hf_checkpoint(name, stacked=True))
    gate_up = stacked["model.layers.0.mlp.experts.gate_up_proj"]
    down_proj = stacked["model.layers.0.mlp.experts.down_proj"]
    n_exp, two_i, hidden = gate_up.shape
    inter = two_i // 2
    assert down_proj.shape == (n_exp, hidden, inter)
    for e in range(n_exp):
        base = f"model.layers.0.{prefix}.experts.{e}"
        assert torch.equal(gate_up[e, :inter], per_expert[f"{base}.{gate}.weight"])
        assert torch.equal(gate_up[e, inter:], per_expert[f"{base}.{up}.weight"])
        assert torch.equal(down_proj[e], per_expert[f"{base}.{down}.weight"])

    # And transformers computes silu(gate) * up with that order: one token through expert 0.
    experts = fx.load_reference(hf_checkpoint(name)).model.layers[0].mlp.experts
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(0))
    base = f"model.layers.0.{prefix}.experts.0"
    want = (
        F.silu(x @ per_expert[f"{base}.{gate}.weight"].T)
        * (x @ per_expert[f"{base}.{up}.weight"].T)
    ) @ per_expert[f"{base}.{down}.weight"].T
    with torch.no_grad():
        got = experts(x, torch.tensor([[0]]), torch.ones(1, 1))
    torch.testing.assert_close(got, want)


def test_tokenizer_files_round_trip_and_render_tools(hf_checkpoint) -> None:
    ckpt = hf_checkpoint("qwen3_moe")
    tok = AutoTokenizer.from_pretrained(ckpt)
    raw = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    assert len(tok) == raw.get_vocab_size() == 320
    for text in [
        "def f(x):\n    return x + 1  # ok\n",
        "café naïve Straße 你好 😀\n\ttabs",
        "<|im_start|>hi<|im_end|>",
    ]:
        assert tok.decode(tok.encode(text)) == text
        assert raw.decode(raw.encode(text).ids, skip_special_tokens=False) == text
    for token, token_id in synthetic.SPECIAL_TOKENS.items():
        assert tok.encode(f"a{token}b") == [
            tok.convert_tokens_to_ids("a"),
            token_id,
            tok.convert_tokens_to_ids("b"),
        ]
    assert tok.eos_token_id == synthetic.SPECIAL_TOKENS["<|im_end|>"] and tok.bos_token is None

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "reasoning_content": "Use the tool.",
            "tool_calls": [
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": '{"temp": 21}'},
    ]
    tools = [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ]
    text = tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert (
        "<|im_start|>assistant\n<think>\nUse the tool.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
    ) in text
    assert text.endswith(
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("vocab_size", [synthetic.MIN_VOCAB_SIZE, 300, 1000, 4096])
def test_tokenizer_size_is_exact_and_deterministic(tmp_path: Path, vocab_size: int) -> None:
    synthetic.write_tokenizer(tmp_path / "a", vocab_size)
    synthetic.write_tokenizer(tmp_path / "b", vocab_size)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    assert (
        Tokenizer.from_file(str(tmp_path / "a" / "tokenizer.json")).get_vocab_size() == vocab_size
    )


# --- damage builders -------------------------------------------------------------------------


def test_truncate_safetensors(hf_checkpoint, tmp_path: Path) -> None:
    path = fx.first_shard(fx.truncate_safetensors(hf_checkpoint("qwen3_moe"), tmp_path / "bad"))
    n, header = fx.read_safetensors_header(path)
    data_end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    assert path.stat().st_size < 8 + n + data_end


def test_offsets_past_end(hf_checkpoint, tmp_path: Path) -> None:
    path = fx.first_shard(fx.offsets_past_end(hf_checkpoint("qwen3_moe"), tmp_path / "bad"))
    n, header = fx.read_safetensors_header(path)  # still a well-formed header
    data_len = path.stat().st_size - 8 - n
    past = [k for k, v in header.items() if k != "__metadata__" and v["data_offsets"][1] > data_len]
    assert len(past) == 1
    begin, end = header[past[0]]["data_offsets"]
    numel = torch.Size(header[past[0]]["shape"]).numel()
    assert end - begin == numel * 4  # float32: size still agrees with shape


def test_header_not_json(hf_checkpoint, tmp_path: Path) -> None:
    src = hf_checkpoint("qwen3_moe")
    path = fx.first_shard(fx.header_not_json(src, tmp_path / "bad"))
    assert path.stat().st_size == fx.first_shard(src).stat().st_size
    with pytest.raises(json.JSONDecodeError):
        fx.read_safetensors_header(path)


def test_bad_header_length(hf_checkpoint, tmp_path: Path) -> None:
    path = fx.first_shard(fx.bad_header_length(hf_checkpoint("qwen3_moe"), tmp_path / "bad"))
    assert int.from_bytes(path.read_bytes()[:8], "little") > path.stat().st_size


def test_missing_shard(hf_checkpoint, tmp_path: Path) -> None:
    out = fx.missing_shard(hf_checkpoint("qwen3_moe", sharded=True), tmp_path / "bad")
    named = set(
        json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values()
    )
    assert len([f for f in named if not (out / f).exists()]) == 1
    with pytest.raises(ValueError):
        fx.missing_shard(hf_checkpoint("qwen3_moe"), tmp_path / "not-sharded")


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "olmoe"])
def test_config_without_expert_count(hf_checkpoint, tmp_path: Path, name: str) -> None:
    src = hf_checkpoint(name)
    before = json.loads((src / "config.json").read_text())
    assert {"num_experts", "num_local_experts"} & before.keys()
    cfg = json.loads(
        (fx.config_without_expert_count(src, tmp_path / "bad") / "config.json").read_text()
    )
    assert not {"num_experts", "num_local_experts", "num_experts_per_tok"} & cfg.keys()


def test_unknown_architecture(hf_checkpoint, tmp_path: Path) -> None:
    out = fx.unknown_architecture(hf_checkpoint("olmoe"), tmp_path / "bad")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["FooBarForCausalLM"] and cfg["model_type"] == "foobar"


@pytest.mark.parametrize("sharded", [False, True])
def test_missing_tensor(hf_checkpoint, tmp_path: Path, sharded: bool) -> None:
    src = hf_checkpoint("qwen3_moe", sharded=sharded)
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    out = fx.missing_tensor(src, tmp_path / "bad", "layers.1.mlp.experts.3.down_proj")
    before, after = _tensors(src), _tensors(out)
    assert name not in after and set(before) - set(after) == {name}
    if sharded:
        assert (
            name not in json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        )


def test_wrong_shape(hf_checkpoint, tmp_path: Path) -> None:
    src = hf_checkpoint("qwen3_moe", stacked=True)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    out = fx.wrong_shape(src, tmp_path / "bad", "layers.0.mlp.experts.gate_up_proj")
    before, after = _tensors(src), _tensors(out)
    assert after[name].shape == (*before[name].shape[:-1], before[name].shape[-1] - 1)
    assert all(torch.equal(before[k], after[k]) for k in before if k != name)


def test_header_only_stub(hf_checkpoint, tmp_path: Path) -> None:
    src = shutil.copytree(hf_checkpoint("qwen2_moe", sharded=True), tmp_path / "src")
    (src / "sub").mkdir()
    shutil.copy(fx.first_shard(src), src / "sub" / "extra.safetensors")
    (src / "sub" / "notes.txt").write_text("kept as-is\n")
    out = fx.header_only_stub(src, tmp_path / "stub")

    for path in src.rglob("*"):
        if path.is_dir():
            continue
        stub = out / path.relative_to(src)
        if path.suffix == ".safetensors":
            n, header = fx.read_safetensors_header(path)
            assert stub.stat().st_size == 8 + n < path.stat().st_size
            assert fx.read_safetensors_header(stub) == (n, header)
        else:
            assert stub.read_bytes() == path.read_bytes()
