"""Qwen3-Next (hybrid gated DeltaNet + gated attention, MoE with a gated shared expert) against
transformers' eager model: a tiny random checkpoint (TINY_CONFIGS["qwen3_next"]: layers
linear, linear, linear, full; 2 key heads serving 4 value heads), HF -> FTW -> our decoder.

float32 logits agree to 1e-4 (relative to the largest logit), greedy decoding through our cache
(K/V plus the recurrent conv/delta state) picks transformers' tokens, bf16 agrees to bf16
rounding, every expert strategy is bitwise equal to fused, and a snapshot of the cache resumes a
prefix exactly. A GGUF written the way llama.cpp's converter writes qwen3next loads to the same
model.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from safetensors import safe_open
from test_fidelity import (
    _eager_attention,
    _rel_err,
    assert_greedy_matches,
    ftw_decoder,
    new_cache,
)
from transformers import AutoConfig

import fixtures as fx
import gguf_fixtures as gfx
from ftkit.runtime.checkpoint import open_source
from ftkit.runtime.ftw.reader import FTWModel
from ftkit.runtime.models import FAMILIES, decoder, qwen3_next, qwen3_next_forward
from ftkit.runtime.models.inventory import take_inventory
from ftkit.runtime.models.layers import attention
from ftkit.runtime.spec import FULL_ATTENTION, LINEAR_ATTENTION
from ftkit.tools.convert.pipeline import convert, prepare
from ftkit.tools.diagnose.report import diagnose

NAME = "qwen3_next"
PROMPT = torch.tensor([7, 300, 12, 45, 45, 2, 199, 81, 64, 3, 250, 17])
LONG = torch.randint(0, 320, (150,), generator=torch.Generator().manual_seed(1))  # 3 delta-rule chunks
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def hf_dir(hf_checkpoint) -> Path:
    return hf_checkpoint(NAME)


@pytest.fixture(scope="module")
def ftw(hf_dir, tmp_path_factory) -> dict[str, Path]:
    """The checkpoint converted to float32 and to bfloat16 FTW."""
    out = {}
    for dtype in ("float32", "bfloat16"):
        out[dtype] = tmp_path_factory.mktemp(f"q3n-{dtype}") / "m.ftw"
        convert(prepare(hf_dir, dtype=dtype), out[dtype])
    return out


@pytest.fixture(scope="module")
def reference(hf_dir):
    return {dt: fx.load_reference(hf_dir, dt) for dt in (torch.float32, torch.bfloat16)}


# ---- spec and names -----------------------------------------------------------------------
def test_spec_names_and_shapes(hf_dir):
    inv = take_inventory(open_source(hf_dir, allow_stub=False))
    spec = inv.spec
    assert spec.family == NAME and inv.problems == [] and inv.unexpected == []
    assert spec.layer_kinds == (LINEAR_ATTENTION,) * 3 + (FULL_ATTENTION,)
    assert spec.moe_layers == (0, 1, 2, 3) and spec.shared_expert_gate and spec.norm_topk_prob
    assert spec.partial_rotary_factor == 0.25 and spec.qk_norm == "head"
    assert spec.extra == dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                              linear_value_head_dim=16, linear_conv_kernel_dim=4, linear_in_proj="qkvz")
    fam = FAMILIES[NAME]
    assert fam.map_name("model.layers.0.linear_attn.in_proj_qkvz.weight", False).canonical == \
        "layers.0.linear_attn.in_proj_qkvz.weight"
    assert fam.map_name("model.layers.2.linear_attn.A_log", False).canonical == "layers.2.linear_attn.A_log"
    assert fam.map_name("model.layers.3.self_attn.q_proj.weight", False).canonical == "layers.3.attn.q.weight"
    shapes = fam.dense_shapes(spec)
    assert shapes["layers.3.attn.q.weight"] == (2 * 4 * 16, 64)  # query and gate per head
    assert shapes["layers.0.linear_attn.conv1d.weight"] == (2 * 32 + 64, 1, 4)
    assert not any(n.startswith("layers.0.attn.") for n in shapes)
    # without layer_types, every 4th layer is full attention (full_attention_interval)
    cfg = {**AutoConfig.from_pretrained(hf_dir).to_dict(), "layer_types": None, "num_hidden_layers": 8}
    cfg.pop("rope_parameters")
    s = fam.spec_from_config(cfg)
    assert s.layer_kinds.count(FULL_ATTENTION) == 2 and s.layer_kinds[7] == FULL_ATTENTION
    assert s.partial_rotary_factor == 0.25


# ---- fidelity -----------------------------------------------------------------------------
def test_float32_logits_and_greedy_match_transformers(ftw, reference):
    dec, ref = ftw_decoder(ftw["float32"]), reference[torch.float32]
    for prompt in (PROMPT, LONG):
        with torch.no_grad():
            want = ref(prompt[None]).logits[0]
        err = _rel_err(dec.forward(prompt, new_cache(dec, len(prompt))), want)
        assert err <= 1e-4, f"prefill of {len(prompt)}: logits relative error {err:.2e}"
        # layer by layer in pieces (a GPU prefill's order): each linear-attention layer's state
        # and each softmax layer's keys carry from one piece to the next
        err = _rel_err(dec.forward(prompt, new_cache(dec, len(prompt)), chunk=7), want)
        assert err <= 1e-4, f"layer-by-layer prefill of {len(prompt)}: logits relative error {err:.2e}"
    assert_greedy_matches(dec, ref, PROMPT, NEW_TOKENS)


def test_bfloat16_logits_close_to_transformers(ftw, reference, monkeypatch):
    dec, ref = ftw_decoder(ftw["bfloat16"]), reference[torch.bfloat16]
    for prompt in (PROMPT, LONG):
        with torch.no_grad():
            want = ref(prompt[None]).logits[0]
        monkeypatch.setattr(decoder, "attention", attention)
        got = dec.forward(prompt, new_cache(dec, len(prompt)))
        assert got.dtype == torch.bfloat16
        # SDPA accumulates differently from eager attention; random weights amplify that.
        assert _rel_err(got, want) < 3e-2
        # Everything else (the (1 + w) norms, the conv, the chunked delta rule and its casts, the
        # gated norm, the output gate) rounds as transformers does: with its attention swapped
        # in, the logits are bit-identical.
        monkeypatch.setattr(decoder, "attention", _eager_attention)
        assert torch.equal(dec.forward(prompt, new_cache(dec, len(prompt))), want)


# both scans; the batched one forming its operands a few chunks at a time, or all at once
@pytest.mark.parametrize("batched, block", [(False, 16), (True, 2), (True, 16)])
def test_delta_rule_chunked_equals_recurrent(monkeypatch, batched, block):
    monkeypatch.setattr(qwen3_next_forward, "SCAN_BLOCK", block)
    gen = torch.Generator().manual_seed(0)
    h, t, dk, dv = 3, 100, 8, 5
    q, k = (qwen3_next_forward.l2norm(torch.randn(h, t, dk, generator=gen)) for _ in range(2))
    v = torch.randn(h, t, dv, generator=gen)
    g, beta = -torch.rand(h, t, generator=gen), torch.rand(h, t, generator=gen)
    s0 = torch.randn(h, dk, dv, generator=gen)
    a, sa = qwen3_next_forward.delta_rule_recurrent(q, k, v, g, beta, s0)
    kept = s0.clone()
    b, sb = qwen3_next_forward.delta_rule_chunked(q, k, v, g, beta, s0, chunk=16, batched=batched)
    assert torch.equal(s0, kept)  # the caller's state is read, not written
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sa, sb, rtol=1e-5, atol=1e-5)


# ---- the cache: chunked prefill, snapshot / restore ---------------------------------------
def test_snapshot_restore_resumes_a_prefix(ftw):
    dec = ftw_decoder(ftw["float32"])
    a, b = PROMPT[:5], PROMPT[5:]
    whole = dec.forward(PROMPT, new_cache(dec, 40))
    cache = new_cache(dec, 40)
    first = dec.forward(a, cache)
    snap = cache.snapshot()
    assert snap.length == 5 and set(snap.states) == {0, 1, 2}
    assert snap.nbytes == qwen3_next.FAMILY.recurrent_state_bytes(dec.spec, torch.float32)
    rest = dec.forward(b, cache)
    assert _rel_err(torch.cat((first, rest)), whole) <= 1e-5
    after_b = dec.forward(torch.tensor([9]), cache)
    # Back to A (the states were copied, not aliased), then B again: identical logits.
    cache.restore(snap)
    assert cache.length == 5
    assert torch.equal(dec.forward(b, cache), rest)
    assert torch.equal(dec.forward(torch.tensor([9]), cache), after_b)
    # A different continuation of A, resumed from the same snapshot.
    cache.restore(snap)
    other = dec.forward(torch.tensor([1, 2, 3]), cache)
    fresh = new_cache(dec, 40)
    dec.forward(torch.cat((a, torch.tensor([1, 2]))), fresh)
    assert _rel_err(other[-1], dec.forward(torch.tensor([3]), fresh)[-1]) <= 1e-5
    # A recurrent state cannot be rewound by truncation, only reset.
    with pytest.raises(ValueError, match="snapshot"):
        cache.truncate(3)
    cache.truncate(0)
    assert cache.states == {} and torch.equal(dec.forward(PROMPT, cache), whole)


def test_layer_by_layer_prefill_takes_the_anchors_snapshots(ftw):
    """A GPU prefill runs as one forward, layer by layer, its pieces also ending at the anchors:
    each anchor's snapshot holds every linear-attention layer's state as that layer left it
    there, the same as separate forwards cut at the anchors leave, and resuming from one gives
    the same logits as a fresh run."""
    from ftkit.runtime.prefix_cache.prefill import prefill

    dec = ftw_decoder(ftw["float32"])
    tokens = LONG.tolist()
    points = [9, 90, len(tokens)]  # two anchors inside the prompt and its tail
    seg_logits, seg = prefill(dec, tokens, new_cache(dec, 160), points, points)
    kv = new_cache(dec, 160)
    logits, snaps = prefill(dec, tokens, kv, points, points, max_chunk=32)
    assert kv.length == len(tokens) and sorted(snaps) == sorted(seg) == points
    assert _rel_err(logits, seg_logits) <= 1e-5
    for p in points:
        assert snaps[p].length == p and snaps[p].states.keys() == seg[p].states.keys() and seg[p].states
        for i, state in seg[p].states.items():
            for name, t in state.items():
                torch.testing.assert_close(snaps[p].states[i][name], t, rtol=1e-5, atol=1e-5)
    kv.restore(snaps[9])  # resume from the first anchor: the rest as if prefilled from scratch
    rest = dec.forward(LONG[9:], kv)
    assert _rel_err(rest[-1], dec.forward(LONG, new_cache(dec, 160))[-1]) <= 1e-5


def test_expert_runner_gets_the_routing_it_was_told_to_expect(ftw):
    """Layer by layer, pieces ending at anchors inside a chunk run their experts together: the
    runner is told each layer's routing up front (`expect`, which a GPU store reads back in one
    copy), as the very tensors its `run` calls then get, in order."""
    from collections import deque

    from test_fidelity import BankExperts

    from ftkit.runtime.prefix_cache.prefill import prefill

    calls = {"expected": 0, "taken": 0}

    class Spy(BankExperts):
        ahead: deque = deque()

        def expect(self, layer, topk_ids):
            assert not self.ahead  # every one expected before was taken
            self.ahead.extend((layer, ids) for ids in topk_ids)
            calls["expected"] += len(topk_ids)

        def run(self, layer, hidden, topk_ids, topk_weights, final=True):
            want = self.ahead.popleft()
            assert want[0] == layer and want[1] is topk_ids
            calls["taken"] += 1
            return super().run(layer, hidden, topk_ids, topk_weights, final)

    dec = ftw_decoder(ftw["float32"])
    want = dec.forward(LONG, new_cache(dec, 160))[-1]
    dec.experts = Spy(dec.spec, dec.experts.banks)
    points = list(range(10, 150, 10))  # pieces of 10 tokens, batched up to 32 tokens
    logits, _ = prefill(dec, LONG.tolist(), new_cache(dec, 160), points, points, max_chunk=32)
    assert calls["taken"] == calls["expected"] == dec.spec.num_moe_layers * 5  # batches of 30 tokens
    assert _rel_err(logits, want) <= 1e-5


def test_bench_prefill_with_anchors(ftw):
    """ft-bench's `--anchors-every`: the prompt snapshots its recurrent state every N tokens, as a
    hybrid model's turn boundaries ask; cut there (CPU) or in one layer-by-layer pass (GPU's
    order, forced here), the last logits agree."""
    from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
    from ftkit.tools.bench import run

    rt = Runtime(ftw["float32"], RuntimeOptions(device="cpu", threads=2, strategy="offload", cache_experts=16))
    try:
        with torch.inference_mode():
            cut = run.prefill_forward(rt, LONG[:100], rt.new_kv(100), anchors=24)
            rt.prefill_chunk = 32
            one_pass = run.prefill_forward(rt, LONG[:100], rt.new_kv(100), anchors=24)
            rt.prefill_chunk = None
        assert _rel_err(one_pass, cut) <= 1e-5
        res = run.prefill(rt, 100, run.Figures(pcie_gbps=50.0, cpu_gbps=80.0, hbm_gbps=None), answer=2, anchors=24)
        assert res["anchors"] == 4 and res["seconds"] > 0
    finally:
        rt.close()


# ---- tools: convert, diagnose, strategies ---------------------------------------------------
def test_convert_round_trip(hf_dir, ftw):
    with safe_open(hf_dir / "model.safetensors", "pt") as f:
        fx.assert_converted_bitwise({k: f.get_tensor(k) for k in f.keys()}, ftw["float32"], NAME)


def test_diagnose_pass(hf_dir, ftw):
    for path in (hf_dir, ftw["float32"]):
        r = diagnose(path)
        assert (r["verdict"], r["problems"], r["family"]) == ("PASS", [], NAME), r


def test_every_strategy_matches_fused_bitwise(ftw):
    from test_store import assert_strategies_match_fused

    assert_strategies_match_fused(ftw["float32"])


# ---- GGUF, as llama.cpp's converter writes qwen3next ---------------------------------------
def write_qwen3next_gguf(hf_dir: Path, out: Path, outtype: str) -> None:
    """Qwen3NextModel (convert_hf_to_gguf.py): Qwen2MoeModel's parameters plus the ssm.* keys,
    and its modify_tensors (A_log -> -exp, dt_bias -> ssm_dt.bias, conv1d squeezed, +1 on the
    RMSNorms but the gated one, in_proj_qkvz split into attn_qkv [q|k|v] and attn_gate)."""
    arch = gguf.MODEL_ARCH.QWEN3NEXT
    ftype, qtype = gfx.OUTTYPES[outtype]
    hp = AutoConfig.from_pretrained(hf_dir).to_dict()
    tmap = gguf.get_tensor_name_map(arch, hp["num_hidden_layers"])
    w = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[arch])
    hk, hv = hp["linear_num_key_heads"], hp["linear_num_value_heads"]
    dk, dv = hp["linear_key_head_dim"], hp["linear_value_head_dim"]

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
        bid = next((int(p) for p in name.split(".") if p.isdecimal()), None)
        if ".mlp.experts." in name:
            experts.setdefault(bid, {})[name] = t
            continue
        if name.endswith(".A_log"):
            t = -torch.exp(t.float())
        elif name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        elif "conv1d" in name:
            t = t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        if "in_proj_qkvz.weight" in name:
            r = hv // hk
            x = t.permute(1, 0).reshape(-1, hk, 2 * dk + 2 * r * dv)
            q, k, v, z = torch.split(x, [dk, dk, r * dv, r * dv], dim=-1)
            flat = [y.reshape(hp["hidden_size"], -1) for y in (q, k, v, z)]
            add(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ATTN_QKV].format(bid=bid) + ".weight",
                torch.cat(flat[:3], dim=-1).permute(1, 0).contiguous(), bid)
            add(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ATTN_GATE].format(bid=bid) + ".weight",
                flat[3].permute(1, 0).contiguous(), bid)
            continue
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
    w.add_full_attention_interval(hp.get("full_attention_interval", 4))
    partial = hp.get("partial_rotary_factor") or hp["rope_parameters"].get("partial_rotary_factor", 0.25)
    w.add_rope_dimension_count(int(hp["head_dim"] * partial))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("gpt2")
    w.write_header_to_file(path=out)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_loads_to_the_same_model(hf_dir, ftw, reference, tmp_path):
    path = tmp_path / "m.gguf"
    write_qwen3next_gguf(hf_dir, path, "F32")
    r = diagnose(path)
    assert (r["verdict"], r["problems"], r["family"]) == ("PASS", [], NAME), r
    convert(prepare(path), tmp_path / "ftw")
    spec = FTWModel(tmp_path / "ftw").spec
    want = FTWModel(ftw["float32"]).spec
    assert spec.extra == {**want.extra, "linear_in_proj": "qkv_z"}
    assert (spec.layer_kinds, spec.partial_rotary_factor, spec.shared_expert_gate) == \
        (want.layer_kinds, want.partial_rotary_factor, want.shared_expert_gate)
    dec = ftw_decoder(tmp_path / "ftw")
    with torch.no_grad():
        logits = reference[torch.float32](PROMPT[None]).logits[0]
    # F32 GGUF: only the +1 / -exp(.) round trips separate it from the HF weights.
    assert _rel_err(dec.forward(PROMPT, new_cache(dec, len(PROMPT))), logits) <= 1e-4

    # F16: the same as transformers with the same weights rounded to float16 (this random model
    # amplifies that rounding to ~1e-2 of the logits, so compare like with like).
    write_qwen3next_gguf(hf_dir, tmp_path / "f16.gguf", "F16")
    convert(prepare(tmp_path / "f16.gguf", dtype="float32"), tmp_path / "ftw-f16")
    rounded = fx.load_reference(hf_dir)
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if p.dim() >= 2 and not name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.copy_(p.half().float())  # what the converter stores as F16
        want16 = rounded(PROMPT[None]).logits[0]
    dec = ftw_decoder(tmp_path / "ftw-f16")
    assert _rel_err(dec.forward(PROMPT, new_cache(dec, len(PROMPT))), want16) <= 1e-4

    # Q8_0 loads and converts (dequantized); its logits stay recognisably the model's.
    write_qwen3next_gguf(hf_dir, tmp_path / "q8.gguf", "Q8_0")
    assert diagnose(tmp_path / "q8.gguf")["verdict"] == "PASS"
    convert(prepare(tmp_path / "q8.gguf", dtype="float32"), tmp_path / "ftw-q8")
    dec = ftw_decoder(tmp_path / "ftw-q8")
    got = dec.forward(PROMPT, new_cache(dec, len(PROMPT)))
    assert (got.argmax(-1) == logits.argmax(-1)).float().mean() >= 0.75
