"""The scheduler's choice between batched steps and bursts in turn follows measured rates."""

from ftkit.runtime.engine.decode_mode import BATCH, PROBE, SLICE, TURNS, DecodeMode


def test_without_graphs_only_a_batch_steps_several_requests():
    mode = DecodeMode()
    assert {mode.pick(pipelined=False) for _ in range(3 * PROBE)} == {BATCH}


def test_each_mode_is_measured_then_the_faster_kept_and_the_other_probed():
    mode = DecodeMode()
    first = mode.pick(True)
    mode.observe(first, 4, 0.030)  # a 4-token batched step in 30 ms: 133 tok/s
    second = mode.pick(True)
    assert {first, second} == {BATCH, TURNS}
    mode.observe(second, 128, 0.62)  # four turns of 32 tokens: 206 tok/s
    picks = [mode.pick(True) for _ in range(2 * PROBE)]
    assert picks.count(TURNS) == 2 * PROBE - 2 and picks.count(BATCH) == 2  # re-measured every PROBE passes


def test_a_slower_turn_moves_the_choice_back_to_batching():
    mode = DecodeMode()
    mode.observe(BATCH, 4, 0.02)  # 200 tok/s
    mode.observe(TURNS, 128, 0.8)  # 160 tok/s
    assert mode.pick(True) == BATCH
    for _ in range(10):
        mode.observe(BATCH, 4, 0.08)  # the load changed: 50 tok/s
    assert mode.pick(True) == TURNS


def test_a_lone_requests_burst_is_the_rate_of_turns_so_none_is_run_to_measure_it():
    mode = DecodeMode()
    mode.observe_alone(SLICE - 1, 0.05)  # cut short by an arrival: says little, not kept
    assert mode.rate[TURNS] is None
    mode.observe_alone(255, 0.67)  # a lone reply of 256 tokens: 380 tok/s
    assert mode.pick(True) == BATCH  # the one mode not yet measured
    mode.observe(BATCH, 128, 0.226)  # four streams' batched steps: 566 tok/s
    picks = [mode.pick(True) for _ in range(PROBE - 2)]
    assert picks == [BATCH] * (PROBE - 2)  # no pass in turns until the periodic probe
    assert mode.pick(True) == TURNS
