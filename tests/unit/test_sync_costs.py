"""The weight-sync cost model (``sessions.sync.costs.Costs``): a delta only where its CPU
costs less than the bytes it saves on the link at hand."""

from __future__ import annotations

from reshard_svc.sessions.sync.costs import Costs


def test_calibration_measures_this_machine() -> None:
    costs = Costs.calibrate(1 << 18)
    assert costs.fixed >= 0 and costs.per_change >= 0 and costs.fixed + costs.per_change > 0
    assert costs.link is None


def test_a_slow_link_takes_deltas_a_fast_one_raw_and_unknown_tries_deltas() -> None:
    costs = Costs(fixed=1e-9, per_change=10e-9)
    assert costs.delta_pays(1 << 26, 2, 0.5)  # nothing measured yet: try
    costs.link = 1 / 50e6  # 50 MB/s: bytes are dear, deltas pay even when half changed
    assert all(costs.delta_pays(1 << 26, 2, d) for d in (0.0, 0.01, 0.1, 0.5))
    assert not costs.delta_pays(1 << 26, 2, 1.0)  # nothing to save
    costs.link = 1 / 20e9  # a link faster than the compare: raw even for 0.1 %
    assert not any(costs.delta_pays(1 << 26, 2, d) for d in (0.001, 0.01, 0.5))
    assert costs.delta_pays(1 << 26, 2, None)  # a small piece: no sample, try


def test_the_link_is_measured_only_from_pushes_that_went_raw() -> None:
    costs = Costs(fixed=1e-9, per_change=1e-8)
    costs.measured(sent=1 << 30, raw=1 << 20, seconds=9.0)  # mostly deltas: CPU, not link
    assert costs.link is None
    costs.measured(sent=1000, raw=1000, seconds=1.0)  # too small to say
    assert costs.link is None
    costs.measured(sent=1 << 30, raw=1 << 30, seconds=2.0)
    assert costs.link == 2.0 / (1 << 30)


def test_a_push_agrees_on_the_median_cpu_and_the_cheapest_link() -> None:
    agreed = Costs.agreed([[1e-9, 2e-9, None], [30e-9, 1e-9, 4e-9], [2e-9, 5e-9, 2e-9]])
    assert agreed is not None  # one rank's outlier calibration does not price the push
    assert (agreed.fixed, agreed.per_change, agreed.link) == (2e-9, 2e-9, 2e-9)
    assert Costs.agreed([]) is None


def test_a_push_by_deltas_tunes_the_compare_to_what_it_took() -> None:
    costs = Costs(fixed=1e-9, per_change=1e-8, link=1e-9)
    # 2**30 bytes compared, changes priced at 0.1 s, 2**20 sent: the compare took the rest
    costs.measured(
        sent=1 << 20, raw=0, seconds=3.1 + (1 << 20) * 1e-9, compared=1 << 30, changes=0.1
    )
    assert costs.tuned and abs(costs.fixed - 3.0 / (1 << 30)) < 1e-12
    assert costs.per_change == 1e-8  # as calibrated
    agreed = Costs.agreed([costs.figures(), [9e-9, 9e-8, None, False]])  # an untuned receiver
    assert agreed is not None and agreed.fixed == costs.fixed


def test_a_dense_push_by_deltas_tunes_what_a_change_costs() -> None:
    costs = Costs(fixed=1e-9, per_change=1e-8, link=1e-9)
    # the changes were priced at 1 s of a 2.07 s price; the push took 4 s more than that
    costs.measured(
        sent=1 << 20, raw=0, seconds=5.07 + (1 << 20) * 1e-9, compared=1 << 30, changes=1.0
    )
    assert abs(costs.per_change - 4e-8) < 1e-10 and costs.fixed == 1e-9
