"""Prefix cache: reuse is bitwise exact (float32, CPU) for every family, after each harness's
edit style; hybrid models resume from an anchor at the edit; usage fields and client quirks
through the real server."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import httpx2 as httpx
import pytest
import torch
from test_server import KEY, MODEL, ant, oai, server  # noqa: F401  (the real server, module-scoped)

from ftkit.runtime.engine.generate import generate
from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
from ftkit.runtime.engine.sampling import SamplingParams
from ftkit.runtime.prefix_cache.anchors import TAIL
from ftkit.runtime.prefix_cache.radix import RadixTree
from ftkit.runtime.server.quirks import normalise
from ftkit.tools.bench import agent_trace as trace
from ftkit.tools.bench.agent_trace import HARNESSES, session
from ftkit.tools.convert.pipeline import convert, prepare

FAMILIES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "qwen3_next", "gpt_oss", "qwen3_5_moe")
SLACK = 4  # tokens between an anchor before a marker and the edit just after it ("<tool_response>\n")


@pytest.fixture(scope="module")
def ftw_of(hf_checkpoint, tmp_path_factory):
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            src = hf_checkpoint(family)
            out = tmp_path_factory.mktemp(f"pc-{family}") / "m.ftw"
            convert(prepare(src, dtype="float32"), out)
            for name in ("tokenizer.json", "tokenizer_config.json"):
                if not (out / name).exists():
                    shutil.copy(src / name, out / name)
            built[family] = out
        return built[family]

    return get


def run(rt: Runtime, ids: list[int], n: int = 3):
    """(generation, the logits each generated token was sampled from)."""
    seen = []
    real = rt.step.forward

    def record(x, kv, **kwargs):
        out = real(x, kv, **kwargs)
        seen.append(out[-1].clone())
        return out

    rt.step.forward = record
    try:
        gen = generate(rt, ids, SamplingParams(max_tokens=n, ignore_eos=True))
    finally:
        del rt.step.forward
    return gen, torch.stack(seen[-len(gen.token_ids):])


def common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("family", FAMILIES)
def test_reuse_is_bitwise_exact_after_every_edit_style(family, ftw_of):
    path = ftw_of(family)
    cached = Runtime(path, RuntimeOptions(strategy="fused", threads=1, prefix_cache_tokens=4096))
    plain = Runtime(path, RuntimeOptions(strategy="fused", threads=1, prefix_cache=False))
    tok = cached.tokenizer
    for seed, harness in enumerate(HARNESSES):
        prev: list[int] = []
        for turn, msgs in enumerate(session(harness, 4, seed=seed, scale=0.06)):
            ids = tok.encode(tok.chat(msgs))
            got, got_logits = run(cached, ids)
            want, want_logits = run(plain, ids)
            assert got.token_ids == want.token_ids
            assert torch.equal(got_logits, want_logits), (family, harness, turn)
            assert want.cached_tokens == 0
            if turn:  # resumed at the edit (or the end of the last prompt), up to a marker's width
                changed = len(ids) - common(prev, ids)
                assert 0 < got.cached_tokens and len(ids) - got.cached_tokens <= changed + SLACK, (harness, turn)
            prev = ids
    if family in ("qwen3_next", "qwen3_5_moe"):
        assert cached.prefix_cache.pool.live, "a hybrid model keeps recurrent-state anchors"
    cached.close()
    plain.close()


def test_no_anchors_saves_prompt_tails_only(ftw_of):
    """The A/B baseline: a hybrid model resumes only where a previous prompt ended, so an edit
    inside the history (OpenCode's placeholder) recomputes from an older tail."""
    path = ftw_of("qwen3_next")
    on = Runtime(path, RuntimeOptions(strategy="fused", threads=1))
    off = Runtime(path, RuntimeOptions(strategy="fused", threads=1, anchors=False))
    tok = on.tokenizer
    reused = {"on": 0, "off": 0}
    for msgs in session("opencode", 4, seed=1, scale=0.06):
        ids = tok.encode(tok.chat(msgs))
        a, b = generate(on, ids, SamplingParams(max_tokens=1)), generate(off, ids, SamplingParams(max_tokens=1))
        reused["on"] += a.cached_tokens
        reused["off"] += b.cached_tokens
    assert {a.kind for a in off.prefix_cache.pool.live} == {TAIL}
    assert reused["on"] > reused["off"]
    on.close()
    off.close()


def unmarked(rt: Runtime, n: int, gen: torch.Generator) -> list[int]:
    """n random token ids, none of them a marker's (so the cuts are pages and periodic ones)."""
    ids = torch.tensor([t for t in range(256) if t not in rt.tokenizer.added_ids])
    return ids[torch.randint(0, len(ids), (n,), generator=gen)].tolist()


def test_sliding_windows_resume_from_anchors(ftw_of):
    """gpt-oss's sliding layer (window 4, a ring of 8 rows) keeps no rows in the tree, only the
    full layer does; each anchor saves the sliding layer's last window - 1 = 3 rows. A prompt far
    past the ring resumes from the periodic anchor inside the first (256) or from its tail (288),
    bitwise as a cold prefill, and the resumed window is the cold prefill's."""
    path = ftw_of("gpt_oss")
    cached = Runtime(path, RuntimeOptions(strategy="fused", threads=1, prefix_cache_tokens=4096))
    plain = Runtime(path, RuntimeOptions(strategy="fused", threads=1, prefix_cache=False))
    gen = torch.Generator().manual_seed(8)
    first = unmarked(cached, 300, gen)
    assert set(cached.grid.scan(first).values()) == {"page", "periodic"}
    run(cached, first)
    pc = cached.prefix_cache
    assert pc.anchored and all(set(n.k) == set(n.v) == {1} for n in pc.tree._nodes())
    snaps = sorted((a.snap for a in pc.pool.live), key=lambda s: s.length)
    assert [s.length for s in snaps] == [256, 288]
    assert all(set(s.windows) == {0} and s.windows[0][0].shape[0] == 3 for s in snaps)
    for shared, resumed in ((270, 256), (300, 288)):
        second = first[:shared] + unmarked(cached, 9, gen)
        (got, got_logits), (want, want_logits) = run(cached, second), run(plain, second)
        assert (got.cached_tokens, want.cached_tokens) == (resumed, 0)
        assert got.token_ids == want.token_ids and torch.equal(got_logits, want_logits)
    cold = plain.new_kv(300)
    with torch.inference_mode():
        plain.step.forward(torch.tensor(first[:256]), cold, cuts=list(plain.grid.scan(first[:256])))
    assert all(torch.equal(a, b) for a, b in zip(snaps[0].windows[0], cold.windows(0, 256), strict=True))
    cached.close()
    plain.close()


def test_decoded_rows_leave_their_windows_at_a_tail_anchor(ftw_of):
    """As a GPU reply ends (Decoding.remember -> PrefixCache.remember): its rows go into the tree
    and the sliding windows at its stable end, still in the rings, into a tail anchor, where a
    next turn resumes as from a prefill's rows. Rows computed as a CPU prefill's here, so the
    resume is bitwise. Where the rings have moved past that window (the tiny ring keeps 4 rows
    beside it; gpt-oss's 63 cover a page) it declines, and the scheduler prefills instead."""
    path = ftw_of("gpt_oss")
    cached = Runtime(path, RuntimeOptions(strategy="fused", threads=1, prefix_cache_tokens=4096))
    plain = Runtime(path, RuntimeOptions(strategy="fused", threads=1, prefix_cache=False))
    pc, gen = cached.prefix_cache, torch.Generator().manual_seed(9)
    ids = unmarked(cached, 300, gen)
    for n, kept in ((300, False), (290, True)):  # the stable end 288: 12 and 2 positions back
        kv, cuts = cached.new_kv(n), cached.grid.scan(ids[:n])
        with torch.inference_mode():
            cached.step.forward(torch.tensor(ids[:n]), kv, cuts=list(cuts))
            assert pc.remember(ids[:n], cuts, kv) == kept
        assert pc.tree.tokens == (288 if kept else 0)
    (anchor,) = pc.pool.live
    assert (anchor.snap.length, anchor.kind) == (288, TAIL)
    second = ids[:290] + unmarked(cached, 9, gen)
    (got, got_logits), (want, want_logits) = run(cached, second), run(plain, second)
    assert (got.cached_tokens, want.cached_tokens) == (288, 0)
    assert got.token_ids == want.token_ids and torch.equal(got_logits, want_logits)
    cached.close()
    plain.close()


# ---- through the server ---------------------------------------------------------------------
LONG_SYSTEM = "You are a careful coding agent. " * 12


def test_openai_reports_cached_tokens(oai):  # noqa: F811
    msgs = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "List the files."}]
    first = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
    msgs += [{"role": "assistant", "content": "There are none."}, {"role": "user", "content": "Again."}]
    second = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


def test_anthropic_usage_and_billing_header_quirk(ant):  # noqa: F811
    """Claude Code's per-request `cch=` hash in the first system block is dropped, so the second
    request reuses the first one's prefix; input_tokens counts only what was computed."""

    def ask(cch: str, stream: bool = False):
        system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1; cch={cch};"},
                  {"type": "text", "text": LONG_SYSTEM}]
        kw = dict(model=MODEL, max_tokens=2, system=system, messages=[{"role": "user", "content": "Hi there."}])
        if not stream:
            return ant.messages.create(**kw)
        with ant.messages.stream(**kw) as s:
            return s.get_final_message()

    first, second = ask("a1b2c"), ask("9f8e7")
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens > 0
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == total
    streamed = ask("00000", stream=True)
    assert streamed.usage.cache_read_input_tokens == second.usage.cache_read_input_tokens


def test_normalise_keeps_everything_but_the_billing_line():
    msgs = [{"role": "system", "content": "x-anthropic-billing-header: cc_version=1; cch=abc;\nBe brief."},
            {"role": "user", "content": "x-anthropic-billing-header: stays in user text"}]
    assert normalise(msgs) == [{"role": "system", "content": "Be brief."}, msgs[1]]


def test_side_request_does_not_evict_the_session(server, oai):  # noqa: F811
    """A short unrelated request (a title generation) under a tight budget loses to the long
    session prefix it would otherwise push out."""
    cache = server.state.rt.prefix_cache
    budget = cache.tree.max_tokens
    msgs = [{"role": "system", "content": LONG_SYSTEM * 3}, {"role": "user", "content": "Refactor it."}]
    first = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0)
    try:
        cache.tree.max_tokens = cache.tree.tokens  # full: every insert from now on evicts
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Title: x"}],
                                    max_tokens=1, temperature=0)
        again = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0)
    finally:
        cache.tree.max_tokens = budget
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
    stats = httpx.get(server.url + "/v1/stats", headers={"authorization": f"Bearer {KEY}"}).json()
    assert stats["prefix_cache"]["reused_tokens"] > 0


def test_agent_trace_bench_meets_its_targets(tmp_path):
    """`ft-bench agent-trace` in small: with anchors, recomputed tokens stay within 1.2x of what
    the harness changed; without the prefix cache every turn recomputes the whole prompt."""
    rows = trace.run(trace.write_model("next", tmp_path / "next.ftw"), ("openclaw",), turns=3)
    assert trace.summary(rows)["anchors"]["recomputed_over_changed_max"] <= 1.2
    assert all(r.recomputed == r.prompt for r in rows if r.mode == "no-prefix-cache")
    assert "| openclaw | 3 |" in trace.table(rows)


def test_a_long_session_restores_every_row_from_many_nodes():
    """An agent's session is a chain of nodes (a prompt's suffix, then its reply, each turn): the
    restore concatenates them a layer at a time, up to a point inside the last node."""
    layers = (0, 2)
    tree = RadixTree(10**6, layers)
    ids = torch.randint(0, 500, (300,)).tolist()
    src = SimpleNamespace(k={i: torch.randn(300, 2, 4) for i in layers}, v={i: torch.randn(300, 2, 4) for i in layers})
    for end in range(20, 301, 20):
        tree.insert(ids[:end], end, src, [])
    path, matched = tree.match(ids)
    assert len(path) == 15 and matched == 300
    dst = SimpleNamespace(k={i: torch.zeros(300, 2, 4) for i in layers}, v={i: torch.zeros(300, 2, 4) for i in layers})
    tree.copy_into(path, 287, dst)
    for i in layers:
        assert torch.equal(dst.k[i][:287], src.k[i][:287]) and torch.equal(dst.v[i][:287], src.v[i][:287])
        assert not dst.k[i][287:].any() and not dst.v[i][287:].any()
