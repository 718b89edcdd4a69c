"""`ft-bench agent-trace`: replay scripted multi-turn agent sessions against the engine and report,
per turn, how much of the prompt the prefix cache reused and what the first token cost.

Three harness styles edit their context the way real ones do:
  openclaw   drops the thinking block of every assistant turn but the latest one;
  opencode   replaces tool outputs older than the last two with a placeholder;
  sweagent   keeps only the last 3 observations in full (older ones collapse to one line).
Sessions are deterministic text (a seeded generator), rendered with the model's chat template.
Each is run with anchors on, anchors off (only prompt tails saved) and no prefix cache; every
turn generates one token, so TTFT is the prefill. `changed` is what the harness changed or
added since the previous turn's prompt (its length minus the common prefix); `ideal` is the
time to prefill just that suffix from a saved state at the common prefix.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ftkit.runtime.engine.generate import generate
from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
from ftkit.runtime.engine.sampling import SamplingParams
from ftkit.runtime.models import FAMILIES
from ftkit.runtime.prefix_cache.prefill import prefill
from ftkit.runtime.random_model import demo_spec, write_random_ftw
from ftkit.runtime.spec import ModelSpec
from ftkit.runtime.synthetic import SPECIAL_TOKENS, write_tokenizer

HARNESSES = ("openclaw", "opencode", "sweagent")
MODES = {"anchors": {}, "no-anchors": {"anchors": False}, "no-prefix-cache": {"prefix_cache": False}}
WORDS = ("the file", "def run", "return x", "import os", "error", "test passed", "line 42", "value",
         "config", "patch", "self.cache", "TODO", "assert", "main()", "print(x)", "class Node")


def tiny_next_spec(vocab_size: int = 512) -> ModelSpec:
    """A small Qwen3-Next (linear, linear, linear, full) for the hybrid-attention path."""
    return FAMILIES["qwen3_next"].spec_from_config({
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "vocab_size": vocab_size,
        "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8,
        "num_experts_per_tok": 2, "shared_expert_intermediate_size": 48, "norm_topk_prob": True,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "rope_theta": 1_000_000.0, "eos_token_id": SPECIAL_TOKENS["<|im_end|>"],
    })


def write_model(model: str, path: Path) -> Path:
    """`demo` (the built-in Qwen3-MoE) or `next` (tiny Qwen3-Next), random weights, float32."""
    spec = demo_spec(512) if model == "demo" else tiny_next_spec(512)
    if not (path / "manifest.json").exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_random_ftw(path, spec, side_files=lambda d: write_tokenizer(d, 512))
    return path


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def session(harness: str, turns: int, seed: int = 0, scale: float = 1.0) -> list[list[dict]]:
    """The message list each turn sends: the full history, edited the harness's way; `scale`
    multiplies every text's length (tests use short sessions)."""
    rng = random.Random(seed)

    def text(words: int) -> str:
        return _text(rng, max(1, round(words * scale)))

    history: list[dict] = [{"role": "system", "content": "You are a coding agent. " + text(60)},
                           {"role": "user", "content": "Fix the failing test. " + text(30)}]
    out = []
    for turn in range(turns):
        out.append(_edited(harness, history))
        call = {"name": "bash", "arguments": {"cmd": text(6)}}
        history.append({"role": "assistant", "content": text(12), "reasoning_content": text(40),
                        "tool_calls": [{"function": call}]})
        history.append({"role": "tool", "content": f"[output {turn}] " + text(80)})
    return out


def _edited(harness: str, history: list[dict]) -> list[dict]:
    msgs = [dict(m) for m in history]
    assistants = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    tools = [i for i, m in enumerate(msgs) if m["role"] == "tool"]
    if harness == "openclaw":
        for i in assistants[:-1]:
            msgs[i].pop("reasoning_content")
    elif harness == "opencode":
        for i in tools[:-2]:
            msgs[i]["content"] = "[Old tool result content cleared]"
    elif harness == "sweagent":
        for i in tools[:-3]:
            msgs[i]["content"] = "Old environment output: (80 lines omitted)"
    else:
        raise ValueError(f"unknown harness {harness!r} ({', '.join(HARNESSES)})")
    return msgs


@dataclass
class Turn:
    harness: str
    mode: str
    turn: int
    prompt: int
    changed: int
    reused: int
    recomputed: int
    ttft_ms: float
    ideal_ms: float


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _ideal_seconds(rt: Runtime, ids: list[int], start: int) -> float:
    """Prefill of ids[start:] from a state saved at `start` (on the same segment grid)."""
    cuts = rt.grid.scan(ids)
    kv = rt.new_kv(len(ids))
    with torch.inference_mode():
        if start:
            prefill(rt.step, ids[:start], kv, [p for p in cuts if p < start])
        t0 = time.perf_counter()
        prefill(rt.step, ids, kv, cuts)
        return time.perf_counter() - t0


def run(model: Path, harnesses: tuple[str, ...] = HARNESSES, turns: int = 8,
        modes: tuple[str, ...] = tuple(MODES), progress: Callable[[str], None] = lambda line: None) -> list[Turn]:
    """Every harness's session in turn on one runtime per mode (sessions share its caches);
    `progress` hears of each turn as it is timed."""
    rows = []
    for mode in modes:
        rt = Runtime(model, RuntimeOptions(strategy="fused", threads=1, **MODES[mode]))
        for harness in harnesses:
            prev: list[int] = []
            for i, msgs in enumerate(session(harness, turns, seed=HARNESSES.index(harness))):
                ids = rt.tokenizer.encode(rt.tokenizer.chat(msgs))
                gen = generate(rt, ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
                common = _common(prev, ids)
                ideal = _ideal_seconds(rt, ids, min(common, len(ids) - 1)) if mode == "anchors" else 0.0
                rows.append(Turn(harness, mode, i + 1, len(ids), len(ids) - common, gen.cached_tokens,
                                 len(ids) - gen.cached_tokens, round(gen.prefill_seconds * 1e3, 1),
                                 round(ideal * 1e3, 1)))
                progress(f"{mode}: {harness} turn {i + 1}/{turns}, {len(ids)} prompt tokens, "
                         f"{gen.cached_tokens} reused")
                prev = ids
        rt.close()
    return rows


def table(rows: list[Turn]) -> str:
    """Markdown: one row per harness and turn, the three modes side by side."""
    by = {(r.harness, r.turn, r.mode): r for r in rows}
    modes = [m for m in MODES if any(r.mode == m for r in rows)]
    head = "| harness | turn | prompt | changed | " + " | ".join(
        f"{m} reused | {m} recomputed | {m} TTFT ms" for m in modes) + " | ideal ms |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (h, t) in dict.fromkeys((r.harness, r.turn) for r in rows):
        first = by[(h, t, modes[0])]
        cells = [f"{by[(h, t, m)].reused} | {by[(h, t, m)].recomputed} | {by[(h, t, m)].ttft_ms}" for m in modes]
        ideal = by[(h, t, "anchors")].ideal_ms if (h, t, "anchors") in by else ""
        lines.append(f"| {h} | {t} | {first.prompt} | {first.changed} | " + " | ".join(cells) + f" | {ideal} |")
    return "\n".join(lines)


def summary(rows: list[Turn]) -> dict:
    """Per mode, over the turns after the first: recomputed / changed and TTFT / ideal, the worst
    turn and the whole run."""
    out = {}
    for mode in dict.fromkeys(r.mode for r in rows):
        later = [r for r in rows if r.mode == mode and r.turn > 1]
        out[mode] = {
            "recomputed_over_changed_max": round(max(r.recomputed / max(r.changed, 1) for r in later), 3),
            "recomputed_over_changed_total": round(sum(r.recomputed for r in later) / sum(r.changed for r in later), 3),
        }
        ideal = [r for r in later if r.ideal_ms]
        if ideal:
            out[mode]["ttft_over_ideal_max"] = round(max(r.ttft_ms / r.ideal_ms for r in ideal), 3)
            out[mode]["ttft_over_ideal_total"] = round(sum(r.ttft_ms for r in ideal) / sum(r.ideal_ms for r in ideal), 3)
    return out


def as_dicts(rows: list[Turn]) -> list[dict]:
    return [asdict(r) for r in rows]
