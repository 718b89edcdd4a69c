"""The canonical cut grid (markers as token sequences, pages, the periodic fallback), the radix
tree's splits and eviction, and the anchor pool's eviction rule."""

from __future__ import annotations

import pytest
import torch

from ftkit.runtime.engine.tokenizer import Tokenizer
from ftkit.runtime.models.kv import CacheSnapshot, KVCache
from ftkit.runtime.models.kv_size import attention_layers
from ftkit.runtime.prefix_cache.anchors import TAIL, AnchorPool
from ftkit.runtime.prefix_cache.boundaries import IN_THINK, PERIODIC, Boundaries, Marker
from ftkit.runtime.prefix_cache.radix import RadixTree
from ftkit.runtime.random_model import demo_spec
from ftkit.runtime.synthetic import SPECIAL_TOKENS as S
from ftkit.runtime.synthetic import write_tokenizer

IM, THINK, END_THINK = S["<|im_start|>"], S["<think>"], S["</think>"]
CALL, RESULT = S["<tool_call>"], S["<tool_response>"]


def grid(page: int = 16, period: int = 64) -> Boundaries:
    return Boundaries([Marker((IM,), "turn", False), Marker((IM, 100, 101), "turn", True),
                       Marker((THINK,), "think", False), Marker((END_THINK,), "think", True),
                       Marker((CALL,), "tool_call", False), Marker((RESULT,), "tool_result", False)], page, period)


def test_markers_pages_and_thinking():
    toks = [IM, 50, 51, IM, 100, 101, THINK, 60, 61, 62, END_THINK, 70, CALL, 71, *[80] * 10]
    cuts = grid().scan(toks)
    assert cuts[3] == "turn"  # before the second turn header
    assert cuts[6] == "turn"  # after the multi-token "header + assistant\n" marker
    assert cuts[11] == "think"  # after </think>
    assert cuts[12] == "tool_call"
    assert cuts[16] == "page"
    assert 0 not in cuts and all(0 < p <= len(toks) for p in cuts)
    # "<think>" at 6 shares the cut with the header's end; the turn kind ranks higher
    inner = grid().scan([IM, 100, 101, 25, THINK, 60, CALL, 61, END_THINK])
    assert inner[4] == "think" and inner[6] == IN_THINK  # a tool-call tag inside thinking


def test_multi_token_marker_needs_the_whole_sequence():
    assert 3 not in grid().scan([25, IM, 100, 27, 28])  # header then not "assistant\n"
    assert grid().scan([25, IM, 100, 101, 28])[4] == "turn"


def test_periodic_fallback_in_a_long_span():
    cuts = grid(page=16, period=64).scan([27] * 200)
    assert [p for p, k in cuts.items() if k == PERIODIC] == [64, 128, 192]
    cuts = grid(page=16, period=64).scan([27] * 40 + [IM] + [27] * 100)
    assert [p for p, k in cuts.items() if k == PERIODIC] == [112]  # counted from the marker at 40


def test_cuts_depend_only_on_the_prefix():
    g = grid()
    long = [IM, 25, 26, 27] * 30 + [THINK, 28, 29, END_THINK] * 5
    full = g.scan(long)
    for n in (17, 50, 97, len(long)):
        part = g.scan(long[:n])
        end = g.stable_end(part, n)
        assert {p: k for p, k in full.items() if p <= end} == {p: k for p, k in part.items() if p <= end}


def test_tokenizer_markers(tmp_path):
    write_tokenizer(tmp_path, 400)
    tok = Tokenizer(tmp_path)
    g = Boundaries.for_tokenizer(tok)
    assert {m.kind for m in g.markers} == {"turn", "think", "tool_call", "tool_result"}
    text = tok.chat([{"role": "user", "content": "hi"}])
    ids = tok.encode(text)
    assert g.scan(ids)[len(ids)] == "turn"  # the generation prompt's end is a cut


class TagEncoder:
    """A tokenizer whose added tokens are `tags` (ids from 1000): other text is a token a
    character, so a tag spelled inside plain text is no added token."""

    def __init__(self, tags: list[str]):
        self.tags = {t: 1000 + i for i, t in enumerate(tags)}
        self.added_ids = frozenset(self.tags.values())

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            tag = next((t for t in sorted(self.tags, key=len, reverse=True) if text.startswith(t, i)), None)
            ids.append(self.tags[tag] if tag else ord(text[i]))
            i += len(tag) if tag else 1
        return ids


@pytest.mark.parametrize(("tags", "history", "prompt"), [
    (["<|start|>", "<|end|>", "<|message|>", "<|channel|>"],  # gpt-oss's harmony
     "<|start|>system<|message|>Reasoning: low<|end|><|start|>user<|message|>hi<|end|>",
     "<|start|>assistant"),
    (["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"],  # GLM-4.5
     "[gMASK]<sop><|system|>\nbe brief<|user|>\nhi", "<|assistant|>"),
    (["<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>"],  # DeepSeek-V3
     "<\uff5cbegin\u2581of\u2581sentence\uff5c>be brief<\uff5cUser\uff5c>hi", "<\uff5cAssistant\uff5c>"),
    (["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"],  # Kimi-K2
     "<|im_system|>system<|im_middle|>be brief<|im_end|><|im_user|>user<|im_middle|>hi<|im_end|>",
     "<|im_assistant|>assistant<|im_middle|>"),
], ids=["harmony", "glm", "deepseek", "kimi"])
def test_each_familys_turns_are_cuts(tags, history, prompt):
    """Each template's turn headers cut before them and its generation prompt's end is a turn
    cut (where the next turn resumes); its tags spelled in plain text are no markers."""
    tok = TagEncoder(tags)
    g = Boundaries.for_tokenizer(tok)
    head, ids = tok.encode(history), tok.encode(history + prompt)
    cuts = g.scan(ids)
    assert cuts[len(ids)] == "turn" and cuts[len(ids) - len(tok.encode(prompt))] == "turn"
    assert sum(k == "turn" for k in cuts.values()) >= 3
    plain = [ord(c) for c in history + prompt]  # the same text without added tokens
    assert "turn" not in g.scan(plain).values() and len(head) < len(ids)


LAYERS = attention_layers(demo_spec(400))  # the rows a tree of demo_spec's keeps


def kv_with(rows: int) -> KVCache:
    kv = KVCache(demo_spec(400), rows)
    for i in kv.k:
        kv.k[i][:rows] = torch.arange(rows, dtype=torch.float32)[:, None, None]
        kv.v[i][:rows] = -torch.arange(rows, dtype=torch.float32)[:, None, None]
    kv.advance(rows)
    return kv


def test_radix_split_match_copy():
    tree = RadixTree(1000, LAYERS)
    a = list(range(40))
    tree.insert(a, 40, kv_with(40), [16])
    b = a[:30] + [99] * 10
    tree.match(b)
    nodes = tree.insert(b, 40, kv_with(40), [])
    assert tree.tokens == 50  # 30 shared + 10 + 10
    path, matched = tree.match(a[:35] + [77])
    assert matched == 35 and [n.depth for n in path] == [16, 30, 40]
    out = KVCache(demo_spec(400), 40)
    tree.copy_into(path, 35, out)
    assert torch.equal(out.k[0][:35, 0, 0], torch.arange(35, dtype=torch.float32))
    assert nodes[40].depth == 40


def test_side_request_loses_to_the_session():
    tree = RadixTree(300, LAYERS)
    session = list(range(1000, 1250))
    tree.match(session)
    tree.insert(session, 250, kv_with(250), [])
    title = [1, 2, 3] * 20
    tree.match(title)
    tree.insert(title, 60, kv_with(60), [])
    tree.evict(lambda n: None)
    assert tree.match(session)[1] == 250 and tree.match(title)[1] == 0


def test_anchor_eviction_keeps_turns_and_recent_over_old_thinking():
    tree, pool = RadixTree(10_000, LAYERS), AnchorPool(slots=3)
    toks = list(range(500))
    nodes = tree.insert(toks, 500, kv_with(500), [100, 200, 300, 400])
    snap = {p: CacheSnapshot(p) for p in (100, 200, 300, 400, 500)}
    pool.add(nodes[100], snap[100], "turn", 1)
    pool.add(nodes[200], snap[200], IN_THINK, 1)  # inside an old turn's thinking: goes first
    pool.add(nodes[300], snap[300], "tool_result", 1)
    pool.add(nodes[500], snap[500], TAIL, 1)
    pool.evict(1)
    assert sorted(a.snap.length for a in pool.live) == [100, 300, 500]
    pool.add(nodes[400], snap[400], "turn", 5)  # recent beats old
    pool.evict(5)
    assert sorted(a.snap.length for a in pool.live) == [300, 400, 500]
    tree.max_tokens = 350  # the tree drops leaves and the anchors on them
    tree.evict(pool.drop)
    assert sorted(a.snap.length for a in pool.live) == [300]
