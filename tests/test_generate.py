"""Generation: greedy, seeded sampling, top-k/top-p limits, stop tokens, stop strings, limits."""

from __future__ import annotations

import pytest
import torch

from ftkit.runtime.engine.generate import generate
from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
from ftkit.runtime.engine.sampling import Sampler, SamplingParams
from ftkit.runtime.random_model import demo_spec, write_random_ftw
from ftkit.runtime.synthetic import write_tokenizer

PROMPT = [10, 20, 30, 40, 50, 60]


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen") / "m.ftw"
    write_random_ftw(path, demo_spec(400), seed=5, side_files=lambda d: write_tokenizer(d, 400))
    runtime = Runtime(path, RuntimeOptions(strategy="cpu", threads=2))
    yield runtime
    runtime.close()


def test_greedy_equals_top_k_1_and_tiny_top_p(rt):
    greedy = generate(rt, PROMPT, SamplingParams(max_tokens=10, ignore_eos=True)).token_ids
    k1 = generate(rt, PROMPT, SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=1, ignore_eos=True))
    p0 = generate(rt, PROMPT, SamplingParams(max_tokens=10, temperature=1.5, top_p=1e-6, seed=2, ignore_eos=True))
    assert greedy == k1.token_ids == p0.token_ids
    assert len(greedy) == 10


def test_sampling_is_seeded_and_varies(rt):
    p = dict(max_tokens=12, temperature=1.0, ignore_eos=True)
    a = generate(rt, PROMPT, SamplingParams(seed=7, **p)).token_ids
    b = generate(rt, PROMPT, SamplingParams(seed=7, **p)).token_ids
    c = generate(rt, PROMPT, SamplingParams(seed=8, **p)).token_ids
    assert a == b and a != c


def test_top_k_and_top_p_keep_only_the_allowed_tokens():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    seen = {Sampler(SamplingParams(temperature=1.0, top_k=2, seed=s))(logits) for s in range(200)}
    assert seen == {0, 1}
    probs = torch.softmax(logits, 0)  # top-p 0.8 keeps the smallest prefix reaching 0.8: {0, 1}
    assert probs[0] < 0.8 < probs[0] + probs[1]
    seen = {Sampler(SamplingParams(temperature=1.0, top_p=0.8, seed=s))(logits) for s in range(200)}
    assert seen == {0, 1}


def test_sampling_draws_from_the_cut_distribution():
    """The exponential race draws each kept token as often as its renormalised probability;
    top-p past the CPU's first window of candidates grows the window, not the cut."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
    for params in (dict(temperature=0.8), dict(temperature=0.8, top_k=3), dict(temperature=1.0, top_p=0.9),
                   dict(temperature=1.2, top_k=4, top_p=0.8)):
        probs = torch.softmax(logits / params["temperature"], 0)
        if "top_k" in params:
            probs[params["top_k"]:] = 0
            probs /= probs.sum()
        if "top_p" in params:
            probs *= probs.cumsum(0) - probs < params["top_p"]
            probs /= probs.sum()
        sampler, n = Sampler(SamplingParams(seed=11, **params)), 20000
        freq = torch.bincount(torch.tensor([sampler(logits) for _ in range(n)]), minlength=6) / n
        assert (freq - probs).abs().max() < 0.015, (params, freq, probs)
        assert (freq[probs == 0] == 0).all()
    flat = torch.linspace(0, 0.5, 4000).flip(0)  # top-p 0.5 keeps about 2000 of them
    kept = int((torch.softmax(flat, 0).cumsum(0) - torch.softmax(flat, 0) < 0.5).sum())
    seen = {Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=s))(flat) for s in range(3000)}
    assert kept > 4 * Sampler.CPU_WINDOW and max(seen) < kept and len(seen) > Sampler.CPU_WINDOW


def test_sampler_rewinds_its_draws():
    logits = torch.randn(1000)
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.95, seed=3))
    sampler(logits)
    before = sampler.draws()
    picks = [sampler(logits) for _ in range(5)]
    sampler.rewind(before)
    assert [sampler(logits) for _ in range(5)] == picks


def test_stop_token(rt):
    greedy = generate(rt, PROMPT, SamplingParams(max_tokens=10, ignore_eos=True)).token_ids
    gen = generate(rt, PROMPT, SamplingParams(max_tokens=10, stop_token_ids=[greedy[4]], ignore_eos=True))
    assert gen.finish_reason == "stop" and gen.token_ids == greedy[: greedy.index(greedy[4]) + 1]


def test_stop_string_cuts_text_and_never_streams_it(rt):
    full = generate(rt, PROMPT, SamplingParams(max_tokens=24, ignore_eos=True))
    text = full.text
    stop = next(text[i : i + 3] for i in range(4, len(text) - 3) if text[i : i + 3].strip() and "\ufffd" not in text[i : i + 3])
    cut = text.index(stop)
    pieces: list[str] = []
    gen = generate(rt, PROMPT, SamplingParams(max_tokens=24, stop=[stop], ignore_eos=True), pieces.append)
    streamed = "".join(pieces)
    assert gen.finish_reason == "stop"
    assert gen.text == streamed == text[:cut]


def test_limits(rt):
    assert generate(rt, PROMPT, SamplingParams(max_tokens=0)).token_ids == []
    gen = generate(rt, PROMPT, SamplingParams(max_tokens=5, ignore_eos=True))
    assert gen.finish_reason == "length" and len(gen.token_ids) == 5
    with pytest.raises(ValueError, match="context"):
        generate(rt, list(range(1, 10)) * 300, SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="vocabulary"):
        generate(rt, [1, 99999], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)


def test_stream_decoder_deltas_add_up_to_the_full_decode(rt):
    from ftkit.runtime.engine.tokenizer import StreamDecoder

    tok = rt.tokenizer
    texts = ["Grüße, 世界! def f(x):\n    return x ** 2  # ok", "  spaces   and\ttabs 😀 done"]
    for text in texts:
        ids = tok.encode(text)
        dec = StreamDecoder(tok, skip_special=False)
        assert "".join(dec.push(t) for t in ids) == tok.decode(ids) == text
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, tok.vocab_size, (300,), generator=gen).tolist()
    dec = StreamDecoder(tok)
    pieces = "".join(dec.push(t) for t in ids)
    full = tok.decode(ids, skip_special=True)
    assert full.startswith(pieces) and len(full) - len(pieces) <= 4  # only a held-back partial char
