"""A radix tree over token ids whose nodes own the K/V rows of their span, for every full-attention
layer (a sliding-window layer resumes from the window an anchor saved: cache.py). Requests copy rows out (so nothing is locked while they run) and copy rows in after their
prefill. Eviction drops leaves under a token budget, least valuable first:

    value = sqrt(depth) / (1 + age in requests)

so a short side request (a title generation) goes before a long session used a few requests ago,
while a session left alone for long enough goes before a new one (a plain depth weight would let
one huge idle session evict every newcomer)."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from ..models.kv import KVCache


@dataclass(eq=False)
class Node:
    tokens: list[int]
    depth: int  # tokens from the root to the end of this node
    parent: Node | None
    k: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [len, kv_heads, head_dim]
    v: dict[int, torch.Tensor] = field(default_factory=dict)
    children: dict[int, Node] = field(default_factory=dict)
    last_used: int = 0
    anchor: object | None = None  # the AnchorPool entry for the state at this node's end


def _common(a: list[int], b: list[int], start: int, n: int) -> int:
    """Length of the common prefix of a[:n] and b[start:start+n]."""
    if a[:n] == b[start : start + n]:
        return n
    return next(i for i in range(n) if a[i] != b[start + i])


class RadixTree:
    def __init__(self, max_tokens: int, layers: Collection[int]):
        """`layers`: those whose rows the nodes keep."""
        self.layers = tuple(layers)
        self.root = Node([], 0, None)
        self.max_tokens, self.tokens = max_tokens, 0
        self.clock = 0  # one tick per lookup: ages are counted in requests

    def match(self, tokens: list[int]) -> tuple[list[Node], int]:
        """(the nodes a prefix of `tokens` enters, the length of that prefix); the last node may
        be matched only in part. Matched nodes are touched as used."""
        self.clock += 1
        path, node, pos = [], self.root, 0
        while pos < len(tokens) and (child := node.children.get(tokens[pos])) is not None:
            n = _common(child.tokens, tokens, pos, min(len(child.tokens), len(tokens) - pos))
            child.last_used = self.clock
            path.append(child)
            pos += n
            if n < len(child.tokens):
                break
            node = child
        return path, pos

    def copy_into(self, path: list[Node], upto: int, kv: KVCache) -> None:
        """Write the rows 0..upto of `path` into an empty cache (its length is left at 0): one
        concatenation a layer, K and V, however many nodes. (A copy a node and layer cost the
        GPU machine ~0.3 ms of host time a node: an agent's session adds two nodes a turn, so
        its restore grew from 1.0 ms at turn 1 to 4.0 ms at turn 6.)"""
        pieces: list[tuple[Node, int]] = []
        for node in path:
            start = node.depth - len(node.tokens)
            if start >= upto:
                break
            pieces.append((node, min(len(node.tokens), upto - start)))
        if not pieces:
            return
        whole, (last, n) = [node for node, _ in pieces[:-1]], pieces[-1]  # only the last may be cut
        for layer in self.layers:
            torch.cat([*(node.k[layer] for node in whole), last.k[layer][:n]], out=kv.k[layer][:upto])
            torch.cat([*(node.v[layer] for node in whole), last.v[layer][:n]], out=kv.v[layer][:upto])

    def insert(self, tokens: list[int], end: int, kv: KVCache, stops: list[int]) -> dict[int, Node]:
        """Hold rows 0..end of `kv` (computed for `tokens`); every position in `stops` ends a
        node. Returns {stop: the node ending there}."""
        node, pos, out = self.root, 0, {}
        for stop in [*sorted(s for s in stops if 0 < s < end), end]:
            while pos < stop:
                child = node.children.get(tokens[pos])
                if child is None:
                    child = self._new(node, tokens[pos:stop], kv, pos)
                else:
                    n = _common(child.tokens, tokens, pos, min(len(child.tokens), stop - pos))
                    if n < len(child.tokens):
                        self._split(child, n)
                child.last_used = self.clock
                node, pos = child, child.depth
            out[stop] = node
        return out

    def evict(self, on_drop) -> None:
        """Drop leaves, least valuable first, until the budget holds; `on_drop(node)` first."""
        while self.tokens > self.max_tokens:
            leaves = [n for n in self._nodes() if not n.children]
            if not leaves:
                return
            victim = min(leaves, key=lambda n: math.sqrt(n.depth) / (1 + self.clock - n.last_used))
            on_drop(victim)
            del victim.parent.children[victim.tokens[0]]
            self.tokens -= len(victim.tokens)

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _new(self, parent: Node, tokens: list[int], kv: KVCache, start: int) -> Node:
        end = start + len(tokens)
        node = Node(list(tokens), end, parent, {i: kv.k[i][start:end].clone() for i in self.layers},
                    {i: kv.v[i][start:end].clone() for i in self.layers}, last_used=self.clock)
        parent.children[tokens[0]] = node
        self.tokens += len(tokens)
        return node

    def _split(self, node: Node, n: int) -> None:
        """Keep the first n tokens in `node`; the rest (with the children and the anchor, which
        sits at the end) moves to a new child."""
        tail = Node(node.tokens[n:], node.depth, node, {i: t[n:].clone() for i, t in node.k.items()},
                    {i: t[n:].clone() for i, t in node.v.items()}, node.children, node.last_used, node.anchor)
        for child in tail.children.values():
            child.parent = tail
        if tail.anchor is not None:
            tail.anchor.node = tail
        node.tokens, node.depth = node.tokens[:n], node.depth - len(tail.tokens)
        node.k = {i: t[:n].clone() for i, t in node.k.items()}
        node.v = {i: t[:n].clone() for i, t in node.v.items()}
        node.children, node.anchor = {tail.tokens[0]: tail}, None
