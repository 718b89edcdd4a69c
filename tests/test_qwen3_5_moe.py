"""Qwen3.5-MoE against transformers' eager model: the tiny multimodal checkpoint
(TINY_CONFIGS["qwen3_5_moe"]: Qwen3-Next's tiny text shapes under text_config, a one-block vision
tower), HF -> FTW -> our decoder, on text alone; and its text-only form.

The checks that hold for any Qwen3-Next-like model (logits and greedy tokens, bf16, the cache's
snapshots and the anchors of a layer-by-layer prefill, every expert strategy) are
test_qwen3_next's own functions, run here on this module's fixtures; what differs (names, the
split projections, the skipped vision tower, GGUF as llama.cpp's converter writes qwen35moe) is
checked below.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import pytest
import torch
from safetensors import safe_open
from test_fidelity import _rel_err, ftw_decoder, new_cache
from test_memory_plan import plan_memory
from test_qwen3_next import (  # noqa: F401 (collected here, with this module's fixtures)
    PROMPT,
    test_bfloat16_logits_close_to_transformers,
    test_float32_logits_and_greedy_match_transformers,
    test_layer_by_layer_prefill_takes_the_anchors_snapshots,
    test_snapshot_restore_resumes_a_prefix,
)
from transformers import AutoConfig

import fixtures as fx
import gguf_fixtures as gfx
from ftkit.errors import InputError
from ftkit.runtime.checkpoint import open_source
from ftkit.runtime.engine.loader import RuntimeOptions
from ftkit.runtime.ftw.reader import FTWModel
from ftkit.runtime.models import FAMILIES, family_for_config
from ftkit.runtime.models.inventory import take_inventory
from ftkit.runtime.spec import FULL_ATTENTION, LINEAR_ATTENTION
from ftkit.tools.convert.pipeline import convert, prepare
from ftkit.tools.diagnose.report import diagnose

NAME = "qwen3_5_moe"
FAM = FAMILIES[NAME]


@pytest.fixture(scope="module")
def hf_dir(hf_checkpoint) -> Path:
    return hf_checkpoint(NAME)


@pytest.fixture(scope="module")
def ftw(hf_dir, tmp_path_factory) -> dict[str, Path]:
    out = {}
    for dtype in ("float32", "bfloat16"):
        out[dtype] = tmp_path_factory.mktemp(f"q35-{dtype}") / "m.ftw"
        convert(prepare(hf_dir, dtype=dtype), out[dtype])
    return out


@pytest.fixture(scope="module")
def reference(hf_dir):
    return {dt: fx.load_reference(hf_dir, dt) for dt in (torch.float32, torch.bfloat16)}


def _text_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(hf_dir / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


# ---- spec, names, the skipped vision tower --------------------------------------------------
def test_spec_names_and_the_vision_tower_skipped(hf_dir):
    inv = take_inventory(open_source(hf_dir, allow_stub=False))
    spec = inv.spec
    assert (spec.family, spec.architecture, inv.problems) == (NAME, "Qwen3_5MoeForConditionalGeneration", [])
    assert inv.unexpected == [] and inv.skipped and all(n.startswith("model.visual.") for n in inv.skipped)
    assert inv.skipped_note() == (f"the vision tower (model.visual.*, {len(inv.skipped)} tensors) is skipped: "
                                  "the model runs text-only")
    assert spec.layer_kinds == (LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)
    assert spec.moe_layers == (0, 1, 2, 3) and spec.shared_expert_gate and spec.norm_topk_prob
    assert (spec.partial_rotary_factor, spec.rope_scaling, spec.qk_norm) == (0.25, None, "head")
    assert spec.extra == dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                              linear_value_head_dim=16, linear_conv_kernel_dim=4, linear_in_proj="qkv_z")
    m = FAM.map_name("model.language_model.layers.0.linear_attn.in_proj_b.weight", False)
    assert m.canonical == "layers.0.linear_attn.in_proj_b.weight"
    assert FAM.map_name("model.language_model.embed_tokens.weight", False).canonical == "embed.weight"
    assert FAM.map_name("model.layers.3.self_attn.q_proj.weight", False).canonical == "layers.3.attn.q.weight"
    assert FAM.map_name("mtp.fc.weight", False) is None
    shapes = FAM.dense_shapes(spec)
    assert shapes["layers.0.linear_attn.in_proj_qkv.weight"] == (2 * 32 + 64, 64)
    assert shapes["layers.0.linear_attn.in_proj_z.weight"] == (64, 64)
    assert shapes["layers.0.linear_attn.in_proj_a.weight"] == shapes["layers.0.linear_attn.in_proj_b.weight"] == (4, 64)
    assert "layers.0.linear_attn.in_proj_ba.weight" not in shapes
    r = diagnose(hf_dir)
    assert (r["verdict"], r["problems"], r["family"]) == ("PASS", [], NAME), r
    assert inv.skipped_note() in r["notes"]


def test_config_defaults_and_bad_configs(hf_dir):
    cfg = AutoConfig.from_pretrained(hf_dir).to_dict()
    text = {**cfg["text_config"], "layer_types": None, "num_hidden_layers": 8}
    s = FAM.spec_from_config({**cfg, "text_config": text})  # every 4th layer full, as transformers' default
    assert s.layer_kinds.count(FULL_ATTENTION) == 2 and s.layer_kinds[7] == FULL_ATTENTION
    assert family_for_config({"architectures": ["Qwen3_5MoeForCausalLM"]}) is FAM
    bad = {**cfg, "text_config": {**cfg["text_config"], "layer_types": ["linear_attention"] * 3 + ["mamba"]}}
    with pytest.raises(InputError, match="Qwen3.5-MoE: unknown layer type"):
        FAM.spec_from_config(bad)
    bad = {**cfg, "text_config": {k: v for k, v in cfg["text_config"].items() if k != "linear_key_head_dim"}}
    with pytest.raises(InputError, match="Qwen3.5-MoE config has no linear_key_head_dim"):
        FAM.spec_from_config(bad)


def test_convert_round_trip(hf_dir, ftw):
    src = {k: t for k, t in _text_tensors(hf_dir).items() if not k.startswith("model.visual.")}
    fx.assert_converted_bitwise(src, ftw["float32"], NAME)


def test_text_only_checkpoint_matches_transformers(hf_checkpoint, tmp_path):
    """Qwen3_5MoeForCausalLM's checkpoint (flat config, `model.*` names, no vision tower)."""
    hf = hf_checkpoint("qwen3_5_moe_text")
    inv = take_inventory(open_source(hf, allow_stub=False))
    assert (inv.spec.family, inv.problems, inv.unexpected, inv.skipped_note()) == (NAME, [], [], None)
    assert FAM.skipped_note(["mtp.fc.weight", "mtp.norm.weight"]) == \
        "the multi-token-prediction block (mtp.*, 2 tensors) is skipped: ftkit does not decode speculatively"
    convert(prepare(hf), tmp_path / "m.ftw")
    dec = ftw_decoder(tmp_path / "m.ftw")
    with torch.no_grad():
        want = fx.load_reference(hf)(PROMPT[None]).logits[0]
    assert _rel_err(dec.forward(PROMPT, new_cache(dec, len(PROMPT))), want) <= 1e-4


def test_other_shapes_tied_and_four_value_heads_per_key_head(hf_checkpoint, tmp_path):
    """Four value heads per key head, attention every other layer, the embeddings tied by the
    wrapper's flag: from HF and from GGUF (its value heads tiled four ways), transformers'
    logits and greedy tokens."""
    from test_fidelity import assert_greedy_matches

    hf = hf_checkpoint("qwen3_5_moe_tied")
    convert(prepare(hf), tmp_path / "hf.ftw")
    spec = FTWModel(tmp_path / "hf.ftw").spec
    assert spec.tie_word_embeddings and spec.layer_kinds == (LINEAR_ATTENTION, FULL_ATTENTION) * 2
    ref = fx.load_reference(hf)
    with torch.no_grad():
        want = ref(PROMPT[None]).logits[0]
    write_qwen35moe_gguf(hf, tmp_path / "m.gguf", "F32")
    convert(prepare(tmp_path / "m.gguf"), tmp_path / "gguf.ftw")
    assert FTWModel(tmp_path / "gguf.ftw").spec.extra["linear_value_order"] == "tiled"
    for path in (tmp_path / "hf.ftw", tmp_path / "gguf.ftw"):
        dec = ftw_decoder(path)
        assert _rel_err(dec.forward(PROMPT, new_cache(dec, len(PROMPT))), want) <= 1e-4, path.name
        assert_greedy_matches(dec, ref, PROMPT, 8)


# ---- strategies, memory ----------------------------------------------------------------------
def test_every_strategy_matches_fused_bitwise(ftw):
    from test_store import assert_strategies_match_fused, run_tokens

    assert_strategies_match_fused(ftw["float32"])
    # a 2-expert cache: top-2 of 8 experts, so nearly every step misses
    ref, _, _ = run_tokens(ftw["float32"], strategy="fused")
    for cfg in (dict(strategy="offload", cache_experts=2), dict(strategy="hybrid", cache_experts=2, bandwidth_ratio=0.5)):
        got, _, _ = run_tokens(ftw["float32"], **cfg)
        assert torch.equal(got, ref), cfg


def test_memory_plan_counts_the_state_and_the_one_attention_layer(ftw):
    spec = FTWModel(ftw["bfloat16"]).spec
    r = diagnose(ftw["bfloat16"])
    assert (r["verdict"], r["family"]) == ("PASS", NAME)
    # K/V only in the full-attention layer (layer 3): 2 kv heads of 16, K and V, bf16
    assert r["memory"]["kv_bytes_per_1k_tokens"] == 1000 * 2 * 1 * 2 * 16 * 2
    states = FAM.recurrent_state_bytes(spec, torch.bfloat16)
    conv = (2 * 2 * 16 + 4 * 16) * 3 * 2  # q|k|v channels x (kernel - 1), bf16
    ssm = 4 * 16 * 16 * 4  # value heads x Dk x Dv, float32
    assert states == 3 * (conv + ssm)
    opts = RuntimeOptions(device="cuda", strategy="offload", cache_experts=8)
    plan = plan_memory(ftw["bfloat16"], opts, 256)
    assert plan.graph_state_bytes == 2 * states and plan.graph_bytes == 256 * plan.kv.full + 2 * states
    assert plan_memory(ftw["bfloat16"], dataclasses.replace(opts, graphs=False), 256).graph_state_bytes == 0


# ---- GGUF, as llama.cpp's converter writes qwen35moe -----------------------------------------
def _tiled(t: torch.Tensor, dim: int, hk: int, r: int, d: int) -> torch.Tensor:
    """The converter's _reorder_v_heads: value heads grouped per key head -> tiled."""
    shape = t.shape
    return t.reshape(*shape[:dim], hk, r, d, *shape[dim + 1:]).transpose(dim, dim + 1).reshape(shape)


def write_qwen35moe_gguf(hf_dir: Path, out: Path, outtype: str) -> None:
    """Qwen3_5MoeTextModel (convert_hf_to_gguf.py): Qwen3NextModel's parameters and tensor edits
    (A_log -> -exp, dt_bias -> ssm_dt.bias, conv1d squeezed, +1 on the RMSNorms but the gated
    one), the language model's names under model.*, the vision tower and MTP dropped, and
    _LinearAttentionVReorderBase's value heads tiled (the v rows of in_proj_qkv and of the conv,
    in_proj_z, in_proj_b/a, A_log, dt_bias, out_proj's columns)."""
    arch = gguf.MODEL_ARCH.QWEN35MOE
    ftype, qtype = gfx.OUTTYPES[outtype]
    hp = AutoConfig.from_pretrained(hf_dir).to_dict()["text_config"]
    tmap = gguf.get_tensor_name_map(arch, hp["num_hidden_layers"])
    w = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[arch])
    hk, hv = hp["linear_num_key_heads"], hp["linear_num_value_heads"]
    dk, dv, r = hp["linear_key_head_dim"], hp["linear_value_head_dim"], hv // hk

    def add(name: str, t: torch.Tensor, bid: int | None) -> None:
        data = t.float().numpy() if t.dtype != torch.float16 else t.numpy()
        qt = gfx._output_type(name, data.ndim, arch, bid, qtype)
        try:
            raw = gguf.quants.quantize(data, qt)
        except gguf.QuantError:
            qt, raw = gguf.GGMLQuantizationType.F16, gguf.quants.quantize(data, gguf.GGMLQuantizationType.F16)
        w.add_tensor(name, raw, raw_dtype=qt)

    experts: dict[int, dict[str, torch.Tensor]] = {}
    for name, t in gfx._hf_tensors(hf_dir):
        if name.startswith("model.visual."):
            continue
        name = name.replace("model.language_model.", "model.")
        bid = next((int(p) for p in name.split(".") if p.isdecimal()), None)
        if ".mlp.experts." in name:
            experts.setdefault(bid, {})[name] = t
            continue
        if "linear_attn." in name:  # the V reorder first (on the HF tensors), then Qwen3Next's edits
            if ".in_proj_qkv." in name or ".conv1d." in name:
                t = t.squeeze() if ".conv1d." in name else t
                t = torch.cat((t[:2 * hk * dk], _tiled(t[2 * hk * dk:], 0, hk, r, dv)))
            elif ".in_proj_z." in name:
                t = _tiled(t, 0, hk, r, dv)
            elif ".in_proj_b." in name or ".in_proj_a." in name:
                t = _tiled(t, 0, hk, r, 1)
            elif name.endswith((".A_log", ".dt_bias")):
                t = _tiled(t[:, None], 0, hk, r, 1)[:, 0]
            elif ".out_proj." in name:
                t = _tiled(t, 1, hk, r, dv)
        if name.endswith(".A_log"):
            t = -torch.exp(t.float())
        elif name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        add(gfx._map(tmap, name), t, bid)
    for bid, layer in experts.items():
        for proj in ("down_proj", "gate_proj", "up_proj"):
            stacked = torch.stack([layer[f"model.layers.{bid}.mlp.experts.{x}.{proj}.weight"]
                                   for x in range(hp["num_experts"])])
            add(gfx._map(tmap, f"model.layers.{bid}.mlp.experts.{proj}.weight"), stacked, bid)

    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(hf_dir.name)
    gfx._set_parameters(w, hp, gguf.MODEL_ARCH.QWEN2MOE, ftype)  # Qwen2MoeModel.set_gguf_parameters
    w.add_ssm_conv_kernel(hp["linear_conv_kernel_dim"])
    w.add_ssm_state_size(dk)
    w.add_ssm_group_count(hk)
    w.add_ssm_time_step_rank(hv)
    w.add_ssm_inner_size(dv * hv)
    w.add_full_attention_interval(4)
    w.add_rope_dimension_count(int(hp["head_dim"] * hp["rope_parameters"]["partial_rotary_factor"]))
    w.add_rope_dimension_sections(hp["rope_parameters"]["mrope_section"] + [0])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("gpt2")
    w.write_header_to_file(path=out)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_loads_to_the_same_model(hf_dir, ftw, reference, tmp_path):
    path = tmp_path / "m.gguf"
    write_qwen35moe_gguf(hf_dir, path, "F32")
    r = diagnose(path)
    assert (r["verdict"], r["problems"], r["family"]) == ("PASS", [], NAME), r
    convert(prepare(path), tmp_path / "ftw")
    spec, want = FTWModel(tmp_path / "ftw").spec, FTWModel(ftw["float32"]).spec
    assert spec.extra == {**want.extra, "linear_value_order": "tiled"}  # kept as the converter wrote it
    assert (spec.layer_kinds, spec.partial_rotary_factor, spec.shared_expert_gate, spec.norm_topk_prob) == \
        (want.layer_kinds, want.partial_rotary_factor, want.shared_expert_gate, want.norm_topk_prob)
    dec = ftw_decoder(tmp_path / "ftw")
    with torch.no_grad():
        logits = reference[torch.float32](PROMPT[None]).logits[0]
    assert _rel_err(dec.forward(PROMPT, new_cache(dec, len(PROMPT))), logits) <= 1e-4
    # Q8_0: within Q8_0's rounding of what transformers computes with the same weights rounded
    # alike (this random model amplifies a weight's rounding ~100x in its logits, so compare like
    # with like): each tensor the file stores as Q8_0 rounded in the layout the converter
    # quantized it in (ssm_out's columns tiled), the others as they are.
    write_qwen35moe_gguf(hf_dir, tmp_path / "q8.gguf", "Q8_0")
    assert diagnose(tmp_path / "q8.gguf")["verdict"] == "PASS"
    convert(prepare(tmp_path / "q8.gguf", dtype="float32"), tmp_path / "ftw-q8")
    dec = ftw_decoder(tmp_path / "ftw-q8")
    got = dec.forward(PROMPT, new_cache(dec, len(PROMPT)))
    with torch.no_grad():
        want = _q8_reference(hf_dir, tmp_path / "q8.gguf")(PROMPT[None]).logits[0]
    assert _rel_err(got, want) <= 1e-4


def _q8_reference(hf_dir: Path, path: Path):
    """transformers' model with every weight rounded as the GGUF at `path` stores it: Q8_0, or
    float16 where a row does not split into Q8_0 blocks (the converter's fallback)."""
    src = open_source(path, allow_stub=False)
    stored = {}  # canonical name, or (layer, part) of the experts -> the stored type
    for n, ref in src.tensors.items():
        m = FAM.map_name(n, True)
        stored[m.canonical or (m.layer, m.part)] = ref.dtype
    qt = gguf.GGMLQuantizationType.Q8_0

    def rounded(t: torch.Tensor, dtype: str) -> torch.Tensor:
        if dtype == "float16":
            return t.half().float()
        if dtype != "q8_0":
            return t
        return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(t.numpy(), qt), qt)).reshape(t.shape)

    model = fx.load_reference(hf_dir)
    with torch.no_grad():
        for name, p in model.named_parameters():
            m = FAM.map_name(name, False)
            if m is None:  # the vision tower
                continue
            if m.canonical is None:  # the stacked experts: gate_up rounds as gate and up, alike
                p.copy_(rounded(p, stored[(m.layer, m.part.split("_")[0])]))
            elif m.canonical.endswith("linear_attn.out_proj.weight"):  # quantized with its columns tiled
                dims = (2, 2, 16)  # the tiny config's key heads, value heads per key head, value head dim
                p.copy_(_untiled(rounded(_tiled(p, 1, *dims), stored[m.canonical]), 1, *dims))
            else:
                p.copy_(rounded(p, stored[m.canonical]))
    return model


def _untiled(t: torch.Tensor, dim: int, hk: int, r: int, d: int) -> torch.Tensor:
    shape = t.shape
    return t.reshape(*shape[:dim], r, hk, d, *shape[dim + 1:]).transpose(dim, dim + 1).reshape(shape)
