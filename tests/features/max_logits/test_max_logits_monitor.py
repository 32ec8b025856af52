"""MaxAttentionLogitMonitor without the Trainer: the records it builds from a model's accessors, the
interval and the reset, the -inf / NaN / +inf rules, and the max over a data-parallel group's
values. Fast; the Trainer tests check the same monitor end to end against numpy attention."""
import logging
import math

import mindspore as ms
import numpy as np
import pytest

from mindmon.features.max_logits.monitor import MaxAttentionLogitMonitor
from mindmon.core.records import Record

pytestmark = pytest.mark.ms27   # needs neither MindFormers nor MindSpore 2.9


class Tracking:
    """A model's side of the contract: a running max per layer name and the two accessors."""

    def __init__(self, values):
        self.values = {name: np.asarray(v, np.float32) for name, v in values.items()}
        self.resets = 0
        self.track_max_attention_logit = False

    def get_max_attention_logit(self):
        return {name: ms.Tensor(v) for name, v in self.values.items()}

    def reset_max_attention_logit(self):
        self.resets += 1


LAYERS = {"decoder.layers.0.max_logits_val": [1.25, -3.5], "decoder.layers.1.max_logits_val": [7.0, 2.5]}


def test_records_per_layer_then_mean_and_max_over_every_head():
    model = Tracking(LAYERS)
    monitor = MaxAttentionLogitMonitor(model, step_interval=1, rank=3)
    assert model.track_max_attention_logit is True   # the model's own switch is turned on
    records = monitor.collect(step=4)
    every_head = [1.25, -3.5, 7.0, 2.5]
    assert records == [
        Record(4, None, 3, "max_attention_logit", "decoder.layers.0.max_logits_val", [1.25, -3.5]),
        Record(4, None, 3, "max_attention_logit", "decoder.layers.1.max_logits_val", [7.0, 2.5]),
        Record(4, None, 3, "max_attention_logit_mean", "all", math.fsum(every_head) / 4),
        Record(4, None, 3, "max_attention_logit_max", "all", 7.0)]
    assert model.resets == 1


def test_interval_collects_every_third_step_and_resets_at_every_step():
    model = Tracking(LAYERS)
    monitor = MaxAttentionLogitMonitor(model, step_interval=3)
    collected = [step for step in range(1, 8) if monitor.collect(step)]
    assert collected == [3, 6]
    assert model.resets == 7
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="step_interval"):
            MaxAttentionLogitMonitor(Tracking(LAYERS), step_interval=bad)


def test_a_layer_that_ran_no_attention_is_left_out_and_non_finite_values_are_kept():
    model = Tracking({"a": [-np.inf, -np.inf], "b": [np.nan, 2.0], "c": [np.inf, -np.inf]})
    records = MaxAttentionLogitMonitor(model).collect(step=1)
    by_kind = {(r.kind, r.name): r.value for r in records}
    assert [r.name for r in records[:2]] == ["b", "c"] and {r.rank for r in records} == {0}   # default rank 0
    assert math.isnan(by_kind[("max_attention_logit", "b")][0]) and by_kind[("max_attention_logit", "b")][1] == 2.0
    assert by_kind[("max_attention_logit", "c")] == [math.inf, -math.inf]
    assert math.isnan(by_kind[("max_attention_logit_mean", "all")])
    assert math.isnan(by_kind[("max_attention_logit_max", "all")])   # numpy's max propagates NaN
    assert MaxAttentionLogitMonitor(Tracking({"a": [-np.inf, -np.inf]})).collect(step=1) == []
    assert MaxAttentionLogitMonitor(Tracking({})).collect(step=1) == []


def test_the_mean_is_taken_in_float64():
    heads = np.array([16777216.0, 1.0, 1.0, 1.0], np.float32)   # 2**24: float32 sums would drop the ones
    records = MaxAttentionLogitMonitor(Tracking({"a": heads})).collect(step=1)
    assert records[1].value == (16777216.0 + 3.0) / 4


def test_a_model_without_accessors_is_warned_about_once_and_collects_nothing(caplog):
    class Plain:
        pass

    with caplog.at_level(logging.WARNING, logger="mindmon"):
        monitor = MaxAttentionLogitMonitor(Plain())
    assert [(r.name, r.getMessage()) for r in caplog.records] == [("mindmon",
        "mindmon: MaxLogitsMonitor: Plain has no get_max_attention_logit()/reset_max_attention_logit(); "
        "nothing will be logged (see mindmon.probes)")]
    assert monitor.collect(step=1) == [] and monitor.collect(step=2) == []


class TwoRanks:
    """A data-parallel group of two as `DataParallel` presents it; max() combines this rank's array
    with the other rank's known values (the all-gather itself is covered by the msrun tests)."""

    active, size = True, 2

    def __init__(self, other_rank):
        self.other_rank, self.received = np.asarray(other_rank, np.float32), []

    def max(self, values):
        self.received.append(np.array(values))
        return np.maximum(values, self.other_rank)


def test_values_are_maxed_over_the_group_layer_by_layer():
    model = Tracking({"a": [1.0, 5.0], "b": [2.0, -1.0, 0.5], "c": [-4.0]})
    group = TwoRanks([3.0, 4.0, 1.0, 0.0, 9.0, -6.0])
    records = MaxAttentionLogitMonitor(model, data_parallel=group).collect(step=1)
    np.testing.assert_array_equal(group.received[0], [1.0, 5.0, 2.0, -1.0, 0.5, -4.0])   # one collective for all
    assert [(r.name, r.value) for r in records[:3]] == [("a", [3.0, 5.0]), ("b", [2.0, 0.0, 9.0]), ("c", [-4.0])]
    assert records[4].value == 9.0
    inactive = TwoRanks([9.0] * 5)
    inactive.active = False
    assert MaxAttentionLogitMonitor(Tracking({"a": [1.0, 5.0]}), data_parallel=inactive).collect(1)[0].value == [1.0, 5.0]
    assert inactive.received == []
    nothing = TwoRanks([])
    assert MaxAttentionLogitMonitor(Tracking({}), data_parallel=nothing).collect(step=1) == []
    assert nothing.received == []   # no collective for a model with no attention layer
