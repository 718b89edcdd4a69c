"""gpt-oss against transformers' eager model: a tiny random checkpoint (tests/fixtures.py: a
sliding layer with a window of 4 then a full one, YaRN, attention sinks drawn large enough to take
a real share of the softmax, a swiglu_limit of 1 so the clamps bite), HF -> FTW -> the runtime.

Greedy tokens through the KV cache equal transformers' (float32, CPU) for every strategy with a
2-expert cache, on a prompt three times the window with decoding past it; the logits agree to
1e-4. The conversion is exact (interleaved, transposed experts and their biases into the slot's
parts), MXFP4 experts (`*_blocks`, `*_scales`) dequantize to what transformers' own dequantizer
gives, ft-diagnose passes with the memory plan the runtime allocates (the sliding layer a ring of
8 rows: its window and as many more), and a cached prefix longer than the window resumes bitwise.
Graph decode (its extend, one-token and batched steps: sinks in the Triton attention kernels, the
ring addressed in place and wrapped many times) gives the eager decode's tokens and logits, on
CPU through the Triton interpreter.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

import fixtures as fx
import gguf_fixtures as gfx
from ftkit.kernels.dequant import dequantize, mxfp4_rows_from_hf
from ftkit.runtime.checkpoint import open_source
from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
from ftkit.runtime.engine.memory import longest_request, prefill_workspace_bytes
from ftkit.runtime.ftw.reader import FTWModel
from ftkit.runtime.models import FAMILIES
from ftkit.runtime.models.inventory import take_inventory
from ftkit.runtime.models.kv import KVCache
from ftkit.runtime.models.kv_size import KVSize, kv_size
from ftkit.tools.convert.pipeline import convert, prepare
from ftkit.tools.diagnose.report import diagnose
from ftkit.vocab import slot_layout

NAME = "gpt_oss"
WINDOW = fx.TINY_CONFIGS[NAME]["sliding_window"]
PROMPT = torch.tensor([7, 300, 12, 45, 45, 2, 199, 81, 64, 3, 250, 17])  # 3 windows
NEW_TOKENS = 16
STRATEGIES = [dict(strategy="fused"), dict(strategy="cpu"), dict(strategy="offload", cache_experts=2),
              dict(strategy="hybrid", cache_experts=2, bandwidth_ratio=0.5)]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return fx.make_hf_checkpoint(NAME, tmp_path_factory.mktemp("gptoss") / "hf")


@pytest.fixture(scope="module")
def ftw(hf_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gptoss-ftw") / "m.ftw"
    convert(prepare(hf_dir), out)
    return out


def load_reference(path: Path, dtype: torch.dtype = torch.float32):
    """transformers' model, skipping where it is older than the config keys the tiny config sets:
    transformers before 5.2x hard-codes the clamp at 7.0 (the GPU machine's 5.17 does), so our
    swiglu_limit 1.0 would not be its reference."""
    ref = fx.load_reference(path, dtype=dtype)
    if ref.model.layers[0].mlp.experts.limit != fx.TINY_CONFIGS[NAME]["swiglu_limit"]:
        pytest.skip(f"transformers {transformers.__version__} ignores swiglu_limit")
    return ref


@pytest.fixture(scope="module")
def reference(hf_dir):
    """transformers' greedy continuation of PROMPT and each step's logits."""
    ref = load_reference(hf_dir)
    with torch.no_grad():
        gen = ref.generate(PROMPT[None], max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                           eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    return gen.sequences[0, len(PROMPT):].tolist(), [g[0] for g in gen.logits]


def greedy(rt: Runtime, prompt: torch.Tensor = PROMPT, n: int = NEW_TOKENS) -> tuple[list[int], list[torch.Tensor]]:
    return fx.greedy_steps(rt, prompt, n)


_rel_err = fx.max_rel_err


def test_spec_names_and_shapes(hf_dir):
    inv = take_inventory(open_source(hf_dir, allow_stub=False))
    spec = inv.spec
    assert (spec.family, inv.problems, inv.unexpected, inv.missing) == (NAME, [], [], [])
    assert spec.layer_kinds == ("sliding_attention", "full_attention") and spec.sliding_window == WINDOW
    assert spec.attention_bias and spec.attention_out_bias and spec.expert_bias
    assert (spec.swiglu_alpha, spec.swiglu_limit) == (1.702, 1.0)
    assert spec.rope_scaling["rope_type"] == "yarn" and spec.rope_scaling["truncate"] is False
    assert spec.rope_theta == 150_000.0 and spec.num_experts == 8 and spec.top_k == 2
    assert inv.expert_layout == "stacked"
    shapes = FAMILIES[NAME].dense_shapes(spec)
    assert shapes["layers.0.attn.sinks"] == (4,) and shapes["layers.1.router.bias"] == (8,)
    assert shapes["layers.0.attn.o.bias"] == (64,)
    layout = slot_layout(spec, "bfloat16")
    assert [p.name for p in layout.parts] == ["gate", "up", "down", "gate_bias", "up_bias", "down_bias"]
    assert {p.dtype for p in layout.parts[3:]} == {"float32"} and layout.activation.limit == 1.0


def test_transformers_defaults_fill_a_sparse_config():
    """A config that leaves out what transformers defaults (rope, window, layer types, the
    activation's constants) gets transformers' values."""
    spec = FAMILIES[NAME].spec_from_config(dict(
        architectures=["GptOssForCausalLM"], model_type=NAME, vocab_size=320, hidden_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=32, num_local_experts=8,
        num_experts_per_tok=2))
    assert spec.layer_kinds == ("sliding_attention", "full_attention") * 2 and spec.sliding_window == 128
    assert (spec.head_dim, spec.rms_norm_eps, spec.rope_theta) == (64, 1e-5, 150_000.0)
    assert spec.rope_scaling == {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 4096}
    assert (spec.swiglu_alpha, spec.swiglu_limit) == (1.702, 7.0)


def test_convert_round_trip(hf_dir, ftw):
    """Every expert's gate and up are the even and odd columns of gate_up_proj [H, 2I],
    transposed; down is down_proj [I, H] transposed; the biases likewise, all bitwise."""
    m = FTWModel(ftw)
    spec, banks, dense = m.spec, m.read_banks(pin=False), m.dense_state()
    with safe_open(hf_dir / "model.safetensors", "pt") as f:
        src = {k: f.get_tensor(k) for k in f.keys()}
    for layer in spec.moe_layers:
        p = f"model.layers.{layer}."
        assert torch.equal(dense[f"layers.{layer}.attn.sinks"], src[p + "self_attn.sinks"])
        assert torch.equal(dense[f"layers.{layer}.router.bias"], src[p + "mlp.router.bias"])
        gate_up, gate_up_bias = src[p + "mlp.experts.gate_up_proj"], src[p + "mlp.experts.gate_up_proj_bias"]
        for e in range(spec.num_experts):
            parts = banks.parts(spec.moe_index(layer) * spec.num_experts + e)
            assert torch.equal(parts["gate"], gate_up[e][:, ::2].T) and torch.equal(parts["up"], gate_up[e][:, 1::2].T)
            assert torch.equal(parts["down"], src[p + "mlp.experts.down_proj"][e].T)
            assert torch.equal(parts["gate_bias"], gate_up_bias[e, ::2])
            assert torch.equal(parts["up_bias"], gate_up_bias[e, 1::2])
            assert torch.equal(parts["down_bias"], src[p + "mlp.experts.down_proj_bias"][e])


@pytest.mark.parametrize("opts", STRATEGIES, ids=lambda o: "-".join(map(str, o.values())))
def test_greedy_matches_transformers_every_strategy(ftw, reference, opts):
    want_tokens, want_logits = reference
    rt = Runtime(ftw, RuntimeOptions(threads=2, **opts))
    tokens, logits = greedy(rt)
    rt.close()
    assert tokens == want_tokens
    err = max(_rel_err(a, b) for a, b in zip(logits, want_logits, strict=True))
    assert err <= 1e-4, f"decode-step logits relative error {err:.2e}"


def test_bfloat16_logits_close_to_transformers(hf_dir, tmp_path):
    """A bf16 conversion run in bf16 against transformers in bf16 (which keeps the RMSNorm weights
    float32, as the runtime does): the logits agree to bf16 noise amplified by random weights."""
    convert(prepare(hf_dir, dtype="bfloat16"), tmp_path / "bf16.ftw")
    rt = Runtime(tmp_path / "bf16.ftw", RuntimeOptions(threads=2, strategy="cpu"))
    assert rt.decoder.w["layers.0.attn_norm.weight"].dtype == torch.float32
    assert rt.decoder.w["layers.0.attn.sinks"].dtype == torch.bfloat16
    with torch.inference_mode():
        got = rt.step.forward(PROMPT, rt.new_kv(len(PROMPT)))
    rt.close()
    with torch.no_grad():
        want = load_reference(hf_dir, dtype=torch.bfloat16)(PROMPT[None]).logits[0]
    assert got.dtype == torch.bfloat16 and _rel_err(got, want) < 2e-2  # 6.6e-3 here; bf16 vs f32 alike


def test_the_torch_expert_path_matches_too(ftw, reference, monkeypatch):
    """Without the compiled CPU kernel (FTKIT_CPU_KERNEL=torch) the torch path computes the same."""
    from ftkit.kernels import cpu

    monkeypatch.setattr(cpu, "load", lambda: None)
    monkeypatch.setattr("ftkit.runtime.experts.store.load_cpu_kernel", lambda: None)
    rt = Runtime(ftw, RuntimeOptions(threads=2, strategy="hybrid", cache_experts=2, bandwidth_ratio=0.5))
    assert rt.store.kernels.kernel is None
    tokens, _ = greedy(rt)
    rt.close()
    assert tokens == reference[0]


def test_sinks_and_clamps_matter(ftw):
    """The fixture exercises what is new: without the sinks the logits move far past the 1e-4
    the tests allow, and the clamps bite on a good share of the experts' gate and up values."""
    rt = Runtime(ftw, RuntimeOptions(threads=1, strategy="cpu"))
    base = greedy(rt, n=1)[1][0]
    for layer in (0, 1):
        rt.decoder.w[f"layers.{layer}.attn.sinks"] = torch.full((4,), -1e4)
    assert _rel_err(greedy(rt, n=1)[1][0], base) > 1e-2
    rt.close()
    m = FTWModel(ftw)
    parts, limit = m.read_banks(pin=False).parts(0), m.spec.swiglu_limit
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(5))  # RMS-normed-sized activations
    g, u = x @ parts["gate"].T + parts["gate_bias"], x @ parts["up"].T + parts["up_bias"]
    assert (g > limit).float().mean() > 0.05 and (u.abs() > limit).float().mean() > 0.05


# ---- graph decode (engine/graphs.py): on CPU the same step, eager, through the Triton interpreter
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None
                                  or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"),
                                  reason="needs Triton, and CUDA or TRITON_INTERPRET=1")
GRAPH_TOKENS = 20  # decoded after the 3-window prompt: the sliding layer's ring (8 rows) wraps four times
GRAPH_STRATEGIES = [dict(strategy="fused"), dict(strategy="offload", cache_experts=4),
                    dict(strategy="hybrid", cache_experts=4, bandwidth_ratio=0.5)]  # 4 slots: 2 x top-k


@needs_triton
@pytest.mark.parametrize("window", [None, 300])
def test_attention_kernels_add_the_sinks_once_per_head(window):
    """The graph step's attention (one query, keys split in chunks sized on the device) and the
    extend's (a few queries) against sink_attention: the sink joins the chunks' combine once per
    head, and at this size it takes a real share of the softmax (without it the outputs move)."""
    from ftkit.kernels.triton.attention import decode_attention, few_query_attention
    from ftkit.runtime.models.gpt_oss_forward import sink_attention

    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, d, positions, pos, t = 4, 2, 16, 768, 600, 3
    q = torch.randn((t, heads, d), generator=gen)
    k, v = (torch.randn((positions, kv_heads, d), generator=gen) for _ in range(2))
    sinks = 6.0 + torch.randn(heads, generator=gen)  # near log(keys): comparable to the scores' mass
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q1, k, v, sinks = q[-1:].to(dev), k.to(dev), v.to(dev), sinks.to(dev)
    want = sink_attention(q1, k[: pos + 1], v[: pos + 1], pos, window, sinks)
    at = torch.tensor([pos], device=dev)
    got = decode_attention(q1, k, v, at, window, sinks=sinks)  # 3 chunks of 256 keys (2 in the window)
    assert (got - want).abs().max() < 1e-5
    assert (decode_attention(q1, k, v, at, window) - want).abs().max() > 1e-2
    want = sink_attention(q.to(dev), k[: pos + 1], v[: pos + 1], pos + 1 - t, window, sinks)
    got = few_query_attention(q.to(dev), k[: pos + 1], v[: pos + 1], pos + 1 - t, window, sinks)  # 2 chunks
    assert (got - want).abs().max() < 1e-5


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_router_kernels_match_torch(dtype):
    """The graph step's fused add + norm in gpt-oss's form (the float32 weight times the float32
    value, then the cast) and its router's one launch (the top-k logits, softmaxed over those k)
    against the torch forms the CPU runs."""
    from ftkit.kernels.triton.norm import add_rms_norm
    from ftkit.kernels.triton.router import softmax_topk
    from ftkit.runtime.models.layers import rms_norm, topk_softmax

    gen = torch.Generator().manual_seed(6)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x, delta = (torch.randn((3, 100), generator=gen).to(dtype) for _ in range(2))  # a masked tail
    w = 1 + 0.1 * torch.randn(100, generator=gen)  # float32, as the loader keeps gpt-oss's
    s, h = add_rms_norm(x.to(dev), delta.to(dev), w.to(dev), 1e-5, float32=True)
    assert h.dtype == dtype
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    assert torch.allclose(h.cpu().float(), rms_norm(x + delta, w, 1e-5, float32=True).float(), **tol)
    logits = torch.randn((5, 24), generator=gen).to(dtype)
    ids, weights = softmax_topk(logits.to(dev), 4, False, dtype, top_first=True)
    want_ids, want = topk_softmax(logits, 4)
    assert torch.equal(ids.cpu(), want_ids) and weights.dtype == dtype
    assert torch.allclose(weights.cpu().float(), want.float(), **tol)


def graph_runtime(ftw: Path, **opts) -> Runtime:
    """A runtime whose step goes through GraphDecode: prompts of 2..64 tokens its extend, one
    token its graph step; on CUDA captured, on CPU run eagerly (as tests/test_graphs.py does)."""
    from ftkit.runtime.engine.graphs import GraphDecode, unsupported

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rt = Runtime(ftw, RuntimeOptions(threads=2, device=device, graphs=True, dtype="float32", **opts))
    assert unsupported(rt.decoder, rt.store) is None
    if device == "cpu":
        rt.step.graphs = GraphDecode(rt.decoder, rt.store, capacity=64, capture=False)
    return rt


def graph_greedy(rt: Runtime, prompt: torch.Tensor, n: int) -> tuple[list[int], list[torch.Tensor]]:
    """fixtures.greedy_steps on the runtime's device; the logits back on the CPU."""
    kv, tokens, logits = rt.new_kv(len(prompt) + n), [], []
    with torch.inference_mode():
        step = rt.step.forward(prompt.to(rt.device), kv)[-1]
        for _ in range(n):
            logits.append(step.float().cpu())
            tokens.append(int(step.argmax()))
            step = rt.step.forward(torch.tensor(tokens[-1:], device=rt.device), kv)[-1]
    return tokens, logits


@pytest.fixture(scope="module")
def eager_decode(ftw) -> tuple[list[int], list[torch.Tensor]]:
    rt = Runtime(ftw, RuntimeOptions(threads=2, strategy="fused", dtype="float32"))
    out = greedy(rt, n=GRAPH_TOKENS)
    rt.close()
    return out


@needs_triton
@pytest.mark.gpu
@pytest.mark.parametrize("opts", GRAPH_STRATEGIES, ids=lambda o: "-".join(map(str, o.values())))
def test_graph_decode_matches_eager(ftw, eager_decode, opts):
    """Graph decode (the prompt through its extend, each token through the graph step: sinks in
    the attention kernels, the sliding layer's window on the device, q/k/v biases in the one
    concatenated projection, YaRN tables, the biased top-k-softmax router, the experts' biases and
    clamps in the device planner's kernels and the CPU branch) gives the eager decode's tokens,
    its logits as test_graphs.py allows (float32: reduction order)."""
    want_tokens, want_logits = eager_decode
    rt = graph_runtime(ftw, **opts)
    graphs = rt.step.graphs
    assert graphs.fused is not None and set(graphs.qkv) == {0, 1} and graphs.qkv[0][1] is not None
    assert graphs.add_norm.__name__ == "fused_add_norm"  # its float32 form in one launch
    tokens, logits = graph_greedy(rt, PROMPT, GRAPH_TOKENS)
    assert rt.store.device_planner is not None and graphs.bound is not None, "the graph path did not run"
    t = rt.store.stats.totals()
    rt.close()
    assert tokens == want_tokens
    got, want = torch.stack(logits), torch.stack(want_logits)
    assert (got - want).norm() / want.norm() < 1e-3
    if opts["strategy"] == "hybrid":
        assert t.cpu and t.fills  # the doorbell CPU branch and the fills both ran


@needs_triton
@pytest.mark.gpu
def test_batched_graph_step_matches_each_sequence_alone(ftw):
    """Two sequences' next tokens in one batched step (each at its own position over its own
    cache, sinks and window in the batch form of the attention kernel) give each one's eager
    decode."""
    prompts = [PROMPT, PROMPT[3:10]]
    rt = Runtime(ftw, RuntimeOptions(threads=2, strategy="fused", dtype="float32"))
    want = [greedy(rt, p, n=3)[1] for p in prompts]
    rt.close()
    rt = graph_runtime(ftw, strategy="fused")
    kvs = [rt.new_kv(len(p) + 3) for p in prompts]
    with torch.inference_mode():
        steps = [rt.step.forward(p.to(rt.device), kv)[-1:] for p, kv in zip(prompts, kvs, strict=True)]
        assert rt.step.graphs.batched(kvs)
        got = [torch.cat(steps)]
        for _ in range(2):
            got.append(rt.step.batch(got[-1].argmax(-1), kvs))
    rt.close()
    got = [g.float().cpu() for g in got]
    for b in range(2):
        ours, theirs = torch.stack([g[b] for g in got]), torch.stack(want[b])
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
        assert (ours - theirs).norm() / theirs.norm() < 1e-3


@needs_triton
@pytest.mark.gpu
def test_graph_paths_wrap_the_sliding_ring(ftw):
    """The sliding layer keeps a ring of 8 rows (its window of 4 and as many more), in the graphs'
    static buffers as in each cache: extends of up to 5 tokens (what the ring holds beside a
    window: longer ones run the decoder's forward), one-token graph steps and batched steps, the
    ring wrapped many times over, give the eager forward's logits over the same tokens, whose
    own ring took the 48 tokens in one piece."""
    rt = graph_runtime(ftw, strategy="fused")
    graphs = rt.step.graphs
    assert graphs.k[0].shape[0] == 8 < graphs.k[1].shape[0] == graphs.capacity and graphs.takes(5) and not graphs.takes(6)
    ids = torch.randint(0, 256, (48,), generator=torch.Generator().manual_seed(4))
    runs = [7, 5, 1, 3, 1, 1, 4, 5, 2, 1, 5, 1, 1, 1, 5, 3, 1, 1]  # prompt, extends and steps
    kv, got = rt.new_kv(48), []
    with torch.inference_mode():
        at = 0
        for n in runs:
            got.append(rt.step.forward(ids[at : at + n].to(rt.device), kv).float().cpu())
            at += n
        assert at == 48 and kv.k[0].shape[0] == 8
        want = rt.decoder.forward(ids.to(rt.device), rt.new_kv(48)).float().cpu()  # eager, one piece
        got = torch.cat(got)
        assert torch.equal(got.argmax(-1), want.argmax(-1)) and (got - want).norm() / want.norm() < 1e-3
        # two sequences' batched steps, each past its ring, against each one's eager steps
        kvs = [rt.new_kv(40), rt.new_kv(40)]
        prompts = [ids[:9], ids[20:23]]
        steps = [rt.step.forward(p.to(rt.device), c)[-1:] for p, c in zip(prompts, kvs, strict=True)]
        assert rt.step.graphs.batched(kvs)
        batched = [torch.cat(steps)]
        for _ in range(12):
            batched.append(rt.step.batch(batched[-1].argmax(-1), kvs))
    rt.close()
    eager = Runtime(ftw, RuntimeOptions(threads=2, strategy="fused", dtype="float32"))
    for b, p in enumerate(prompts):
        ours = torch.stack([g[b].float().cpu() for g in batched])
        theirs = torch.stack(greedy(eager, p, n=13)[1])
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1)) and (ours - theirs).norm() / theirs.norm() < 1e-3
    eager.close()


def test_every_strategy_matches_fused_bitwise(ftw):
    from test_store import assert_strategies_match_fused

    assert_strategies_match_fused(ftw)


def test_prefix_longer_than_the_window_resumes_bitwise(ftw):
    """A second prompt holding the first's 48 tokens (twelve windows) resumes from the prefix
    cache (the full layer's rows from the tree, the sliding layer's window from the anchor at the
    first's tail) and generates from the logits of a cold prefill, bitwise on the CPU."""
    fx.assert_prefix_resumes_bitwise(ftw, appended=True)


def test_diagnose_pass_and_memory_plan(hf_dir, ftw):
    spec = FTWModel(ftw).spec
    for path in (hf_dir, ftw):
        r = diagnose(path)
        assert (r["verdict"], r["problems"], r["family"]) == ("PASS", [], NAME), r
        m = r["memory"]
        # the full layer a row per position; the sliding one a ring of the window (4) and as many
        # rows of headroom (a graph extend's keys), whatever the context
        row = 2 * 2 * 16 * 2  # one layer's K and V of a position, bf16
        assert kv_size(spec, torch.bfloat16) == KVSize(full=row, sliding=row, ring=8, saved=3)
        assert (m["kv_bytes_per_1k_tokens"], m["kv_window_bytes"]) == (1000 * row, 8 * row)
        assert m["min_gpu_terms"]["KV 1000 tokens"] == 1008 * row
        assert m["expert_slot_bytes"] == slot_layout(spec, m["expert_dtype"]).slot_bytes
        assert m["host_expert_pool_bytes"] == spec.num_expert_rows * m["expert_slot_bytes"]
        # the prefix cache: the full layer's rows of the whole context, a saved window (3 rows)
        # of the sliding one at each of its 32 anchors
        assert m["prefix_cache_bytes"] == spec.max_position_embeddings * row + 32 * 3 * row
        # graph decode's static K/V for the longest request, the sliding layer's a ring too;
        # sink attention's score blocks and the sliding layer's gathered window in the workspace
        context = longest_request(spec, 1000)  # the tiny model's 512 positions
        assert m["min_gpu_terms"][f"graph K/V {context} tokens"] == (context + 8) * row
        want = prefill_workspace_bytes(spec, context, torch.bfloat16)
        assert m["min_gpu_terms"]["prefill workspace"] == want > 5 * 4 * context * (context + 1) * 2
    # what KVCache allocates: the plan's figure; a sequence shorter than the ring, its length
    kv = KVCache(spec, 1000, torch.bfloat16, "meta")
    assert sum(t.nbytes for t in (*kv.k.values(), *kv.v.values())) == m["min_gpu_terms"]["KV 1000 tokens"]
    assert (kv.k[0].shape, kv.k[1].shape) == ((8, 2, 16), (1000, 2, 16))
    assert KVCache(spec, 5).k[0].shape == (5, 2, 16)


def test_the_ring_keeps_what_its_queries_read_and_no_more(ftw):
    """The sliding layer's ring (8 rows, window 4) hands each piece the window's older keys and its
    own in position order, keeps a piece longer than itself by its last rows, and refuses to
    rewind (truncate, snapshot) to a position whose window it no longer holds."""
    spec = FTWModel(ftw).spec
    kv = KVCache(spec, 40)
    rows = torch.arange(40.0)[:, None, None].expand(40, 2, 16)  # each key holds its position

    def append(a: int, b: int) -> tuple[list[float], int]:
        keys, values, offset = kv.append(0, rows[a:b], -rows[a:b])
        kv.advance(b - a)
        assert torch.equal(values, -keys)
        return keys[:, 0, 0].tolist(), offset

    assert append(0, 20) == (list(range(20)), 0)  # longer than the ring: its last 8 rows stay
    assert append(20, 22) == (list(range(17, 22)), 3)  # positions 17..19 from the ring, then its own
    assert kv.k[0][torch.arange(14, 22) % 8, 0, 0].tolist() == list(range(14, 22))
    assert kv.snapshot(19).windows[0][0][:, 0, 0].tolist() == [16, 17, 18]
    with pytest.raises(ValueError, match="state is gone"):
        kv.snapshot(16)  # needs 13, overwritten by 21
    kv.truncate(19)
    with pytest.raises(ValueError, match="no longer hold"):
        kv.truncate(16)  # still gone: a truncate does not bring 13 back
    assert append(19, 21) == (list(range(16, 21)), 3)
    snap = kv.snapshot()
    kv.truncate(0)
    kv.restore(snap)  # the window alone: nothing before it
    assert kv.windows(0, 21)[0][:, 0, 0].tolist() == [18, 19, 20] and not kv.holds(20)


# ---- MXFP4 experts, as the released checkpoints store them -----------------------------------
def _mxfp4(shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks [..., G, 16] (every nibble) and scales [..., G] around 2**-4..2**0."""
    *rows, cols = shape
    blocks = torch.randint(0, 256, (*rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(121, 128, (*rows, cols // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_rows_dequantize_as_transformers_does():
    gen = torch.Generator().manual_seed(3)
    blocks, scales = _mxfp4((3, 10, 96), gen)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # every code in both nibbles
    scales[0, 0, 0] = 1  # and the smallest scales, where ggml's half scale is subnormal
    scales[0, 0, 1] = 0
    ours = dequantize(mxfp4_rows_from_hf(blocks, scales), "mxfp4")
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    assert torch.equal(ours, want)


@pytest.fixture(scope="module")
def mxfp4_dirs(hf_dir, tmp_path_factory) -> tuple[Path, Path]:
    """The fixture checkpoint with its expert matrices replaced by random MXFP4 blocks (as the
    released gpt-oss checkpoints store them), and the same model with those experts dequantized by
    transformers' own function into bf16 `gate_up_proj`/`down_proj`."""
    root = tmp_path_factory.mktemp("gptoss-mxfp4")
    quant, plain = root / "mxfp4", root / "dequantized"
    gen = torch.Generator().manual_seed(4)
    with safe_open(hf_dir / "model.safetensors", "pt") as f:
        src = {k: f.get_tensor(k) for k in f.keys()}
    q, d = dict(src), dict(src)
    for name in [n for n in src if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, rows_in, out = src[name].shape  # stored [E, in, out]
        blocks, scales = _mxfp4((e, out, rows_in), gen)
        del q[name]
        q[name + "_blocks"], q[name + "_scales"] = blocks, scales
        d[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
    cfg = json.loads((hf_dir / "config.json").read_text())
    for path, tensors, extra in ((quant, q, {"quantization_config": {"quant_method": "mxfp4"}}), (plain, d, {})):
        shutil.copytree(hf_dir, path)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps({**cfg, **extra}))
    return quant, plain


def test_mxfp4_experts_keep_their_blocks(mxfp4_dirs, tmp_path, capsys):
    """FTW keeps the checkpoint's MXFP4 experts as ggml's MXFP4 blocks (gate and up rows taken
    apart as for floats), whose values are transformers' dequantization, bit for bit; with
    --dtype bfloat16 they are those values."""
    quant, plain = mxfp4_dirs
    inv = take_inventory(open_source(quant, allow_stub=False))
    assert inv.problems == [] and inv.unexpected == [] and inv.expert_dtypes == {"mxfp4"}
    convert(prepare(quant), tmp_path / "q.ftw")
    convert(prepare(quant, dtype="bfloat16"), tmp_path / "qb.ftw")
    convert(prepare(plain), tmp_path / "p.ftw")
    a, ab, b = (FTWModel(tmp_path / n) for n in ("q.ftw", "qb.ftw", "p.ftw"))
    assert a.layout.formats == ("mxfp4",) and a.layout.biased and ab.layout == b.layout
    assert a.layout.slot_bytes < b.layout.slot_bytes / 3
    banks_a, banks_ab, banks_b = a.read_banks(pin=False), ab.read_banks(pin=False), b.read_banks(pin=False)
    for row in range(a.spec.num_expert_rows):
        lay = a.layout.for_row(row)
        for n, t in banks_a.parts(row).items():
            p = lay.part(n)
            got = dequantize(t, p.dtype).reshape(p.shape).to(torch.bfloat16) if p.dtype == "mxfp4" else t
            assert torch.equal(got, banks_b.parts(row)[n]) and torch.equal(banks_ab.parts(row)[n], banks_b.parts(row)[n])
    assert all(torch.equal(t, b.dense_state()[n]) for n, t in a.dense_state().items())
    r = diagnose(quant)
    assert (r["verdict"], r["problems"]) == ("PASS", []), r
    stub = diagnose(fx.header_only_stub(quant, tmp_path / "stub"))  # what CI fetches: headers alone
    assert (stub["verdict"], stub["header_only"], stub["memory"]) == ("PASS", True, r["memory"]), stub


def test_mxfp4_model_greedy_matches_transformers(mxfp4_dirs, tmp_path):
    """The MXFP4 model generates transformers' tokens (its reference: the dequantized experts)."""
    quant, plain = mxfp4_dirs
    convert(prepare(quant), tmp_path / "q.ftw")
    ref = load_reference(plain)
    with torch.no_grad():
        want = ref.generate(PROMPT[None], max_new_tokens=8, do_sample=False, pad_token_id=0,
                            eos_token_id=None)[0, len(PROMPT):].tolist()
    rt = Runtime(tmp_path / "q.ftw", RuntimeOptions(threads=2, strategy="hybrid", cache_experts=2,
                                                    bandwidth_ratio=0.5))
    assert greedy(rt, n=8)[0] == want
    rt.close()


# ---- GGUF, as llama.cpp's converter writes gpt-oss -------------------------------------------
def write_gpt_oss_gguf(hf_dir: Path, out: Path) -> None:
    """GptOssModel (convert_hf_to_gguf.py) on bf16/f32 experts, F32: TextModel's parameters plus
    the window and the expert width; the sinks named `.weight`; gate_up_proj transposed to
    [E, 2I, H] and split into its even (gate) and odd (up) rows, its bias alike; down_proj
    transposed; everything else through the arch's tensor map."""
    arch = gguf.MODEL_ARCH.GPT_OSS
    hp = AutoConfig.from_pretrained(hf_dir).to_dict()
    tmap = gguf.get_tensor_name_map(arch, hp["num_hidden_layers"])
    w = gguf.GGUFWriter(path=None, arch=gguf.MODEL_ARCH_NAMES[arch])
    for name, t in gfx._hf_tensors(hf_dir):
        if name.endswith("sinks"):
            name += ".weight"
        if name.endswith("experts.gate_up_proj"):
            t = t.transpose(-1, -2)
            out_pairs = (("gate_proj.weight", t[:, ::2, :]), ("up_proj.weight", t[:, 1::2, :]))
        elif name.endswith("experts.gate_up_proj_bias"):
            out_pairs = (("gate_proj.bias", t[..., ::2]), ("up_proj.bias", t[..., 1::2]))
        elif name.endswith("experts.down_proj"):
            out_pairs = (("down_proj.weight", t.transpose(-1, -2)),)
        elif name.endswith("experts.down_proj_bias"):
            out_pairs = (("down_proj.bias", t),)
        else:
            w.add_tensor(gfx._map(tmap, name), t.float().numpy())
            continue
        base = name[: name.index("experts.") + len("experts.")]
        for suffix, part in out_pairs:
            w.add_tensor(gfx._map(tmap, base + suffix), part.float().contiguous().numpy())
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(hf_dir.name)
    gfx._set_parameters(w, hp, arch, gguf.LlamaFileType.ALL_F32)
    w.add_sliding_window(hp["sliding_window"])
    w.add_expert_feed_forward_length(hp["intermediate_size"])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("gpt2")
    w.write_header_to_file(path=out)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_loads_to_the_same_model(hf_dir, ftw, reference, tmp_path):
    path = tmp_path / "m.gguf"
    write_gpt_oss_gguf(hf_dir, path)
    r = diagnose(path)
    assert (r["verdict"], r["problems"], r["unexpected"], r["family"]) == ("PASS", [], [], NAME), r
    convert(prepare(path), tmp_path / "ftw")
    spec, want = FTWModel(tmp_path / "ftw").spec, FTWModel(ftw).spec
    same = ("layer_kinds", "sliding_window", "rope_theta", "rope_scaling", "moe_layers", "num_experts", "top_k",
            "moe_intermediate_size", "head_dim", "expert_bias", "swiglu_alpha", "attention_out_bias")
    assert [getattr(spec, f) for f in same] == [getattr(want, f) for f in same]
    # the GGUF carries no limit (llama.cpp fixes transformers' default, 7.0); the fixture's 1.0
    # is its HF config's own, so the reference here is transformers with 7.0
    assert spec.swiglu_limit == 7.0
    src = FTWModel(ftw).read_banks(pin=False)
    rt = Runtime(tmp_path / "ftw", RuntimeOptions(threads=2, strategy="hybrid", cache_experts=2, bandwidth_ratio=0.5))
    assert all(torch.equal(t, src.parts(row)[n]) for row in range(spec.num_expert_rows)
               for n, t in rt.pool.banks.parts(row).items())
    ref = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager", experts_implementation="eager",
                                               dtype=torch.float32, swiglu_limit=7.0).eval()
    with torch.no_grad():
        gen = ref.generate(PROMPT[None], max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                           eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    tokens, logits = greedy(rt)
    rt.close()
    assert tokens == gen.sequences[0, len(PROMPT):].tolist()
    assert max(_rel_err(a, b[0]) for a, b in zip(logits, gen.logits, strict=True)) <= 1e-4


def test_gguf_fused_gate_up_converts_as_apart(hf_dir, tmp_path):
    """`--fuse_gate_up_exps` (llama.cpp): gate and up, and their biases, one tensor each, gate's
    rows first (the converter has split HF's interleaved pairs before): the same slots as the
    file with them apart, MXFP4 blocks and float32 biases alike."""
    f32 = tmp_path / "f32.gguf"
    write_gpt_oss_gguf(hf_dir, f32)
    names = [t.name for t in gguf.GGUFReader(f32).tensors if t.name.endswith("_exps.weight")]
    apart = gfx.requantize_gguf(f32, tmp_path / "q.gguf", {n: "mxfp4" for n in names})
    fused = gfx.fused_gate_up_gguf(apart, tmp_path / "fused.gguf")
    assert {"blk.0.ffn_gate_up_exps.weight", "blk.0.ffn_gate_up_exps.bias"} <= {t.name for t in gguf.GGUFReader(fused).tensors}
    r = diagnose(fused)
    assert (r["verdict"], r["problems"], r["unexpected"]) == ("PASS", [], []), r
    convert(prepare(apart), tmp_path / "a.ftw")
    convert(prepare(fused), tmp_path / "f.ftw")
    a, f = FTWModel(tmp_path / "a.ftw"), FTWModel(tmp_path / "f.ftw")
    assert a.layout == f.layout and f.layout.dtype == "mxfp4" and f.layout.biased
    want, got = a.read_banks(pin=False), f.read_banks(pin=False)
    for row in range(a.spec.num_expert_rows):
        w, g = want.parts(row), got.parts(row)
        assert w.keys() == g.keys() and all(torch.equal(w[n], g[n]) for n in w)


def test_gguf_mxfp4_experts_stay_blocks(hf_dir, tmp_path):
    """The experts as MXFP4 blocks (what the converter writes from the released checkpoints): FTW
    keeps a GGUF's blocks as stored, beside their float32 biases; diagnose passes and prices them;
    the slots hold the gguf package's dequantized values; and the CPU kernel, reading the blocks
    with the biases and the clamped SwiGLU, gives the float32 twin's logits bit for bit."""
    f32 = tmp_path / "f32.gguf"
    write_gpt_oss_gguf(hf_dir, f32)
    names = [t.name for t in gguf.GGUFReader(f32).tensors if t.name.endswith("_exps.weight")]
    quant = gfx.requantize_gguf(f32, tmp_path / "q.gguf", {n: "mxfp4" for n in names})
    plain = gfx.dequantized_gguf(quant, tmp_path / "d.gguf")
    r = diagnose(quant)
    assert (r["verdict"], r["memory"]["expert_dtype"]) == ("PASS", "mxfp4"), r
    conv = prepare(quant)
    assert conv.layout.dtype == "mxfp4" and conv.layout.biased
    convert(conv, tmp_path / "q.ftw")
    convert(prepare(plain), tmp_path / "d.ftw")  # float32 experts
    q, d = FTWModel(tmp_path / "q.ftw"), FTWModel(tmp_path / "d.ftw")
    assert d.layout.dtype == "float32" and q.layout.activation == d.layout.activation is not None
    a, b = q.read_banks(pin=False), d.read_banks(pin=False)
    for row in range(q.spec.num_expert_rows):
        lay = q.layout.for_row(row)
        for n, t in a.parts(row).items():
            p = lay.part(n)
            got = dequantize(t, p.dtype).reshape(p.shape) if p.dtype == "mxfp4" else t
            assert torch.equal(got, b.parts(row)[n]), (row, n)
    outs = []
    for path in (tmp_path / "q.ftw", tmp_path / "d.ftw"):
        rt = Runtime(path, RuntimeOptions(threads=2, strategy="cpu"))
        outs.append(greedy(rt, n=6))
        rt.close()
    assert outs[0][0] == outs[1][0]
    assert all(torch.equal(x, y) for x, y in zip(outs[0][1], outs[1][1], strict=True))


def test_a_stub_of_the_released_20b_checkpoint_passes(tmp_path):
    """gpt-oss-20b as published (config.json keys, MXFP4 experts, bf16 biases, tensor names and
    shapes), cut to 2 layers, as a header-only stub: diagnose passes with the slot and pool sizes
    of its MXFP4 experts as FTW keeps them."""
    cfg = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
           "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
           "initial_context_length": 4096, "intermediate_size": 2880, "layer_types": ["sliding_attention",
           "full_attention"], "max_position_embeddings": 131072, "num_attention_heads": 64,
           "num_experts_per_tok": 4, "num_hidden_layers": 2, "num_key_value_heads": 8, "num_local_experts": 32,
           "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                              "model.embed_tokens", "lm_head"],
                                   "quant_method": "mxfp4"},
           "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                   "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                   "truncate": False},
           "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
           "vocab_size": 201088, "eos_token_id": 200002, "pad_token_id": 199999}
    shapes: dict[str, tuple[str, list[int]]] = {"model.embed_tokens.weight": ("BF16", [201088, 2880]),
                                                "lm_head.weight": ("BF16", [201088, 2880]),
                                                "model.norm.weight": ("BF16", [2880])}
    for i in range(2):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": ("BF16", [2880]), p + "post_attention_layernorm.weight": ("BF16", [2880]),
            p + "self_attn.q_proj.weight": ("BF16", [4096, 2880]), p + "self_attn.q_proj.bias": ("BF16", [4096]),
            p + "self_attn.k_proj.weight": ("BF16", [512, 2880]), p + "self_attn.k_proj.bias": ("BF16", [512]),
            p + "self_attn.v_proj.weight": ("BF16", [512, 2880]), p + "self_attn.v_proj.bias": ("BF16", [512]),
            p + "self_attn.o_proj.weight": ("BF16", [2880, 4096]), p + "self_attn.o_proj.bias": ("BF16", [2880]),
            p + "self_attn.sinks": ("BF16", [64]),
            p + "mlp.router.weight": ("BF16", [32, 2880]), p + "mlp.router.bias": ("BF16", [32]),
            p + "mlp.experts.gate_up_proj_blocks": ("U8", [32, 5760, 90, 16]),
            p + "mlp.experts.gate_up_proj_scales": ("U8", [32, 5760, 90]),
            p + "mlp.experts.gate_up_proj_bias": ("BF16", [32, 5760]),
            p + "mlp.experts.down_proj_blocks": ("U8", [32, 2880, 90, 16]),
            p + "mlp.experts.down_proj_scales": ("U8", [32, 2880, 90]),
            p + "mlp.experts.down_proj_bias": ("BF16", [32, 2880]),
        })
    header, at = {}, 0
    for name, (dtype, shape) in shapes.items():
        n = (1 if dtype == "U8" else 2) * int(torch.tensor(shape).prod())
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}
        at += n
    stub = tmp_path / "gpt-oss-20b"
    stub.mkdir()
    (stub / "config.json").write_text(json.dumps(cfg))
    fx._write_with_header(stub / "model.safetensors", header, b"")
    r = diagnose(stub)
    assert (r["verdict"], r["problems"], r["unexpected"], r["header_only"]) == ("PASS", [], [], True), r
    m = r["memory"]
    slot = -(-(3 * 2880 * 90 * 17 + 3 * 2880 * 4) // 4096) * 4096  # 90 MXFP4 blocks of 17 bytes a row
    assert (m["expert_dtype"], m["expert_slot_bytes"], m["host_expert_pool_bytes"]) == ("mxfp4", slot, 64 * slot)
    # the full layer a row per position, the sliding one a ring of 128 + 63 rows
    assert (m["kv_bytes_per_1k_tokens"], m["kv_window_bytes"]) == (1000 * 2 * 8 * 64 * 2, 191 * 2 * 8 * 64 * 2)
    # and with no torch loaded, as every header-only check (test_diagnose.py): the MXFP4 pairing too
    code = "import sys\nfrom ftkit.tools.diagnose.report import diagnose\ndiagnose(sys.argv[1])\nprint('torch' in sys.modules)"
    fx.skip_unless_header_path_can_be_torch_free()
    done = subprocess.run([sys.executable, "-c", code, str(stub)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.stdout.strip() == "False", done.stderr
