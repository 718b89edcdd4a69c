"""The warm-up's plan (its forwards run only on a GPU, at ft-run serve's start-up)."""

from ftkit.runtime.engine.warmup import CLASSES, EXTEND, LONG_EXTEND, extend_lengths


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
