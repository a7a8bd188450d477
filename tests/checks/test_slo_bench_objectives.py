"""bench-slo's calibrated objectives keep at least their margin over the p90 measured below capacity."""

from bench.slo_bench import objective_ms


def test_objectives_round_up_to_whole_10_ms_and_keep_the_margin():
    assert objective_ms(1.25, 0.036, 20) == 50  # 45 ms: to the nearest (half to even) it was 40, a 1.1x margin
    assert objective_ms(1.25, 0.040, 20) == 50  # exactly 50: not pushed to 60 by float error
    assert objective_ms(2.0, 0.342, 100) == 690
    assert objective_ms(1.25, 0.010, 20) == 20  # the floor
    for p90_s in (0.031, 0.034, 0.035, 0.037, 0.05):
        assert objective_ms(1.25, p90_s, 20) >= 1.25 * p90_s * 1e3
