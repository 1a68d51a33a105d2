"""`benchmarks.threads.crossover`: the size from which all threads pay over one (pure logic)."""

from benchmarks.threads import PAYS, crossover


def test_the_crossover_is_where_every_larger_size_pays():
    # A lucky small size (32) that paid once does not move the crossover below a size that
    # did not (64, 128).
    ratios = {16: 1.21, 32: 0.94, 64: 1.04, 128: 1.10, 256: 0.83, 512: 0.67}
    assert crossover(ratios) == 256


def test_no_crossover_when_the_largest_size_does_not_pay():
    assert crossover({64: 0.8, 256: 0.9, 512: 1.02}) is None
    assert crossover({}) is None


def test_every_size_paying_gives_the_smallest():
    assert crossover({16: 0.9, 64: 0.7, 512: 0.5}) == 16


def test_a_ratio_at_the_bound_pays_and_just_above_it_does_not():
    assert crossover({128: PAYS, 256: 0.5}) == 128
    assert crossover({128: PAYS + 0.001, 256: 0.5}) == 256
