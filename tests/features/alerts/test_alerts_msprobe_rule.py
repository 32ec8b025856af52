"""msprobe's AnomalyTurbulence (exponential average, upward) through the msprobe and kj600 front doors,
mindmon's (plain mean) by option; the dump's steps 0-based there. Each definition is written out again
here and compared with what the rules and the dump say."""
import glob
import json

import numpy as np
import pytest

from tests.support.msprobe_reference import NAMES, STEPS, msprobe_loop, reference_run, statistic
from mindmon.features.alerts import AlertConfig
from mindmon.config import ConfigError
from mindmon.msprobe import TrainerMon, parse_tensor_stats

pytestmark = pytest.mark.ms27

SERIES = ("grad_reduced", "fc1.weight/norm", "norm")


def ema_rule_fires(values, threshold):
    """msprobe 26.2: avg starts at the first |x|; x fires when |x| > (1 + threshold) avg, avg taken
    before it is updated to 0.99 avg + 0.01 |x|."""
    fired, avg = [], None
    for x in values:
        a = abs(x)
        if not np.isfinite(a):
            fired.append(False)
            continue
        avg = a if avg is None else avg
        fired.append(a > (1 + threshold) * avg)
        avg = 0.99 * avg + 0.01 * a
    return fired


def mean_rule_fires(values, threshold, up=False):
    """mindmon's: the mean of the earlier finite |x|; |(|x| - mean)| > threshold mean (or upward only)."""
    fired, earlier = [], []
    for x in values:
        a = abs(x)
        if not np.isfinite(a):
            fired.append(False)
            continue
        avg = np.mean(earlier) if earlier else None
        fired.append(avg is not None and (a > (1 + threshold) * avg if up else abs(a - avg) > threshold * avg))
        earlier.append(a)
    return fired


def rule(dialect, **args):
    config = AlertConfig.parse("alert", {"rules": [{"rule_name": "AnomalyTurbulence",
                                                    "args": {"threshold": 0.5, **args}}]}, dialect)
    return config.build_rules()[0]


def judged(rule_object, values):
    return [rule_object.judge(SERIES, x) is not None for x in values]


# A norm that jumps, falls and comes back, a NaN in the middle, then a slow drift upwards.
VALUES = [2.0, 4.0, 3.0, 10.0, 1.0, 4.5, float("nan"), -3.3, 3.2] + list(np.linspace(2.0, 6.0, 40)) + [0.1, 9.0]


def test_same_series_through_both_definitions():
    ema, mean = ema_rule_fires(VALUES, 0.5), mean_rule_fires(VALUES, 0.5)
    assert judged(rule("msprobe"), VALUES) == ema
    assert judged(rule("mindmon"), VALUES) == mean
    assert judged(rule("msprobe", average="mean"), VALUES) == mean   # mindmon's rule by option
    assert judged(rule("mindmon", average="ema"), VALUES) == ema
    assert judged(rule("msprobe", average="mean", direction="up"), VALUES) == mean_rule_fires(VALUES, 0.5, up=True)
    # They are different rules on this series: the falls fire only for the mean rule, and the drift
    # (an average that lags behind) fires more often for the exponential one.
    assert ema != mean
    assert ema[:6] == [False, True, False, True, False, True]
    assert mean[:6] == [False, True, False, True, True, False]


def test_ema_is_msprobes_arithmetic():
    """The average after three values, to the last bit, as msprobe's writer keeps it."""
    r = rule("msprobe")
    for x in (2.0, 4.0, -3.0):
        r.judge(SERIES, x)
    avg = 2.0
    for x in (2.0, 4.0, 3.0):
        avg = 0.99 * avg + (1 - 0.99) * x
    assert r.averages[SERIES] == avg


def test_options_and_their_errors():
    assert rule("msprobe").direction == "up" and rule("mindmon").direction == "both"
    with pytest.raises(ConfigError, match=r"^alert\.rules\[0\]\.args\.window: got 5 \(int\); allowed: no window"):
        rule("msprobe", window=5)
    with pytest.raises(ConfigError, match=r"^alert\.rules\[0\]\.args\.average: got 'median' \(str\); allowed: one of"):
        rule("mindmon", average="median")
    config = parse_tensor_stats({"wg_distribution": True, "alert": {
        "rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": True}})
    assert config.alert.dialect == "msprobe" and config.alert.first_step == 0
    assert config.alert.to_dict()["rules"][0]["args"] == {"threshold": 0.5, "average": "ema"}


def run_with_alerts(tmp_path, monkeypatch, args):
    root = tmp_path / "out"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(root))
    config = {"targets": {}, "wg_distribution": True, "mv_distribution": True, "ops": ["min", "max", "mean", "norm"],
              "ndigits": 16, "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": args}], "dump": True}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    msprobe_loop(TrainerMon, str(path)).close()
    (dump,) = glob.glob(str(root / "anomaly_detected" / "rank0" / "anomaly.json"))
    with open(dump) as handle:
        return {(e["kind"], e["name"], e["statistic"], e["step"]) for e in json.load(handle).values()}


def expected_anomalies(fires, threshold):
    """(kind, name, statistic, 0-based step) where the rule fires on numpy's values of the run."""
    reference = reference_run()
    found = set()
    for kind in ("grad_unreduced", "grad_reduced", "exp_avg", "exp_avg_sq"):
        for name in NAMES:
            for op in ("norm", "mean"):
                values = [statistic(reference[(kind, step, None, name)], op) for step in range(STEPS)]
                assert_clear_of_the_bound(values, threshold)
                found.update((kind, f"{name}/{op}", op, step) for step, hit in enumerate(fires(values, threshold)) if hit)
    return found


def assert_clear_of_the_bound(values, threshold):
    """float32 training against float64 numpy moves values by ~1e-6: none may sit that close to a bound."""
    for n in range(1, len(values)):
        a = abs(values[n])
        avg = abs(values[0])
        for earlier in values[1:n]:
            avg = 0.99 * avg + 0.01 * abs(earlier)
        mean = np.mean(np.abs(values[:n]))
        for bound in ((1 + threshold) * avg, (1 + threshold) * mean, (1 - threshold) * mean):
            assert abs(a - bound) > 1e-4 * max(a, bound) or a == bound == 0, (values, n)


def test_trainer_mon_dumps_msprobes_rule_with_0_based_steps(tmp_path, monkeypatch):
    """A 2-layer MLP, gradient and Adam-state statistics, threshold 0.5, 3 steps: the dump holds exactly
    the (tensor, statistic, step) where msprobe's rule fires on numpy's values, steps numbered as the CSV."""
    expected = expected_anomalies(ema_rule_fires, 0.5)
    assert len(expected) > 10
    assert run_with_alerts(tmp_path, monkeypatch, {"threshold": 0.5}) == expected


def test_trainer_mon_mindmons_rule_by_option(tmp_path, monkeypatch):
    expected = expected_anomalies(mean_rule_fires, 0.5)
    assert expected != expected_anomalies(ema_rule_fires, 0.5)
    assert run_with_alerts(tmp_path, monkeypatch, {"threshold": 0.5, "average": "mean"}) == expected
