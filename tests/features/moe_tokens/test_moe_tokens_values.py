"""MoETokensMonitor driven directly (no Trainer): layer discovery and selection, every record of a step
on the host and device paths, the cross-rank totals, checked against numpy float64 recomputations of
counts the test itself sets."""
import logging

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn

from mindmon.config import ConfigError
from mindmon.core.engine import CrossRankPayload, CrossRankSizes
from mindmon.features.moe_tokens.config import MoEMonitorConfig
from mindmon.core.events import MicroBatchEnd, StepBegin
from mindmon.features.moe_tokens.monitor import (MoELayer, MoETokensMonitor,
                                         decoder_layer_count, find_moe_layers, select_layers)
from mindmon.core.records import Record

EXPERTS = 4


class Counter(nn.Cell):
    """A MoE layer's cumulative count, as a Parameter (MindFormers, the demo) or a plain Tensor (probes)."""

    def __init__(self, as_parameter=True):
        super().__init__()
        zeros = Tensor(np.zeros(EXPERTS, np.float32))
        self.tokens_per_expert = Parameter(zeros, name="tpe", requires_grad=False) if as_parameter else zeros


class Holder(nn.Cell):
    def __init__(self, **cells):
        super().__init__()
        for name, cell in cells.items():
            setattr(self, name, cell)


def _model(decoder_layers=("dense", "moe", "moe"), as_parameter=True):
    """decoder.layers.<i> (dense ones hold no counter) and mtp.layers.0, whose inner layer is itself
    named like a decoder layer (mtp.layers.0.decoder.layers.0.mlp)."""
    layers = [Holder() if kind == "dense" else Holder(mlp=Counter(as_parameter)) for kind in decoder_layers]
    inner = Holder(decoder=Holder(layers=nn.CellList([Holder(mlp=Counter(as_parameter))])))
    return Holder(decoder=Holder(layers=nn.CellList(layers)), mtp=Holder(layers=nn.CellList([inner])))


def _select(model, target_layers, logger=None):
    config = MoEMonitorConfig(save_tokens_per_expert_interval=1, target_layers=target_layers)
    return [layer.name for layer, _ in select_layers(model, config, logger or logging.getLogger("test"))]


def test_layers_found_in_model_order_mtp_before_decoder():
    found = find_moe_layers(_model())
    assert list(found) == ["decoder.layers.1", "decoder.layers.2", "mtp.layers.0"]
    assert found["decoder.layers.1"][0] == MoELayer("decoder.layers.1", "decoder.layers.1.mlp")
    assert found["mtp.layers.0"][0] == MoELayer("mtp.layers.0", "mtp.layers.0.decoder.layers.0.mlp")
    assert decoder_layer_count(_model()) == 3
    assert decoder_layer_count(Holder(head=Counter())) == 0


def test_first_counter_of_a_layer_wins():
    layer = Holder(mlp=Counter(), shared=Counter())
    model = Holder(decoder=Holder(layers=nn.CellList([layer])))
    (name, (moe_layer, cell)), = find_moe_layers(model).items()
    assert (name, moe_layer.module, cell is layer.mlp) == ("decoder.layers.0", "decoder.layers.0.mlp", True)


def test_counter_outside_the_layer_names_is_a_config_error():
    with pytest.raises(ConfigError) as error:
        find_moe_layers(Holder(blocks=Holder(moe=Counter())))
    assert str(error.value).startswith("monitor.moe_monitor: the MoE module 'blocks.moe' is under no layer name "
                                       "mindmon knows (")
    assert str(error.value).endswith("'mtp.layers.<i>'); allowed: monitor.moe_monitor.layer_pattern, a regular "
                                     "expression whose group is the layer id")


def test_layer_names_of_other_schemes_and_a_configured_pattern():
    from mindmon.features.moe_tokens.config import MoEMonitorConfig

    hf = Holder(model=Holder(layers=nn.CellList([Holder(mlp=Holder(gate=Counter())) for _ in range(2)])))
    assert {name: layer.module for name, (layer, _) in find_moe_layers(hf).items()} == {
        "decoder.layers.0": "model.layers.0.mlp.gate", "decoder.layers.1": "model.layers.1.mlp.gate"}
    custom = Holder(trunk=Holder(stage3=Holder(moe=Counter())))
    config = MoEMonitorConfig(1, None, r"\.stage(\d+)\.")
    assert list(find_moe_layers(custom, config)) == ["decoder.layers.3"]
    assert decoder_layer_count(custom, config) == 4


@pytest.mark.parametrize("pattern, message", [
    (r"layer(\d+", "does not compile"), (r"layer\d+", "it has 0 groups"), (5, "got 5"),
])
def test_a_bad_layer_pattern_is_one_clean_line(pattern, message):
    from mindmon.features import parse_sections

    with pytest.raises(ConfigError, match=r"monitor\.moe_monitor\.layer_pattern") as error:
        parse_sections({"monitor": {"moe_monitor": {"save_tokens_per_expert_interval": 1, "layer_pattern": pattern}}})
    assert message in str(error.value)


def test_target_layers_select_and_refuse_exactly(caplog):
    model = _model()
    assert _select(model, None) == ["decoder.layers.1", "decoder.layers.2", "mtp.layers.0"]
    assert _select(model, 3) == ["decoder.layers.1", "decoder.layers.2"]
    assert _select(model, (2,)) == ["decoder.layers.2"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="test"):
        assert _select(model, (0, 1)) == ["decoder.layers.1"]
    assert [r.getMessage() for r in caplog.records] == ["decoder.layers.0 is not a MoE layer"]
    with pytest.raises(ConfigError) as error:
        _select(model, 5)
    assert str(error.value) == ("monitor.moe_monitor.target_layers: got 5; decoder layer(s) 3..4 do not exist; "
                                "allowed: ids 0..2 (the model has 3 decoder layers)")
    with pytest.raises(ConfigError) as error:
        _select(model, tuple(range(20, 2, -1)))
    assert "decoder layer(s) [3, 4, 5, 6, 7, 8, 9, 10, 11, 12] do not exist" in str(error.value)
    with pytest.raises(ConfigError, match=r"got 4; decoder layer\(s\) 3\.\.3 do not exist"):
        _select(model, 4)                                  # one past the last layer
    with pytest.raises(ConfigError, match=r"got \(4, 1\); decoder layer\(s\) \[4\] do not exist"):
        _select(model, (4, 1))                             # the largest id is not the last one
    with pytest.raises(ConfigError) as error:
        _select(model, (1, 3))
    assert "got (1, 3); decoder layer(s) [3] do not exist" in str(error.value)
    assert _select(model, (2,)) == ["decoder.layers.2"]   # the largest existing id is allowed
    with pytest.raises(ConfigError) as error:
        _select(model, (0,))
    assert str(error.value) == (
        "monitor.moe_monitor.target_layers: got (0,), which selects no MoE layer (no module with tokens_per_expert; "
        "found: ['decoder.layers.1', 'decoder.layers.2', 'mtp.layers.0']); allowed: ids of MoE layers, "
        "or attach counters with mindmon.probes.attach_tokens_per_expert_probes")
    with pytest.raises(ConfigError, match=r"found: none\)"):
        _select(Holder(decoder=Holder(layers=nn.CellList([Holder()]))), None)


def test_selection_logs_to_the_mindmon_logger_by_default(caplog):
    with caplog.at_level(logging.WARNING, logger="mindmon"):
        MoETokensMonitor(MoEMonitorConfig(save_tokens_per_expert_interval=1, target_layers=(0, 2)), _model())
    assert [(r.name, r.getMessage()) for r in caplog.records] == [("mindmon", "decoder.layers.0 is not a MoE layer")]


def _routing(seed, micro_steps, layers):
    """Tokens each micro-step routes to each expert (some experts idle), (micro_steps, layers, experts)."""
    routed = np.random.default_rng(seed).integers(0, 9, size=(micro_steps, layers, EXPERTS)).astype(np.float64)
    routed[:, :, 0] = 0.0    # an idle expert in every layer
    return routed


def _set_counts(cells, counts):
    for cell, count in zip(cells, counts):
        value = Tensor(count.astype(np.float32))
        if isinstance(cell.tokens_per_expert, Parameter):
            cell.tokens_per_expert.set_data(value)
        else:
            cell.tokens_per_expert = value


def _run_step(monitor, step, routed, start):
    """The step's records after the counters went from `start` through `routed`'s micro-steps."""
    _set_counts(monitor.cells, start)
    monitor.on_event(StepBegin())
    cumulative = start.copy()
    for k, per_layer in enumerate(routed):
        cumulative = cumulative + per_layer
        _set_counts(monitor.cells, cumulative)
        monitor.on_event(MicroBatchEnd(k))
    return monitor.collect(step), cumulative


def _summaries(tokens):
    tokens = np.asarray(tokens, np.float64)
    values = {"moe_min_tokens": tokens.min(), "moe_max_tokens": tokens.max(), "moe_idle_experts": np.sum(tokens == 0),
              "moe_max_over_mean": tokens.max() / tokens.mean(), "moe_cv": tokens.std() / tokens.mean()}
    return {kind: float(value) for kind, value in values.items()}


@pytest.mark.parametrize("on_host", [True, False])
@pytest.mark.parametrize("as_parameter", [True, False])   # MindFormers' Parameter, or a probe's Tensor
def test_every_record_of_two_steps_against_numpy(on_host, as_parameter):
    config = MoEMonitorConfig(save_tokens_per_expert_interval=3)
    monitor = MoETokensMonitor(config, _model(as_parameter=as_parameter), rank=5, on_host=on_host)
    assert [layer.name for layer in monitor.layers] == ["decoder.layers.1", "decoder.layers.2", "mtp.layers.0"]
    names, K = [layer.name for layer in monitor.layers], 4
    counts = np.array([[100.0, 3, 0, 7], [0, 0, 0, 0], [5, 5, 5, 5]])   # not zero at step begin
    for step in (1, 2):
        routed = _routing(step, K, len(names))
        records, counts = _run_step(monitor, step, routed, counts)
        expected = [Record(step, k, 5, "tokens_per_expert", name, routed[k, i].astype(int).tolist(),
                           (step - 1) * K + k)
                    for k in range(K) if ((step - 1) * K + k) % 3 == 0 for i, name in enumerate(names)]
        for i, name in enumerate(names):
            total = routed[:, i].sum(axis=0)
            expected.append(Record(step, None, 5, "tokens_per_expert_step", name, total.astype(int).tolist()))
            expected += [Record(step, None, 5, kind, name, value) for kind, value in _summaries(total).items()]
        assert records[:len(expected)] == expected[:len(records)]
        assert len(records) == len(expected)
        for got, want in zip(records, expected):
            assert type(got.value) is type(want.value), got   # ints in lists, floats in summaries
            if isinstance(want.value, list):
                assert all(type(v) is int for v in got.value)
    assert [r.micro_step for r in records if r.kind == "tokens_per_expert"] == [2, 2, 2]   # iter 6 of step 2


def test_counts_are_rounded_not_truncated():
    monitor = MoETokensMonitor(MoEMonitorConfig(save_tokens_per_expert_interval=1, target_layers=(1,)), _model())
    cell = monitor.cells[0]
    cell.tokens_per_expert.set_data(Tensor(np.array([0.0, 0, 0, 0], np.float32)))
    monitor.on_event(StepBegin())
    cell.tokens_per_expert.set_data(Tensor(np.array([2.9999, 1.0001, 0.4, 6.6], np.float32)))
    monitor.on_event(MicroBatchEnd())
    records = monitor.collect(1)
    assert records[0].value == [3, 1, 0, 7] and records[1].value == [3, 1, 0, 7]
    assert {r.rank for r in records} == {0}   # the default rank


def test_snapshot_is_a_copy_of_a_counter_changed_in_place():
    monitor = MoETokensMonitor(MoEMonitorConfig(save_tokens_per_expert_interval=1, target_layers=(1,)), _model())
    counter = monitor.cells[0].tokens_per_expert
    monitor.on_event(StepBegin())
    ms.ops.assign_add(counter, Tensor(np.array([1.0, 2, 3, 4], np.float32)))
    monitor.on_event(MicroBatchEnd())
    assert monitor.collect(1)[0].value == [1, 2, 3, 4]


def test_no_step_begin_or_no_micro_step_writes_nothing_and_resets():
    config = MoEMonitorConfig(save_tokens_per_expert_interval=1, target_layers=(1,))
    monitor = MoETokensMonitor(config, _model(), cross_rank=True)
    monitor.on_event(MicroBatchEnd())          # before any step begin: ignored
    assert monitor._snapshots == [] and monitor.collect(1) == []
    monitor.on_event(StepBegin())
    assert monitor.cross_rank(1) is None
    assert monitor.collect(1) == [] and monitor._snapshots == []
    monitor.receive_cross_rank(CrossRankPayload(data_parallel=np.ones(EXPERTS)))
    assert monitor.collect(2) == [] and monitor._all_ranks is None
    monitor.on_event(StepBegin())
    monitor.on_event(MicroBatchEnd())          # one micro-step is a step to sum over the ranks
    assert _host(monitor.cross_rank(1).data_parallel).tolist() == [0.0] * EXPERTS


def test_idle_layer_has_no_ratio_summaries():
    monitor = MoETokensMonitor(MoEMonitorConfig(save_tokens_per_expert_interval=1, target_layers=(1,)), _model())
    records, _ = _run_step(monitor, 1, np.zeros((2, 1, EXPERTS)), np.zeros((1, EXPERTS)))
    step_level = {r.kind: r.value for r in records if r.micro_step is None}
    assert step_level == {"tokens_per_expert_step": [0, 0, 0, 0], "moe_min_tokens": 0.0, "moe_max_tokens": 0.0,
                          "moe_idle_experts": 4.0}


@pytest.mark.parametrize("on_host", [True, False])
def test_cross_rank_sums_replace_the_step_totals(on_host):
    config = MoEMonitorConfig(save_tokens_per_expert_interval=2, target_layers=(1, 2))
    monitor = MoETokensMonitor(config, _model(), on_host=on_host, cross_rank=True)
    assert monitor.cross_rank_sizes(3) == CrossRankSizes(data_parallel=2 * EXPERTS)
    assert MoETokensMonitor(config, _model()).cross_rank_sizes(3).total == 0
    routed = _routing(7, 3, 2)
    start = np.array([[4.0, 0, 1, 2], [0, 0, 9, 0]])
    _set_counts(monitor.cells, start)
    monitor.on_event(StepBegin())
    for k in range(3):
        _set_counts(monitor.cells, start + routed[:k + 1].sum(axis=0))
        monitor.on_event(MicroBatchEnd())
    sent = monitor.cross_rank(3).data_parallel
    assert sent.dtype == (np.float32 if on_host else ms.float32)
    assert np.array_equal(_host(sent), routed.sum(axis=0).reshape(-1))
    # Another rank routed `other`; the all-reduce hands back the sum (float32, possibly off by rounding).
    other = np.array([[1.0, 2, 0, 40], [3, 0, 0, 1]])
    monitor.receive_cross_rank(CrossRankPayload(data_parallel=_host(sent) + other.reshape(-1) - 0.3))
    records = monitor.collect(1)
    totals = routed.sum(axis=0) + other
    step_level = [r for r in records if r.micro_step is None]
    assert [(r.name, r.value) for r in step_level if r.kind == "tokens_per_expert_step"] == [
        ("decoder.layers.1", totals[0].astype(int).tolist()), ("decoder.layers.2", totals[1].astype(int).tolist())]
    for i, name in enumerate(("decoder.layers.1", "decoder.layers.2")):
        got = {r.kind: r.value for r in step_level if r.name == name and r.kind.startswith("moe_")}
        assert got == pytest.approx(_summaries(totals[i]), rel=1e-12)
    # The micro-step records stay this rank's own; the next step starts without the other ranks' sums.
    assert [(r.micro_step, r.value) for r in records if r.kind == "tokens_per_expert"] == [
        (k, routed[k, i].astype(int).tolist()) for k in (0, 2) for i in (0, 1)]
    assert monitor._all_ranks is None


def test_ratio_summaries_when_the_mean_is_below_one():
    monitor = MoETokensMonitor(MoEMonitorConfig(save_tokens_per_expert_interval=1, target_layers=(1,)), _model())
    records, _ = _run_step(monitor, 1, np.array([[[0.0, 0, 1, 2]]]), np.zeros((1, EXPERTS)))
    step_level = {r.kind: r.value for r in records if r.micro_step is None and r.kind.startswith("moe_")}
    assert step_level == _summaries([0, 0, 1, 2])   # mean 0.75: max/mean 8/3, cv std/mean
    assert set(step_level) == {"moe_min_tokens", "moe_max_tokens", "moe_idle_experts", "moe_max_over_mean", "moe_cv"}


def _host(values) -> np.ndarray:
    """A payload part as float64 numpy (a Tensor when it stayed on the device)."""
    return np.asarray(values.asnumpy() if hasattr(values, "asnumpy") else values, np.float64)
