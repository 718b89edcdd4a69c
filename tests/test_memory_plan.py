"""The memory plan sizes the expert cache under --gpu-budget, for the CLI and the server alike."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
from ftkit.runtime.engine.memory import MemoryPlan, prefill_workspace_bytes
from ftkit.runtime.engine.resolve import Machine, resolve
from ftkit.runtime.ftw.reader import FTWModel
from ftkit.runtime.random_model import demo_spec, write_random_ftw
from ftkit.runtime.server.launch import resolve_serve


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("memory") / "m.ftw"
    write_random_ftw(path, demo_spec(300))
    return path


def plan_memory(model, opts: RuntimeOptions, kv_tokens: int) -> MemoryPlan:
    """The plan of `opts` at `kv_tokens`, on their device with its memory unknown (unchecked)."""
    machine = Machine(torch.device(opts.device))
    return resolve(FTWModel(model), dataclasses.replace(opts, kv_tokens=kv_tokens), machine).memory


def device_bytes(rt: Runtime) -> tuple[int, int]:
    """What the runtime really allocated: dense weights, expert cache slots."""
    dense = sum(t.nbytes for t in rt.decoder.w.values())
    return dense, sum(t.nbytes for t in rt.store.cache.slots)


@pytest.mark.parametrize("kv_tokens", [512, 4096])
def test_gpu_budget_gives_the_experts_what_the_rest_leaves(model, kv_tokens):
    budget = 12 << 20
    opts = RuntimeOptions(strategy="offload", gpu_budget=budget, kv_tokens=kv_tokens)
    plan = plan_memory(model, opts, kv_tokens)
    assert plan.total_bytes <= budget < plan.total_bytes + plan.slot_bytes
    assert plan.prefix_bytes > 0  # the prefix cache's K/V rows are on the device too
    rt = Runtime(model, opts)
    try:
        assert device_bytes(rt) == (plan.dense_bytes, plan.expert_bytes)
    finally:
        rt.close()


def test_the_server_allocates_its_plan(model):
    """A server's KV budget (here 2 x context) is not opts.kv_tokens: the runtime it starts
    holds the plan's slots, not those the options alone would give."""
    opts = RuntimeOptions(strategy="offload", gpu_budget=12 << 20)
    resolved = resolve_serve(FTWModel(model), opts, max_running=2, kv_tokens=None, device_memory=None)
    plan = resolved.memory
    alone = plan_memory(model, opts, opts.kv_tokens)
    assert plan.kv_tokens != opts.kv_tokens and plan.expert_slots != alone.expert_slots
    assert (plan.sequences, alone.sequences) == (2, 1)  # each running request its own sliding rings
    rt = Runtime(model, resolved)
    try:
        assert device_bytes(rt) == (plan.dense_bytes, plan.expert_bytes)
    finally:
        rt.close()


def test_a_budget_too_small_names_what_took_it(model):
    opts = RuntimeOptions(strategy="offload", gpu_budget=11 << 20, kv_tokens=8192)
    with pytest.raises(ValueError) as err:
        Runtime(model, opts)
    msg = str(err.value)
    assert "--gpu-budget" in msg and "KV 8192 tokens" in msg and "prefix cache" in msg and "--kv-tokens" in msg
    # the cpu strategy keeps no expert on the device: no minimum to refuse
    assert plan_memory(model, dataclasses.replace(opts, strategy="cpu"), 8192).expert_slots == 0


def test_prefill_workspace_grows_with_chunk_and_context():
    spec = demo_spec(300)
    short = prefill_workspace_bytes(spec, 1024, torch.bfloat16)
    assert prefill_workspace_bytes(spec, 1024, torch.float32) > short
    assert prefill_workspace_bytes(spec, 16384, torch.bfloat16) > prefill_workspace_bytes(spec, 8192, torch.bfloat16) > short
    # the chunk never exceeds the context it ends at
    assert prefill_workspace_bytes(spec, 100, torch.bfloat16, chunk=8192) == prefill_workspace_bytes(spec, 100, torch.bfloat16, chunk=100)


def test_prefill_chunk_sizes_the_workspace_and_the_runtime(model):
    """--prefill-chunk: the plan reserves that chunk's activations (so a larger chunk leaves
    the experts fewer slots under one budget) and the GPU runtime prefills in pieces of it."""
    opts = RuntimeOptions(device="cuda", strategy="offload", prefill_chunk=2048)
    unbounded = plan_memory(model, opts, 2048)
    opts.gpu_budget = unbounded.total_bytes - unbounded.expert_bytes + 10 * unbounded.slot_bytes
    large = plan_memory(model, opts, 2048)
    small = plan_memory(model, dataclasses.replace(opts, prefill_chunk=256), 2048)
    assert small.workspace_bytes < large.workspace_bytes and small.expert_slots > large.expert_slots == 10
    for bad in (0, -8):
        with pytest.raises(ValueError, match="--prefill-chunk must be at least 1 token"):
            Runtime(model, RuntimeOptions(prefill_chunk=bad))


def test_graph_kv_holds_the_longest_request_the_budget_admits(model):
    """On CUDA the server's graph K/V covers a whole request of its KV budget (the context at
    most), not the 8192 tokens of opts.kv_tokens: agents' requests (prompt + max_tokens) are
    longer, and would decode without graphs."""
    opts = RuntimeOptions(device="cuda", strategy="offload", cache_experts=8)
    context = 2048  # demo_spec's
    assert plan_memory(model, opts, 1024).graph_tokens == 1024
    assert plan_memory(model, opts, 3 * context).graph_tokens == context
    assert plan_memory(model, dataclasses.replace(opts, graphs=False), 1024).graph_tokens == 0
    resolved = resolve_serve(FTWModel(model), dataclasses.replace(opts, device="cpu"), max_running=2,
                             kv_tokens=None, device_memory=None)
    rt = Runtime(model, resolved)
    try:
        assert rt.opts.kv_tokens == resolved.kv_tokens == 2 * context
    finally:
        rt.close()


def test_graph_decode_reserves_the_recurrent_states(hf_checkpoint, tmp_path):
    """A hybrid-attention model's graph decode keeps its recurrent states in static buffers and a
    saved copy (engine/graphs.py): the plan reserves both, beside the graph K/V."""
    from ftkit.runtime.models import qwen3_next
    from ftkit.tools.convert.pipeline import convert, prepare

    path = tmp_path / "m.ftw"
    convert(prepare(hf_checkpoint("qwen3_next"), dtype="bfloat16"), path)
    opts = RuntimeOptions(device="cuda", strategy="offload", cache_experts=8)
    plan = plan_memory(path, opts, 256)
    states = qwen3_next.FAMILY.recurrent_state_bytes(FTWModel(path).spec, torch.bfloat16)
    assert states and plan.graph_state_bytes == 2 * states
    assert plan.graph_bytes == 256 * plan.kv.full + 2 * states
    assert "graph K/V 256 tokens and states" in plan.describe()
    assert plan_memory(path, dataclasses.replace(opts, graphs=False), 256).graph_state_bytes == 0
    assert plan_memory(path, dataclasses.replace(opts, device="cpu"), 256).graph_bytes == 0


def test_sliding_layers_are_priced_at_their_rings():
    """A sliding-window layer keeps a ring of window + headroom rows per sequence, whatever the
    context; the plan prices the full layers by the token and the rings by the sequence, and its
    advice inverts that."""
    from ftkit.runtime.models.kv_size import KVSize, kv_size, ring_extend

    spec = dataclasses.replace(demo_spec(300), sliding_window=128,
                               layer_kinds=("sliding_attention", "full_attention") * (demo_spec(300).num_layers // 2))
    row = 2 * spec.num_kv_heads * spec.head_dim * 2  # one layer's K and V of a position, bf16
    half = spec.num_layers // 2
    kv = kv_size(spec, torch.bfloat16)
    assert kv == KVSize(full=half * row, sliding=half * row, ring=128 + 63, saved=127)
    assert ring_extend(spec) == 64
    assert kv.bytes(100) == 100 * 2 * half * row  # a short sequence: both alike
    assert kv.bytes(131072) == (131072 + 191) * half * row  # the sliding half of it: 191 rows
    assert kv.bytes(131072, sequences=4) == (131072 + 4 * 191) * half * row
    for tokens, sequences in ((100, 1), (191, 1), (5000, 1), (5000, 4), (500, 4)):
        fits = kv.tokens_within(kv.bytes(tokens, sequences), sequences)
        assert fits == tokens and kv.bytes(fits + 1, sequences) > kv.bytes(tokens, sequences)
    small = dataclasses.replace(spec, sliding_window=4)
    assert kv_size(small, torch.bfloat16).ring == 8 and ring_extend(small) == 5  # headroom: at most the window
    everything = dataclasses.replace(spec, layer_kinds=("sliding_attention",) * spec.num_layers)
    assert kv_size(everything, torch.bfloat16).tokens_within(10**9) == 10**9  # past the rings nothing grows
