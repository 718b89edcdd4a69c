"""The decoder against transformers: tiny random checkpoints, HF -> FTW -> our forward pass.

float32 logits must agree to 1e-4 (relative to the largest logit), greedy decoding through our
KV cache must pick transformers' tokens, and bf16 must agree to bf16 rounding.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

import fixtures as fx
from ftkit.runtime.ftw.reader import FTWModel, HostBanks
from ftkit.runtime.models import FAMILIES, decoder
from ftkit.runtime.models.decoder import MoEDecoder
from ftkit.runtime.models.kv import KVCache
from ftkit.runtime.spec import ModelSpec
from ftkit.tools.convert.pipeline import convert, prepare

FAMILY_NAMES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral")
COMMON = dict(
    vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    num_experts_per_tok=2, max_position_embeddings=128, bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
CONFIGS = {
    "qwen3_moe": dict(head_dim=16, num_experts=8, moe_intermediate_size=32, intermediate_size=48, norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=8, moe_intermediate_size=32, intermediate_size=48,
                      shared_expert_intermediate_size=48, tie_word_embeddings=True),
    "olmoe": dict(num_experts=8, intermediate_size=32, clip_qkv=1.5),
    "mixtral": dict(num_local_experts=8, intermediate_size=32),
}
PROMPT = torch.tensor([7, 300, 12, 45, 45, 2, 199, 81, 64, 3, 250, 17])
NEW_TOKENS = 16


def _make_checkpoint(path: Path, model_type: str, **overrides) -> Path:
    """A random HF checkpoint whose weights are large enough that routing and attention are
    far from uniform (transformers' default init std 0.02 makes every expert look alike)."""
    cfg = AutoConfig.for_model(model_type, **{**COMMON, **CONFIGS[model_type], **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif re.search(r"mlp\.gate\.weight$", name):  # the router
                p.normal_(std=0.5)
            else:
                p.normal_(std=0.1)
    model.save_pretrained(path)
    return path


class BankExperts:
    """Reference expert runner over FTW host banks, computing as transformers' eager experts
    do: gate and up in one matmul, the weight applied to the down output, the product cast to
    the hidden dtype and summed expert by expert in ascending order (so bf16 rounds alike)."""

    def __init__(self, spec: ModelSpec, banks: HostBanks):
        self.spec, self.banks = spec, banks

    def expect(self, layer: int, topk_ids: list[torch.Tensor]) -> None:
        pass

    def run(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
            final: bool = True) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        first_row = self.spec.moe_index(layer) * self.spec.num_experts
        for e in topk_ids.unique().tolist():
            tok, k = torch.where(topk_ids == e)
            w = self.banks.parts(first_row + e)
            gate, up = F.linear(hidden[tok], torch.cat((w["gate"], w["up"]))).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, w["down"]) * topk_weights[tok, k, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


def ftw_decoder(path: Path) -> MoEDecoder:
    """Our decoder over an FTW directory, experts run by the reference BankExperts."""
    ftw = FTWModel(path)
    spec = ftw.spec
    return FAMILIES[spec.family].decoder(spec, ftw.dense_state(), BankExperts(spec, ftw.read_banks(pin=False)))


def new_cache(dec: MoEDecoder, tokens: int) -> KVCache:
    return KVCache(dec.spec, tokens, dtype=dec.w["embed.weight"].dtype)


def _load(hf_dir: Path, out: Path, dtype: torch.dtype) -> tuple[MoEDecoder, torch.nn.Module]:
    """Our decoder over the converted FTW, and transformers' eager model, both in `dtype`."""
    convert(prepare(hf_dir, dtype=str(dtype).removeprefix("torch.")), out)
    ours = ftw_decoder(out)
    ref = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=dtype, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    return ours, ref


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.float() - ref.float()).abs().max() / ref.float().abs().max())


def greedy(dec: MoEDecoder, prompt: torch.Tensor = PROMPT, n: int = NEW_TOKENS) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill, then one token at a time through the KV cache: (tokens, each step's logits)."""
    cache = new_cache(dec, len(prompt) + n)
    step = dec.forward(prompt, cache)[-1]
    tokens, logits = [], []
    for _ in range(n):
        logits.append(step)
        tokens.append(int(step.argmax()))
        step = dec.forward(torch.tensor(tokens[-1:]), cache)[-1]
    return tokens, logits


def assert_greedy_matches(dec: MoEDecoder, ref, prompt: torch.Tensor = PROMPT, n: int = NEW_TOKENS) -> None:
    """Greedy decoding through our KV cache gives transformers' tokens, and each step's logits
    agree within 1e-4 (float32)."""
    with torch.no_grad():
        gen = ref.generate(prompt[None], max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None,
                           output_logits=True, return_dict_in_generate=True)
    tokens, logits = greedy(dec, prompt, n)
    assert tokens == gen.sequences[0, len(prompt):].tolist()
    step_err = max(_rel_err(a, b[0]) for a, b in zip(logits, gen.logits, strict=True))
    assert step_err <= 1e-4, f"decode-step logits relative error {step_err:.2e}"


def _check_f32(hf_dir: Path, tmp: Path) -> None:
    ours, ref = _load(hf_dir, tmp / "ftw", torch.float32)
    with torch.no_grad():
        want = ref(PROMPT[None]).logits[0]
    err = _rel_err(ours.forward(PROMPT, KVCache(ours.spec, len(PROMPT))), want)
    assert err <= 1e-4, f"prefill logits relative error {err:.2e}"
    # layer by layer in pieces of 5 (a GPU prefill's order), each behind the keys before it
    err = _rel_err(ours.forward(PROMPT, KVCache(ours.spec, len(PROMPT)), chunk=5), want)
    assert err <= 1e-4, f"layer-by-layer prefill logits relative error {err:.2e}"
    assert_greedy_matches(ours, ref)


@pytest.mark.parametrize("model_type", FAMILY_NAMES)
def test_float32_logits_and_greedy_match_transformers(model_type: str, tmp_path: Path):
    _check_f32(_make_checkpoint(tmp_path / "hf", model_type), tmp_path)


def _eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int, window: int | None = None) -> torch.Tensor:
    """transformers' eager attention, for [T, heads, D] inputs: repeated kv heads, an additive
    causal mask, the softmax in float32 cast back before the value matmul."""
    assert window is None
    rep = q.shape[1] // k.shape[1]
    q, k, v = q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1), v.repeat_interleave(rep, 1).transpose(0, 1)
    scores = torch.matmul(q, k.transpose(1, 2)) * q.shape[-1] ** -0.5
    visible = torch.arange(k.shape[1])[None] <= torch.arange(offset, offset + q.shape[1])[:, None]
    scores = scores + torch.where(visible, 0.0, torch.finfo(scores.dtype).min).to(scores.dtype)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v).transpose(0, 1)


@pytest.mark.parametrize("model_type", FAMILY_NAMES)
def test_bfloat16_logits_close_to_transformers(model_type: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    ours, ref = _load(_make_checkpoint(tmp_path / "hf", model_type), tmp_path / "ftw", torch.bfloat16)
    with torch.no_grad():
        want = ref(PROMPT[None]).logits[0]
    got = ours.forward(PROMPT, KVCache(ours.spec, len(PROMPT), dtype=torch.bfloat16))
    assert got.dtype == torch.bfloat16
    # SDPA accumulates differently from eager attention; random weights amplify that to ~1e-2.
    assert _rel_err(got, want) < 2e-2
    # Everything else rounds exactly as transformers does: with its attention swapped in, the
    # logits are bit-identical (this is what catches a misplaced cast, e.g. Mixtral's router).
    monkeypatch.setattr(decoder, "attention", _eager_attention)
    assert torch.equal(ours.forward(PROMPT, KVCache(ours.spec, len(PROMPT), dtype=torch.bfloat16)), want)


ROPE_SCALINGS = {
    "linear": dict(factor=2.0),
    # max_position_embeddings 16 < prompt + new tokens: decoding crosses into the stretched base.
    "dynamic": dict(factor=2.0),
    "yarn": dict(factor=4.0, original_max_position_embeddings=16),
    "llama3": dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16),
}


@pytest.mark.parametrize("rope_type", ROPE_SCALINGS)
def test_rope_scaling_matches_transformers(rope_type: str, tmp_path: Path):
    rope = {"rope_type": rope_type, "rope_theta": 10000.0, **ROPE_SCALINGS[rope_type]}
    hf_dir = _make_checkpoint(tmp_path / "hf", "qwen3_moe", rope_parameters=rope,
                              max_position_embeddings=16 if rope_type == "dynamic" else 64)
    _check_f32(hf_dir, tmp_path)
    assert FTWModel(tmp_path / "ftw").spec.rope_scaling["rope_type"] == rope_type


def test_dense_mlp_layer_matches_transformers(tmp_path: Path):
    hf_dir = _make_checkpoint(tmp_path / "hf", "qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1])
    _check_f32(hf_dir, tmp_path)
    assert FTWModel(tmp_path / "ftw").spec.moe_layers == (0, 2)


def test_chunked_prefill_and_truncate_reuse_the_cache(tmp_path: Path):
    hf_dir = _make_checkpoint(tmp_path / "hf", "qwen3_moe")
    ours, _ = _load(hf_dir, tmp_path / "ftw", torch.float32)
    whole = ours.forward(PROMPT, KVCache(ours.spec, len(PROMPT)))
    cache = KVCache(ours.spec, len(PROMPT))
    first = ours.forward(PROMPT[:5], cache)
    rest = ours.forward(PROMPT[5:], cache)  # T > 1 on a non-empty cache: the offset causal mask
    assert _rel_err(torch.cat((first, rest)), whole) <= 1e-5
    cache.truncate(8)  # keep a prefix, then recompute the tail over it
    assert _rel_err(ours.forward(PROMPT[8:], cache), whole[8:]) <= 1e-5
    cache.truncate(8)  # prefill asks for the last position only
    last = ours.forward(PROMPT[8:], cache, last_only=True)
    assert last.shape[0] == 1 and _rel_err(last, whole[-1:]) <= 1e-5
    assert set(ours.last_routing) == set(ours.spec.moe_layers)


def test_sliding_window_layer_matches_transformers(tmp_path: Path):
    # The config's layer_types mark which layers slide (here layer 0); the prompt outgrows the window.
    hf_dir = _make_checkpoint(tmp_path / "hf", "qwen2_moe", use_sliding_window=True, sliding_window=5)
    _check_f32(hf_dir, tmp_path)
    spec = FTWModel(tmp_path / "ftw").spec
    assert (spec.layer_kinds, spec.sliding_window) == (("sliding_attention", "full_attention"), 5)


def test_every_layer_sliding_matches_transformers(tmp_path: Path):
    # Mixtral with a window: every layer keeps a ring (5 + 5 rows) the 28 positions wrap twice,
    # and the prefix cache resumes from an anchor's windows alone (its tree keeps no rows).
    hf_dir = _make_checkpoint(tmp_path / "hf", "mixtral", sliding_window=5)
    _check_f32(hf_dir, tmp_path)
    spec = FTWModel(tmp_path / "ftw").spec
    assert (spec.layer_kinds, spec.sliding_window) == (("sliding_attention",) * 2, 5)
    assert KVCache(spec, 100).k[0].shape[0] == 10
    fx.assert_prefix_resumes_bitwise(tmp_path / "ftw", appended=True)
