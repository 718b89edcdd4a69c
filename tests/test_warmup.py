"""The warm-up's plan (its forwards run only on a GPU, at ft-run serve's start-up), and its
requests, which leave nothing behind."""

from ftkit.runtime.engine.generate import generate
from ftkit.runtime.engine.loader import Runtime, RuntimeOptions
from ftkit.runtime.engine.sampling import SamplingParams
from ftkit.runtime.engine.warmup import CLASSES, EXTEND, LONG_EXTEND, extend_lengths, request_path
from ftkit.runtime.prefix_cache.cache import PrefixCache
from ftkit.runtime.random_model import demo_spec, write_random_ftw


def _classes(n: int) -> tuple[bool, ...]:
    """What Triton specializes an integer on, for the token count times 1, 2, 4 and 8."""
    return tuple(v == 1 or v % 16 == 0 for m in (1, 2, 4, 8) for v in [n * m])


def test_extends_cover_every_class_triton_compiles_apart():
    lengths = extend_lengths(10_000)
    assert lengths == [n + c for n in (EXTEND, LONG_EXTEND) for c in CLASSES]
    assert len({_classes(n) for n in lengths[: len(CLASSES)]}) == len(CLASSES)  # each short one a class of its own
    assert {_classes(n) for n in lengths[: len(CLASSES)]} == {_classes(n) for n in range(2, 65)}  # ... and all of them


def test_extends_fit_the_room_the_longest_left_out_first():
    assert sum(extend_lengths(300)) <= 300 and extend_lengths(300)[: len(CLASSES)] == [EXTEND + c for c in CLASSES]
    assert extend_lengths(EXTEND - 1) == [] and extend_lengths(0) == []


def test_the_warm_up_requests_hit_the_prefix_cache_then_leave_it_empty(tmp_path, monkeypatch):
    path = tmp_path / "m.ftw"
    write_random_ftw(path, demo_spec(300), seed=5)
    prompt, more = list(range(10, 60)), list(range(60, 80))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    fresh = Runtime(path, RuntimeOptions(strategy="cpu", threads=1))
    want = generate(fresh, prompt + more, params)
    fresh.close()

    rt = Runtime(path, RuntimeOptions(strategy="cpu", threads=1))
    seen = []
    clear = PrefixCache.clear
    monkeypatch.setattr(PrefixCache, "clear", lambda self: (seen.append(self.info()), clear(self)))
    request_path(rt, prompt, more)
    assert len(seen) == 1 and seen[0]["requests"] == 2 and seen[0]["reused_tokens"] > 0 and seen[0]["tokens"] > 0
    got = generate(rt, prompt + more, params)
    assert got.cached_tokens == 0 and got.token_ids == want.token_ids  # nothing left behind
    assert rt.prefix_cache.info()["requests"] == 1
    rt.close()
