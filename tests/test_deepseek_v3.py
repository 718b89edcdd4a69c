"""DeepSeek-V3 against transformers' eager model: a tiny random checkpoint (3 layers, the first
dense; 8 experts in 4 groups of which 2 are kept, top-2, scaled by 2.5; one shared expert; MLA
with a low-rank q, a 32-wide latent, nope 16 / rope 8 / v 16 heads; YaRN 4x with mscale_all_dim,
so the softmax scale differs from (nope + rope)^-0.5; interleaved rope), HF -> FTW -> the runtime.
A second checkpoint has Kimi-K2-like settings where they differ in kind: one group, a plain q
projection, rope without scaling and not interleaved.

Greedy tokens through the latent KV cache equal transformers' (float32, CPU) for every strategy
with a 2-expert cache, the logits to 1e-4, with both attention forms (absorbed, expanded); the
cache holds kv_lora_rank + rope values per position and layer; the conversion is bitwise;
diagnose passes with that KV size; a cached prefix resumes bitwise; FP8 block-scaled weights
dequantize as DeepSeek's reference does; GGUF as llama.cpp's converter writes deepseek2 (kv_b
whole or split into k_b/v_b) loads to the same model, f32 exactly, q8_0 within tolerance, and an
Unsloth-style mix of low-bit types per layer gives its dequantized twin's tokens.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

import fixtures as fx
import gguf_fixtures as gfx
from ftkit.errors import InputError
from ftkit.runtime.checkpoint import open_source
from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
from ftkit.runtime.ftw.reader import FTWModel
from ftkit.runtime.models import FAMILIES, family_for_config
from ftkit.runtime.models.deepseek_v3_forward import DeepseekV3Decoder
from ftkit.runtime.models.inventory import take_inventory
from ftkit.runtime.models.kv import KVCache
from ftkit.runtime.models.kv_size import KVSize, kv_size
from ftkit.runtime.synthetic import write_tokenizer
from ftkit.tools.convert.pipeline import convert, prepare
from ftkit.tools.diagnose.report import diagnose

NAME = "deepseek_v3"
CONFIG = {
    **fx._COMMON,
    "num_key_value_heads": 4,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "n_routed_experts": 8,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "intermediate_size": 96,
    "q_lora_rank": 24,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 4.0, "mscale": 1.0,
                        "mscale_all_dim": 1.0, "original_max_position_embeddings": 128,
                        "beta_fast": 32.0, "beta_slow": 1.0},
}
KIMI = {**CONFIG, "n_group": 1, "topk_group": 1, "q_lora_rank": None, "rope_interleave": False,
        "routed_scaling_factor": 2.827, "rope_parameters": {"rope_type": "default", "rope_theta": 50_000.0}}
PROMPT = torch.tensor([7, 300, 12, 45, 45, 2, 199, 81, 64, 3, 250, 17])
NEW_TOKENS = 12
STRATEGIES = [dict(strategy="fused"), dict(strategy="cpu"), dict(strategy="offload", cache_experts=2),
              dict(strategy="hybrid", cache_experts=2, bandwidth_ratio=0.5)]


def make_checkpoint(out: Path, config: dict, seed: int = 0) -> Path:
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(NAME, **config), dtype=torch.float32)
    fx._init_weights(model, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers[config["first_k_dense_replace"]:]:
            router = layer.mlp.gate  # sigmoid scores spread over (0, 1), a bias that moves the choice
            router.weight.copy_(0.15 * torch.randn(router.weight.shape, generator=gen))
            router.e_score_correction_bias.copy_(0.3 * torch.randn(router.e_score_correction_bias.shape, generator=gen))
    model.save_pretrained(out)
    write_tokenizer(out, model.config.vocab_size)
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("dsv3") / "hf", CONFIG)


@pytest.fixture(scope="module")
def ftw(hf_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dsv3-ftw") / "m.ftw"
    convert(prepare(hf_dir, dtype="float32"), out)
    return out


@pytest.fixture(scope="module")
def reference(hf_dir):
    """transformers' greedy continuation of PROMPT and each step's logits."""
    return generate_reference(hf_dir)


def generate_reference(hf_dir: Path, **overrides) -> tuple[list[int], list[torch.Tensor]]:
    ref = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", experts_implementation="eager",
                                               dtype=torch.float32, **overrides).eval()
    with torch.no_grad():
        gen = ref.generate(PROMPT[None], max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                           eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    return gen.sequences[0, len(PROMPT):].tolist(), [g[0] for g in gen.logits]


def greedy(rt: Runtime, prompt: torch.Tensor = PROMPT, n: int = NEW_TOKENS) -> tuple[list[int], list[torch.Tensor]]:
    return fx.greedy_steps(rt, prompt, n)


_rel_err = fx.max_rel_err


def assert_matches(path: Path, reference, **opts) -> None:
    want_tokens, want_logits = reference
    rt = Runtime(path, RuntimeOptions(threads=2, **opts))
    tokens, logits = greedy(rt)
    rt.close()
    assert tokens == want_tokens
    err = max(_rel_err(a, b) for a, b in zip(logits, want_logits, strict=True))
    assert err <= 1e-4, f"decode-step logits relative error {err:.2e}"


def test_spec_names_and_shapes(hf_dir):
    inv = take_inventory(open_source(hf_dir, allow_stub=False))
    spec = inv.spec
    assert spec.family == NAME and inv.problems == [] and inv.unexpected == [] and inv.missing == []
    assert spec.moe_layers == (1, 2) and spec.num_experts == 8 and spec.top_k == 2 and spec.norm_topk_prob
    assert spec.extra == dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, q_lora_rank=24, kv_lora_rank=32,
                              qk_nope_head_dim=16, v_head_dim=16, rope_interleave=True, kv_b_split=False)
    assert spec.shared_expert_intermediate_size == 32 and spec.intermediate_size == 96
    assert (spec.head_dim, spec.num_kv_heads, spec.partial_rotary_factor) == (8, 1, 1.0)
    fam = FAMILIES[NAME]
    # Kimi-K2's config.json names its own model_type (custom code) with this architecture
    assert family_for_config({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2"}) is fam
    shapes = fam.dense_shapes(spec)
    assert shapes["layers.0.attn.q_a.weight"] == (24, 64) and shapes["layers.0.attn.q_b.weight"] == (4 * 24, 24)
    assert shapes["layers.0.attn.kv_a.weight"] == (40, 64) and shapes["layers.0.attn.kv_b.weight"] == (4 * 32, 32)
    assert shapes["layers.2.attn.o.weight"] == (64, 64) and shapes["layers.1.router.bias"] == (8,)
    assert "layers.0.attn.q.weight" not in shapes and "layers.0.attn.k.weight" not in shapes
    assert fam.map_name("model.layers.1.self_attn.kv_a_proj_with_mqa.weight", False).canonical == \
        "layers.1.attn.kv_a.weight"
    assert fam.map_name("model.layers.1.self_attn.kv_a_layernorm.weight", False).canonical == \
        "layers.1.attn.kv_a_norm.weight"
    assert fam.map_name("blk.1.attn_k_b.weight", True).canonical == "layers.1.attn.k_b.weight"
    assert fam.map_name("blk.1.attn_kv_a_mqa.weight", True).canonical == "layers.1.attn.kv_a.weight"


def test_the_cache_holds_the_latent_only(ftw):
    spec = FTWModel(ftw).spec
    kv = KVCache(spec, 10)
    assert set(kv.k) == {0, 1, 2} and kv.k[0].shape == (10, 1, 32 + 8) and kv.v[0].shape == (10, 1, 0)
    assert kv_size(spec, torch.bfloat16).full == 3 * (32 + 8) * 2


@pytest.mark.parametrize("opts", STRATEGIES, ids=lambda o: "-".join(map(str, o.values())))
def test_greedy_matches_transformers_every_strategy(ftw, reference, opts):
    assert_matches(ftw, reference, **opts)


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_both_attention_forms_match_transformers(ftw, reference, form, monkeypatch):
    """Whichever form every piece takes (the prompt absorbed, or each decode step expanded)."""
    monkeypatch.setattr(DeepseekV3Decoder, "absorbs", lambda self, t: form == "absorbed")
    assert_matches(ftw, reference, strategy="cpu")


def test_a_long_prompt_expands_and_a_step_absorbs(ftw):
    dec = DeepseekV3Decoder.__new__(DeepseekV3Decoder)
    dec.spec = FTWModel(ftw).spec
    assert dec.absorbs(1) and dec.absorbs(16) and not dec.absorbs(64)


def test_convert_round_trip(hf_dir, ftw):
    with safe_open(hf_dir / "model.safetensors", "pt") as f:
        fx.assert_converted_bitwise({k: f.get_tensor(k) for k in f.keys()}, ftw, NAME)


def test_every_strategy_matches_fused_bitwise(ftw):
    from test_store import assert_strategies_match_fused

    assert_strategies_match_fused(ftw)


# Other shapes the family takes: no dense layer, two shared experts, values wider than the nope
# keys, biases on q_a/kv_a/o, tied embeddings, plain top-k weights, eight heads.
ODD = {**CONFIG, "first_k_dense_replace": 0, "n_shared_experts": 2, "v_head_dim": 24, "attention_bias": True,
       "tie_word_embeddings": True, "norm_topk_prob": False, "num_attention_heads": 8, "num_key_value_heads": 8,
       "n_group": 2, "topk_group": 1}


def test_kimi_like_settings_match_transformers(tmp_path):
    hf = make_checkpoint(tmp_path / "hf", KIMI, seed=3)
    convert(prepare(hf, dtype="float32"), tmp_path / "m.ftw")
    spec = FTWModel(tmp_path / "m.ftw").spec
    assert spec.extra["q_lora_rank"] == 0 and not spec.extra["rope_interleave"] and spec.rope_scaling is None
    assert "layers.0.attn.q.weight" in FAMILIES[NAME].dense_shapes(spec)
    assert_matches(tmp_path / "m.ftw", generate_reference(hf), strategy="hybrid", cache_experts=2,
                   bandwidth_ratio=0.5)


def test_other_shapes_match_transformers(tmp_path):
    hf = make_checkpoint(tmp_path / "hf", ODD, seed=4)
    convert(prepare(hf, dtype="float32"), tmp_path / "m.ftw")
    spec = FTWModel(tmp_path / "m.ftw").spec
    assert spec.moe_layers == (0, 1, 2) and spec.shared_expert_intermediate_size == 64 and spec.attention_bias
    assert_matches(tmp_path / "m.ftw", generate_reference(hf), strategy="hybrid", cache_experts=2,
                   bandwidth_ratio=0.5)


def test_bfloat16_logits_close_to_transformers(hf_dir, tmp_path):
    """A bf16 conversion run in bf16 against transformers in bf16 (routers float32 in both)."""
    convert(prepare(hf_dir, dtype="bfloat16"), tmp_path / "bf16.ftw")
    rt = Runtime(tmp_path / "bf16.ftw", RuntimeOptions(threads=2, strategy="cpu"))
    with torch.inference_mode():
        got = rt.step.forward(PROMPT, rt.new_kv(len(PROMPT)))
    rt.close()
    with torch.no_grad():
        want = fx.load_reference(hf_dir, dtype=torch.bfloat16)(PROMPT[None]).logits[0]
    assert got.dtype == torch.bfloat16 and _rel_err(got, want) < 2e-2


def test_prefix_resumes_bitwise(ftw):
    """A second prompt sharing 40 tokens with the first resumes from the prefix cache (the latent
    rows) and generates from the logits of a cold prefill, bitwise on the CPU."""
    fx.assert_prefix_resumes_bitwise(ftw)


def test_graph_decode_is_refused_in_one_line(ftw):
    from ftkit.runtime.engine.graphs import unsupported

    rt = Runtime(ftw, RuntimeOptions(threads=1, strategy="cpu"))
    assert unsupported(rt.decoder, rt.store) == "latent attention (MLA) is not in the graph kernels"
    rt.close()


def test_diagnose_pass_and_memory_plan(hf_dir, ftw):
    spec = FTWModel(ftw).spec
    for path in (hf_dir, ftw):
        r = diagnose(path)
        assert (r["verdict"], r["problems"], r["family"]) == ("PASS", [], NAME), r
        m = r["memory"]
        # the latent and the rope key per layer and position, not the heads' keys and values
        assert m["kv_bytes_per_1k_tokens"] == 1000 * 3 * (32 + 8) * 2
        assert m["host_expert_pool_bytes"] == 2 * 8 * m["expert_slot_bytes"]  # layers 1 and 2 only
        # the dense layer's MLP, the shared experts and MLA's projections at the plan's dtype, the
        # routers float32
        shapes = FAMILIES[NAME].dense_shapes(spec)
        assert shapes["layers.0.mlp.up.weight"] == (96, 64) and shapes["layers.2.shared.up.weight"] == (32, 64)
        assert m["dense_bytes"] == sum(math.prod(s) * (4 if ".router." in n else 2) for n, s in shapes.items())
        assert not any(label.startswith("graph") for label in m["min_gpu_terms"])


@pytest.mark.parametrize("change, words", [
    (dict(kv_lora_rank=0), "kv_lora_rank"),
    (dict(topk_group=5), "groups"),
    (dict(n_group=3), "groups"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim is 7, not even"),
    (dict(num_experts_per_tok=5, topk_group=1), "top-k"),
    (dict(scoring_func="softmax"), "routes by sigmoid"),
    (dict(q_lora_rank=-1), "q_lora_rank is -1"),
])
def test_bad_configs_are_one_line(hf_dir, tmp_path, change, words):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.update(change)
    with pytest.raises(InputError, match=words):
        FAMILIES[NAME].spec_from_config(cfg)


# ---- GGUF, as llama.cpp's converter writes deepseek2 ----------------------------------------
def write_deepseek2_gguf(hf_dir: Path, out: Path, split: bool = True, qtype: str = "F32", nextn: bool = False,
                         gating: bool = True) -> None:
    """DeepseekV2Model (convert_hf_to_gguf.py): TextModel's parameters with one KV head, the MLA
    and MoE keys, the bias renamed to `e_score_correction.bias`, experts merged per layer, the
    multi-token-prediction layer left out. `split` (newer converters): kv_b split per head into
    k_b (transposed) and v_b, key_length the latent's (kv_lora_rank + rope) and the heads' under
    key_length_mla / value_length_mla; else (older ones) kv_b whole and the heads' key_length /
    value_length. `qtype`: F32, or Q8_0 for the 2-D and 3-D weights whose rows allow it (F16
    otherwise, as the converter falls back), norms and the router kept F32. `nextn`: a copy of the
    last block appended as a kept multi-token-prediction block (counted in block_count,
    nextn_predict_layers 1), as a converter that keeps it writes. `gating`: write the sigmoid
    expert_gating_func (DeepSeek-V2's older files have none)."""
    arch, qt = gguf.MODEL_ARCH.DEEPSEEK2, gfx.QT
    hp = AutoConfig.from_pretrained(hf_dir).to_dict()
    main, heads = hp["num_hidden_layers"], hp["num_attention_heads"]
    nope, rope, v, latent = hp["qk_nope_head_dim"], hp["qk_rope_head_dim"], hp["v_head_dim"], hp["kv_lora_rank"]
    tmap = gguf.get_tensor_name_map(arch, main)
    w = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[arch])
    tensors: dict[str, torch.Tensor] = {}
    experts: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in gfx._hf_tensors(hf_dir):
        bid = next((int(p) for p in name.split(".") if p.isdecimal()), None)
        if bid is not None and bid >= main:
            continue
        if ".mlp.experts." in name:
            experts.setdefault(bid, {})[name] = t
            continue
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if split and name.endswith("kv_b_proj.weight"):
            k_b, v_b = t.view(heads, nope + v, latent).split([nope, v], dim=1)
            tensors[gfx._map(tmap, name.replace("kv_b_proj", "k_b_proj"))] = k_b.transpose(1, 2)
            tensors[gfx._map(tmap, name.replace("kv_b_proj", "v_b_proj"))] = v_b
            continue
        tensors[gfx._map(tmap, name)] = t
    for bid, layer in experts.items():
        for proj in ("down_proj", "gate_proj", "up_proj"):
            stacked = torch.stack([layer[f"model.layers.{bid}.mlp.experts.{x}.{proj}.weight"]
                                   for x in range(hp["n_routed_experts"])])
            tensors[gfx._map(tmap, f"model.layers.{bid}.mlp.experts.{proj}.weight")] = stacked
    if nextn:
        last = f"blk.{main - 1}."
        tensors.update({f"blk.{main}." + n.removeprefix(last): t for n, t in tensors.items() if n.startswith(last)})
        tensors[f"blk.{main}.nextn.eh_proj.weight"] = torch.zeros(hp["hidden_size"], 2 * hp["hidden_size"])
    for name, t in tensors.items():
        data = t.float().contiguous().numpy()
        kind = qt.F32
        if qtype == "Q8_0" and data.ndim > 1 and name.endswith(".weight") and "ffn_gate_inp" not in name:
            kind = qt.Q8_0 if data.shape[-1] % 32 == 0 else qt.F16
        w.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)

    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(hf_dir.name)
    params = {k: x for k, x in hp.items() if k != "head_dim"}  # config.json has none: transformers derives it
    ftype = gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == "Q8_0" else gguf.LlamaFileType.ALL_F32
    gfx._set_parameters(w, {**params, "num_key_value_heads": 1 if split else heads, "num_hidden_layers": main + nextn,
                            "num_experts": hp["n_routed_experts"]}, arch, ftype)
    w.add_expert_group_count(hp["n_group"])
    w.add_expert_group_used_count(hp["topk_group"])
    w.add_leading_dense_block_count(hp["first_k_dense_replace"])
    w.add_vocab_size(hp["vocab_size"])
    if hp.get("q_lora_rank") is not None:
        w.add_q_lora_rank(hp["q_lora_rank"])
    w.add_kv_lora_rank(latent)
    if split:
        w.add_key_length(latent + rope)
        w.add_value_length(latent)
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(v)
    else:
        w.add_key_length(nope + rope)
        w.add_value_length(v)
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_shared_count(hp["n_shared_experts"])
    w.add_expert_weights_scale(hp["routed_scaling_factor"])
    if hp["norm_topk_prob"]:
        w.add_expert_weights_norm(True)
    if gating:
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if nextn:
        w.add_nextn_predict_layers(1)
    w.add_rope_dimension_count(rope)
    if (hp.get("rope_parameters") or {}).get("mscale_all_dim") is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * hp["rope_parameters"]["mscale_all_dim"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("gpt2")
    w.write_header_to_file(path=out)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("split", [True, False], ids=["k_b-v_b", "kv_b"])
def test_gguf_f32_loads_to_the_same_model(hf_dir, ftw, reference, tmp_path, split):
    path = tmp_path / "m.gguf"
    write_deepseek2_gguf(hf_dir, path, split=split)
    r = diagnose(path)
    assert (r["verdict"], r["problems"], r["unexpected"], r["family"]) == ("PASS", [], [], NAME), r
    convert(prepare(path), tmp_path / "ftw")
    spec, want = FTWModel(tmp_path / "ftw").spec, FTWModel(ftw).spec
    assert spec.extra == {**want.extra, "kv_b_split": split}
    same = ("moe_layers", "num_layers", "norm_topk_prob", "shared_expert_intermediate_size", "num_heads",
            "num_kv_heads", "head_dim", "intermediate_size", "moe_intermediate_size", "rope_theta", "top_k")
    assert [getattr(spec, f) for f in same] == [getattr(want, f) for f in same]
    assert {k: spec.rope_scaling[k] for k in ("rope_type", "factor", "mscale", "mscale_all_dim")} == \
        {k: want.rope_scaling[k] for k in ("rope_type", "factor", "mscale", "mscale_all_dim")}
    assert_matches(tmp_path / "ftw", reference, strategy="hybrid", cache_experts=2, bandwidth_ratio=0.5)


def test_gguf_with_a_kept_nextn_block(hf_dir, reference, tmp_path):
    """The multi-token-prediction block, where a converter keeps it, is skipped with one line."""
    path = tmp_path / "m.gguf"
    write_deepseek2_gguf(hf_dir, path, nextn=True)
    r = diagnose(path)
    assert (r["verdict"], r["problems"], r["layers"]) == ("PASS", [], 3), r
    assert r["unexpected"] == []
    assert any(n.startswith("the multi-token-prediction layer (blk.3.*) is skipped") for n in r["notes"])
    convert(prepare(path), tmp_path / "ftw")
    assert_matches(tmp_path / "ftw", reference, strategy="cpu")


def test_a_gguf_without_sigmoid_gating_is_refused(hf_dir, tmp_path):
    path = tmp_path / "m.gguf"
    write_deepseek2_gguf(hf_dir, path, gating=False)
    with pytest.raises(InputError, match="expert_gating_func None \\(DeepSeek-V2's softmax routing\\)"):
        take_inventory(open_source(path))


def test_gguf_q8_0_within_tolerance(hf_dir, reference, tmp_path):
    """Q8_0 weights (k_b's 16-wide rows fall back to F16, as the converter does): the experts stay
    blocks, diagnose passes, the prompt's logits within q8_0's rounding of transformers'."""
    path = tmp_path / "q.gguf"
    write_deepseek2_gguf(hf_dir, path, qtype="Q8_0")
    r = diagnose(path)
    assert (r["verdict"], r["problems"], r["family"], r["expert_dtype"]) == ("PASS", [], NAME, "q8_0"), r
    convert(prepare(path), tmp_path / "ftw")
    rt = Runtime(tmp_path / "ftw", RuntimeOptions(threads=2, strategy="cpu"))
    tokens, logits = greedy(rt, n=1)
    rt.close()
    assert _rel_err(logits[0], reference[1][0]) < 2e-2


# Unsloth-style dynamic quants of this family: each MoE layer's experts in their own mix of the
# low-bit types (Q2_K, Q3_K, IQ4_XS beside Q4_K..Q6_K), the shared expert and attention in
# others; 256-wide rows so every K-quant and IQ type applies.
WIDE = {**CONFIG, "hidden_size": 256, "moe_intermediate_size": 256, "intermediate_size": 256}
UNSLOTH_MIX = {"blk.1.ffn_gate_exps.weight": "q2_k", "blk.1.ffn_up_exps.weight": "iq4_xs",
               "blk.1.ffn_down_exps.weight": "q3_k", "blk.2.ffn_gate_exps.weight": "q4_k",
               "blk.2.ffn_up_exps.weight": "q5_k", "blk.2.ffn_down_exps.weight": "q6_k",
               "blk.1.ffn_gate_shexp.weight": "q4_k", "blk.2.ffn_down_shexp.weight": "q8_0",
               "blk.0.ffn_up.weight": "iq4_nl", "blk.1.attn_kv_a_mqa.weight": "q8_0", "blk.2.attn_output.weight": "q5_0"}


def test_gguf_unsloth_style_mix_decodes_its_dequantized_twins_tokens(tmp_path):
    """Each layer's experts stay in their own blocks through convert; greedy float32 tokens on the
    cpu strategy (the CPU kernel on the blocks) and on hybrid with a 2-expert cache equal those of
    the gguf package's float32 dequantization of the same file."""
    hf = make_checkpoint(tmp_path / "hf", WIDE)
    f32 = tmp_path / "f32.gguf"
    write_deepseek2_gguf(hf, f32)
    q = gfx.requantize_gguf(f32, tmp_path / "mix.gguf", UNSLOTH_MIX)
    twin = gfx.dequantized_gguf(q, tmp_path / "twin.gguf")
    r = diagnose(q)
    assert (r["verdict"], r["problems"], r["family"]) == ("PASS", [], NAME), r
    assert set(r["memory"]["expert_formats"]) == {"q2_k", "iq4_xs", "q3_k", "q4_k", "q5_k", "q6_k"}
    for src, out in ((q, tmp_path / "q.ftw"), (twin, tmp_path / "twin.ftw")):
        convert(prepare(src), out)
    layout = FTWModel(tmp_path / "q.ftw").layout
    assert [lay.formats for lay in layout.layers] == [("q2_k", "iq4_xs", "q3_k"), ("q4_k", "q5_k", "q6_k")]
    runs = []
    for ftw, opts in ((tmp_path / "q.ftw", dict(strategy="cpu")), (tmp_path / "twin.ftw", dict(strategy="cpu")),
                      (tmp_path / "q.ftw", dict(strategy="hybrid", cache_experts=2, bandwidth_ratio=0.5))):
        rt = Runtime(ftw, RuntimeOptions(threads=2, dtype="float32", **opts))
        runs.append(greedy(rt, n=8)[0])
        rt.close()
    assert runs[0] == runs[1] == runs[2] and len(set(runs[0])) > 1


# ---- block-scaled FP8, as DeepSeek ships its checkpoints --------------------------------------
FP8_BLOCK = 16  # DeepSeek's blocks are 128 x 128; 16 gives these shapes several, some partial (24 rows)


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] as e4m3 with a float32 scale_inv per FP8_BLOCK x FP8_BLOCK block (amax / 448)."""
    b, (rows, cols) = FP8_BLOCK, w.shape
    pad = torch.zeros(-(-rows // b) * b, -(-cols // b) * b)
    pad[:rows, :cols] = w
    blocks = pad.unflatten(0, (-1, b)).unflatten(2, (-1, b))  # [R, b, C, b]
    scale = (blocks.abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).flatten(2).flatten(0, 1)[:rows, :cols].to(torch.float8_e4m3fn)
    return q, scale


def _dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """DeepSeek's reference weight_dequant: the float32 product per block, rounded once to bf16."""
    s = scale.repeat_interleave(FP8_BLOCK, 0)[: q.shape[0]].repeat_interleave(FP8_BLOCK, 1)[:, : q.shape[1]]
    return (q.float() * s).to(torch.bfloat16)


@pytest.fixture(scope="module")
def fp8_dir(hf_dir, tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """hf_dir with every linear weight but the embedding, head and routers as FP8, and a
    multi-token-prediction layer (model.layers.3: eh_proj FP8, enorm) appended; and what the
    weights the runtime serves should be (the dequantized ones, the rest as bf16)."""
    from safetensors.torch import save_file

    out = tmp_path_factory.mktemp("dsv3-fp8")
    for f in hf_dir.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    with safe_open(hf_dir / "model.safetensors", "pt") as f:
        src = {k: f.get_tensor(k) for k in f.keys()}
    gen = torch.Generator().manual_seed(9)
    src["model.layers.3.eh_proj.weight"] = 0.1 * torch.randn(64, 128, generator=gen)
    src["model.layers.3.enorm.weight"] = torch.ones(64)
    stored, served = {}, {}
    for name, t in src.items():
        if t.dim() == 2 and name.endswith("proj.weight"):
            q, scale = _fp8(t)
            stored[name], stored[name + "_scale_inv"] = q, scale
            served[name] = _dequantized(q, scale)
        else:
            stored[name] = served[name] = t.to(torch.bfloat16)  # as DeepSeek stores the rest
    save_file(stored, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    (out / "config.json").write_text(json.dumps(cfg))
    return out, {k: t for k, t in served.items() if not k.startswith("model.layers.3.")}


def test_fp8_weights_convert_to_their_dequantized_values(fp8_dir, tmp_path):
    from typer.testing import CliRunner

    from ftkit.tools.convert.cli import app

    path, served = fp8_dir
    r = diagnose(path)
    assert (r["verdict"], r["problems"], r["family"]) == ("PASS", [], NAME), r
    assert r["unexpected"] == []  # the layer's tensors are skipped by design, with the note
    assert any(n.startswith("FP8 weights") for n in r["notes"]) and any("multi-token" in n for n in r["notes"])
    result = CliRunner().invoke(app, [str(path), "-o", str(tmp_path / "m.ftw")], terminal_width=200)
    assert result.exit_code == 0, result.output
    lines = " ".join(result.output.split())
    assert "FP8 weights (e4m3, block-scaled) are dequantized to bfloat16" in lines
    assert "the multi-token-prediction layer (model.layers.3.*) is skipped" in lines
    fx.assert_converted_bitwise(served, tmp_path / "m.ftw", NAME)


def test_fp8_experts_quantize_to_blocks(fp8_dir, tmp_path):
    """`--quantize q8_0` on an FP8 checkpoint: each expert's dequantized values in Q8_0 blocks
    (the block format nearest FP8's 8 bits), the dense tensors as without it."""
    from ftkit.kernels.quantize import quantize

    path, served = fp8_dir
    convert(prepare(path, quantize="q8_0", threads=2), tmp_path / "q.ftw")
    m, fam = FTWModel(tmp_path / "q.ftw"), FAMILIES[NAME]
    assert m.layout.formats == ("q8_0",)
    banks, dense, experts = m.read_banks(pin=False), m.dense_state(), 0
    for name, t in served.items():
        mapped = fam.map_name(name, gguf=False)
        if mapped.canonical:
            assert torch.equal(dense[mapped.canonical].reshape(t.shape), t), name
        else:
            row = m.spec.moe_index(mapped.layer) * m.spec.num_experts + mapped.expert
            assert torch.equal(banks.parts(row)[mapped.part], quantize(t.float(), "q8_0")), name
            experts += 1
    assert experts == 3 * m.spec.num_expert_rows


def test_fp8_scales_that_do_not_fit_are_one_line(fp8_dir, tmp_path):
    from safetensors.torch import save_file

    path, _ = fp8_dir
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in path.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    with safe_open(path / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(InputError, match="o_proj.weight .*scale_inv is float32\\[1, 1\\], not float32 \\[4, 4\\]"):
        open_source(bad)


# ---- the bench presets -------------------------------------------------------------------------
def test_presets_have_the_published_shapes(tmp_path):
    """deepseek-v3 and kimi-k2 as their configs give them, cut to N layers as a benchmark would
    (dense first layers kept); at toy sizes ft-bench write's model loads and decodes."""
    import dataclasses

    from ftkit.runtime.random_model import write_random_ftw
    from ftkit.tools.bench.presets import preset_spec
    from ftkit.vocab import slot_layout

    ds, kimi = preset_spec("deepseek-v3"), preset_spec("kimi-k2")
    assert (ds.num_layers, ds.moe_layers[0], ds.num_experts, ds.top_k, ds.num_heads) == (61, 3, 256, 8, 128)
    assert (kimi.num_layers, kimi.moe_layers[0], kimi.num_experts, kimi.top_k, kimi.num_heads) == (61, 1, 384, 8, 64)
    assert (ds.extra["n_group"], ds.extra["topk_group"], kimi.extra["n_group"]) == (8, 4, 1)
    assert kimi.extra["routed_scaling_factor"] == 2.827 and kimi.vocab_size == 163840 and ds.vocab_size == 129280
    assert slot_layout(ds, "bfloat16").slot_bytes == 3 * 7168 * 2048 * 2  # 88 MB
    assert kv_size(ds, torch.bfloat16) == kv_size(kimi, torch.bfloat16) == KVSize(61 * 576 * 2)
    # a prefill chunk expands (its heads' keys and values, no scores), a step absorbs (its scores)
    fam = FAMILIES[NAME]
    assert fam.attention_workspace(ds, 8192, 8192, 2, True) == 2 * 8192 * 128 * (192 + 128) * 2 + 8192 * 8192
    assert fam.attention_workspace(ds, 1, 8192, 2, True) == 128 * (2 * 512 + 64 + 128) * 2 + 128 * 8192 * 4 + 8192
    cut = preset_spec("deepseek-v3", 5)
    assert cut.moe_layers == (3, 4) and cut.intermediate_size == 18432
    with pytest.raises(ValueError, match="--layers must be in 4..61"):
        preset_spec("deepseek-v3", 3)
    toy = dataclasses.replace(preset_spec("kimi-k2", 3), hidden_size=64, intermediate_size=96,
                              moe_intermediate_size=32, vocab_size=512, num_heads=4, num_experts=8,
                              extra={**kimi.extra, "q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
                                     "v_head_dim": 16}, head_dim=8)
    write_random_ftw(tmp_path / "m.ftw", toy, "bfloat16", distinct_experts=4)
    rt = Runtime(tmp_path / "m.ftw", RuntimeOptions(threads=2, strategy="hybrid", cache_experts=2,
                                                    bandwidth_ratio=0.5))
    with torch.inference_mode():
        logits = rt.step.forward(torch.arange(20), rt.new_kv(20))
    rt.close()
    assert logits.shape == (20, 512) and logits.isfinite().all()
