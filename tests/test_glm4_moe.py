"""GLM-4.5 MoE against transformers' eager model: a tiny random checkpoint (3 layers, the first
dense; 8 experts in 2 groups of which 1 is kept, top-2, scaled by 2.5; one ungated shared expert;
half-rotary heads with per-head Q/K norms and q/k/v biases), HF -> FTW -> our decoder.

The router's correction bias is drawn non-zero and large enough to change which experts are
chosen, so a decoder that used it for the weights too, or ignored it, would fail. float32 logits
agree to 1e-4 (relative to the largest logit), greedy decoding through our cache picks
transformers' tokens, the conversion is bitwise, diagnose passes, and every expert strategy is
bitwise equal to fused. A GGUF written the way llama.cpp's converter writes glm4moe (with a
multi-token-prediction block appended) loads to the same model.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from safetensors import safe_open
from test_fidelity import _rel_err, assert_greedy_matches, ftw_decoder, new_cache
from transformers import AutoConfig, AutoModelForCausalLM

import fixtures as fx
import gguf_fixtures as gfx
from ftkit.runtime.checkpoint import open_source
from ftkit.runtime.ftw.reader import FTWModel
from ftkit.runtime.models import FAMILIES
from ftkit.runtime.models.inventory import take_inventory
from ftkit.runtime.synthetic import write_tokenizer
from ftkit.tools.convert.pipeline import convert, prepare
from ftkit.tools.diagnose.report import diagnose

NAME = "glm4_moe"
CONFIG = {
    **fx._COMMON,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "head_dim": 16,
    "n_routed_experts": 8,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "intermediate_size": 96,
    "attention_bias": True,
    "use_qk_norm": True,
    "num_nextn_predict_layers": 0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
}
PROMPT = torch.tensor([7, 300, 12, 45, 45, 2, 199, 81, 64, 3, 250, 17])
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("glm4moe")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(NAME, **CONFIG), dtype=torch.float32)
    fx._init_weights(model, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in model.model.layers[CONFIG["first_k_dense_replace"]:]:
            router = layer.mlp.gate
            # Sigmoid scores spread over (0, 1) (0.5 would saturate most of them), and a
            # correction bias of the same order so that it moves the choice.
            router.weight.copy_(0.15 * torch.randn(router.weight.shape, generator=gen))
            router.e_score_correction_bias.copy_(0.3 * torch.randn(router.e_score_correction_bias.shape, generator=gen))
    model.save_pretrained(out)
    write_tokenizer(out, model.config.vocab_size)
    return out


@pytest.fixture(scope="module")
def ftw(hf_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("glm4moe-ftw") / "m.ftw"
    convert(prepare(hf_dir, dtype="float32"), out)
    return out


def test_spec_names_and_shapes(hf_dir):
    inv = take_inventory(open_source(hf_dir, allow_stub=False))
    spec = inv.spec
    assert spec.family == NAME and inv.problems == [] and inv.unexpected == [] and inv.missing == []
    assert spec.moe_layers == (1, 2) and spec.num_experts == 8 and spec.top_k == 2 and spec.norm_topk_prob
    assert spec.extra == dict(n_group=2, topk_group=1, routed_scaling_factor=2.5)
    assert spec.shared_expert_intermediate_size == 32 and not spec.shared_expert_gate
    assert spec.partial_rotary_factor == 0.5 and spec.qk_norm == "head"
    assert spec.attention_bias and not spec.attention_out_bias
    fam = FAMILIES[NAME]
    assert fam.map_name("model.layers.1.mlp.gate.e_score_correction_bias", False).canonical == "layers.1.router.bias"
    assert fam.map_name("model.layers.2.mlp.shared_experts.up_proj.weight", False).canonical == \
        "layers.2.shared.up.weight"
    assert fam.map_name("blk.1.exp_probs_b.bias", True).canonical == "layers.1.router.bias"
    assert fam.map_name("blk.1.post_attention_norm.weight", True).canonical == "layers.1.mlp_norm.weight"
    shapes = fam.dense_shapes(spec)
    assert shapes["layers.1.router.bias"] == (8,) and shapes["layers.0.mlp.gate.weight"] == (96, 64)
    assert "layers.0.router.weight" not in shapes and "layers.0.router.bias" not in shapes


def test_bias_steers_the_choice_only(ftw):
    """The correction bias changes which experts are chosen for some tokens, never the weights'
    values (the unbiased sigmoid scores), and only experts of the one kept group are chosen."""
    dec = ftw_decoder(ftw)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    ids, weights = dec.route(1, x)
    scores = torch.sigmoid(x @ dec.w["layers.1.router.weight"].T)
    chosen = scores.gather(1, ids)
    assert torch.allclose(weights, chosen / chosen.sum(-1, keepdim=True) * 2.5)
    assert ((ids // 4) == (ids[:, :1] // 4)).all()  # both picks in one group of 4
    bias = dec.w["layers.1.router.bias"]
    dec.w["layers.1.router.bias"] = torch.zeros_like(bias)
    unbiased, _ = dec.route(1, x)
    dec.w["layers.1.router.bias"] = bias
    assert (ids.sort(-1)[0] != unbiased.sort(-1)[0]).any(-1).sum() >= 4


def test_float32_logits_and_greedy_match_transformers(hf_dir, ftw):
    dec, ref = ftw_decoder(ftw), fx.load_reference(hf_dir)
    with torch.no_grad():
        want = ref(PROMPT[None]).logits[0]
    err = _rel_err(dec.forward(PROMPT, new_cache(dec, len(PROMPT))), want)
    assert err <= 1e-4, f"prefill logits relative error {err:.2e}"
    err = _rel_err(dec.forward(PROMPT, new_cache(dec, len(PROMPT)), chunk=5), want)  # layer by layer, pieces of 5
    assert err <= 1e-4, f"layer-by-layer prefill logits relative error {err:.2e}"
    assert_greedy_matches(dec, ref, PROMPT, NEW_TOKENS)


def test_convert_round_trip(hf_dir, ftw):
    with safe_open(hf_dir / "model.safetensors", "pt") as f:
        fx.assert_converted_bitwise({k: f.get_tensor(k) for k in f.keys()}, ftw, NAME)


def test_diagnose_pass(hf_dir, ftw):
    for path in (hf_dir, ftw):
        r = diagnose(path)
        assert (r["verdict"], r["problems"], r["family"]) == ("PASS", [], NAME), r


def test_every_strategy_matches_fused_bitwise(ftw):
    from test_store import assert_strategies_match_fused

    assert_strategies_match_fused(ftw)


# ---- GGUF, as llama.cpp's converter writes glm4moe ------------------------------------------
def write_glm4moe_gguf(hf_dir: Path, out: Path) -> None:
    """Glm4MoeModel (convert_hf_to_gguf.py), F32: TextModel's parameters plus its MoE keys, the
    bias renamed to `e_score_correction.bias`, experts merged per layer; then a copy of the last
    block as the appended NextN block (block_count counts it, nextn_predict_layers says so)."""
    arch = gguf.MODEL_ARCH.GLM4_MOE
    hp = AutoConfig.from_pretrained(hf_dir).to_dict()
    main = hp["num_hidden_layers"]
    tmap = gguf.get_tensor_name_map(arch, main + 1)
    w = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[arch])
    tensors: dict[str, torch.Tensor] = {}
    experts: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in gfx._hf_tensors(hf_dir):
        bid = next((int(p) for p in name.split(".") if p.isdecimal()), None)
        if ".mlp.experts." in name:
            experts.setdefault(bid, {})[name] = t
            continue
        tensors[gfx._map(tmap, name.replace("e_score_correction_bias", "e_score_correction.bias"))] = t
    for bid, layer in experts.items():
        for proj in ("down_proj", "gate_proj", "up_proj"):
            stacked = torch.stack([layer[f"model.layers.{bid}.mlp.experts.{x}.{proj}.weight"]
                                   for x in range(hp["n_routed_experts"])])
            tensors[gfx._map(tmap, f"model.layers.{bid}.mlp.experts.{proj}.weight")] = stacked
    last = f"blk.{main - 1}."
    tensors.update({f"blk.{main}." + n.removeprefix(last): t for n, t in tensors.items() if n.startswith(last)})
    tensors[f"blk.{main}.nextn.eh_proj.weight"] = torch.zeros(hp["hidden_size"], 2 * hp["hidden_size"])
    for name, t in tensors.items():
        w.add_tensor(name, t.float().numpy())

    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(hf_dir.name)
    gfx._set_parameters(w, {**hp, "num_hidden_layers": main + 1, "num_experts": hp["n_routed_experts"]}, arch,
                        gguf.LlamaFileType.ALL_F32)
    w.add_rope_dimension_count(int(hp["head_dim"] * hp["rope_parameters"]["partial_rotary_factor"]))
    w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    w.add_expert_shared_count(hp["n_shared_experts"])
    w.add_leading_dense_block_count(hp["first_k_dense_replace"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(hp["routed_scaling_factor"])
    w.add_expert_weights_norm(hp["norm_topk_prob"])
    w.add_nextn_predict_layers(1)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("gpt2")
    w.write_header_to_file(path=out)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_loads_to_the_same_model(hf_dir, ftw, tmp_path):
    path = tmp_path / "m.gguf"
    write_glm4moe_gguf(hf_dir, path)
    r = diagnose(path)
    assert (r["verdict"], r["problems"], r["family"]) == ("PASS", [], NAME), r
    assert r["unexpected"] and all(n.startswith("blk.3.") for n in r["unexpected"])  # the NextN block
    convert(prepare(path), tmp_path / "ftw")
    spec, want = FTWModel(tmp_path / "ftw").spec, FTWModel(ftw).spec
    # The converter writes no expert-group keys: a GGUF routes over one group.
    assert spec.extra == {**want.extra, "n_group": 1, "topk_group": 1}
    same = ("moe_layers", "num_layers", "norm_topk_prob", "shared_expert_intermediate_size", "qk_norm",
            "attention_bias", "partial_rotary_factor", "intermediate_size", "moe_intermediate_size", "head_dim")
    assert [getattr(spec, f) for f in same] == [getattr(want, f) for f in same]
    ref = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", experts_implementation="eager",
                                               dtype=torch.float32, n_group=1, topk_group=1).eval()
    with torch.no_grad():
        logits = ref(PROMPT[None]).logits[0]
    dec = ftw_decoder(tmp_path / "ftw")
    assert _rel_err(dec.forward(PROMPT, new_cache(dec, len(PROMPT))), logits) <= 1e-4


def test_router_stays_float32_in_a_bf16_runtime(ftw):
    from ftkit.runtime.engine.loader import Runtime, RuntimeOptions

    rt = Runtime(ftw, RuntimeOptions(strategy="cpu", dtype="bfloat16", threads=1))
    w = rt.decoder.w
    assert w["layers.1.router.weight"].dtype == w["layers.1.router.bias"].dtype == torch.float32
    assert w["layers.1.attn.q.weight"].dtype == torch.bfloat16
    rt.close()
