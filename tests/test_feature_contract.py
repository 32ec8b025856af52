"""The contract every registered capability keeps (each feature is built from its own `example` config, so a
new registration is covered without a line here), and the registry's promise that a capability is one
folder plus one registry line: a toy feature built through the same path."""
import logging
from dataclasses import dataclass

import numpy as np
import pytest

from tests.support.demo_trainer import make_model
from mindmon.core.events import GradientsReduced, ReduceBegin
from mindmon.config import Section, setting
from mindmon.config.fields import boolean
from mindmon.core.engine import Feature, Monitor, RunInfo, Sink, SinkClosedError
from mindmon.core.factory import build, build_callbacks, group_of
from mindmon.features import FEATURES, parse_sections, section_of
from mindmon.core.records import Record

IDS = [feature.name for feature in FEATURES]


def _built(feature, tmp_path, features=FEATURES):
    from mindspore import nn

    model = make_model()
    optimizer = nn.AdamWeightDecay(model.trainable_params(), learning_rate=1e-3)
    raw = dict(feature.example)
    raw["monitor"] = dict(raw.get("monitor", {}), output_dir=str(tmp_path))
    config = parse_sections(raw, features)
    names = [p.name for p in optimizer.parameters]
    return config, build(config, model, names, rank=0, logger=logging.getLogger("mindmon"), on_host=True,
                         optimizer=optimizer, global_batch_size=8, features=features)


@pytest.mark.parametrize("feature", FEATURES, ids=IDS)
def test_every_feature_has_an_example_that_switches_it_on(feature, tmp_path):
    config, built = _built(feature, tmp_path)
    section = section_of(config, feature)
    assert section is not None and section.active
    from mindmon.callbacks import MonitorCallback

    own_outputs = 2   # log lines and JSONL (no TensorBoard in the examples)
    callbacks = [c for c in build_callbacks(group_of(built), config) if not isinstance(c, MonitorCallback)]
    parts = built.monitors + built.sinks[own_outputs:] + built.actions + callbacks
    assert parts, f"{feature.name}: its example builds nothing"


@pytest.mark.parametrize("feature", FEATURES, ids=IDS)
def test_sinks_close_twice_and_refuse_writes_after_close(feature, tmp_path):
    _, built = _built(feature, tmp_path)
    for sink in built.sinks:
        sink.open(RunInfo(rank=0))
        sink.write([Record(1, None, 0, "device_loss", "loss", 1.5)])
        sink.flush()
        sink.close()
        sink.close()
        assert sink.closed
        with pytest.raises(SinkClosedError, match=f"{type(sink).__name__}: write after close"):
            sink.write([Record(2, None, 0, "device_loss", "loss", 1.0)])


@pytest.mark.parametrize("feature", FEATURES, ids=IDS)
def test_a_failing_sink_is_dropped_once_with_one_line(feature, tmp_path, caplog):
    _, built = _built(feature, tmp_path)
    group = group_of(built)
    group.setup()
    failing = built.sinks[-1]

    def broken(records):
        raise OSError(28, "No space left on device")

    failing.write = broken
    with caplog.at_level(logging.ERROR, logger="mindmon"):
        group.write([Record(1, None, 0, "device_loss", "loss", 1.5)])
        group.write([Record(2, None, 0, "device_loss", "loss", 1.0)])
    lines = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(lines) == 1 and type(failing).__name__ in lines[0] and "No space left" in lines[0]
    assert failing not in group.sinks and len(group.sinks) == len(built.sinks) - 1
    group.close()


@pytest.mark.parametrize("feature", [f for f in FEATURES if f.build is not None], ids=lambda f: f.name)
def test_a_failing_monitor_is_dropped_and_the_others_go_on(feature, tmp_path, caplog):
    _, built = _built(feature, tmp_path)
    if not built.monitors:   # a feature of sinks (tested above) and actions only: the alerts, the Prometheus endpoint
        assert feature.name in ("alert", "trackers") and (built.actions or built.sinks)
        return
    group = group_of(built)
    group.setup()
    failing = built.monitors[0]

    def broken(step):
        raise RuntimeError("a broken monitor")

    failing.collect = broken
    with caplog.at_level(logging.ERROR, logger="mindmon"):
        group.flush(1, loss=2.0, grad_norm=1.0, learning_rate=0.1)
        group.flush(2, loss=1.0, grad_norm=1.0, learning_rate=0.1)
    lines = [r.getMessage() for r in caplog.records if "switched off" in r.getMessage()]
    assert len(lines) == 1 and type(failing).__name__ in lines[0]
    assert failing not in group.monitors
    group.close()
    group.close()


# --- a toy capability, added as docs/architecture.md shows: one folder's worth of code, one registry line ---

@dataclass(frozen=True)
class ReduceWaitConfig(Section):
    enabled: bool = setting(False, boolean())
    """Per step: how long the gradients waited in the data-parallel collective."""

    @property
    def active(self) -> bool:
        return self.enabled


class ReduceWaitMonitor(Monitor):
    EVENTS = (ReduceBegin, GradientsReduced)

    def __init__(self, rank):
        self.rank, self.began, self.seconds = rank, None, []

    def on_event(self, event):
        if isinstance(event, ReduceBegin):
            self.began = event.at
        elif self.began is not None:
            self.seconds.append(event.at - self.began)

    def collect(self, step):
        seconds, self.seconds = self.seconds, []
        return [Record(step, None, self.rank, "reduce_wait", "seconds", float(np.sum(seconds)))]


class Collected(Sink):
    def __init__(self):
        self.records = []

    def write(self, records):
        self.records += records


def _build_reduce_wait(build, section):
    if section.active:
        build.add_monitor(ReduceWaitMonitor(build.rank))
        build.sinks.append(Collected())


REDUCE_WAIT = Feature("reduce_wait", "monitor.reduce_wait", parse=ReduceWaitConfig.parse, build=_build_reduce_wait,
                      example={"monitor": {"reduce_wait": {"enabled": True}}})


def test_a_new_feature_is_one_registration(tmp_path):
    features = FEATURES + (REDUCE_WAIT,)
    config, built = _built(REDUCE_WAIT, tmp_path, features)
    assert config.monitor.reduce_wait == ReduceWaitConfig(True)
    assert "reduce_wait" in parse_sections({"monitor": {"reduce_wait": {"enabled": False}}}, features).to_dict()["monitor"]
    group = group_of(built)
    group.setup()
    events = [ReduceBegin(), GradientsReduced(), ReduceBegin(), GradientsReduced()]
    for event in events:
        group.emit(event)
    group.flush(3)
    collected = next(s for s in built.sinks if isinstance(s, Collected))
    expected = (events[1].at - events[0].at) + (events[3].at - events[2].at)
    assert [(r.step, r.kind) for r in collected.records] == [(3, "reduce_wait")]
    assert collected.records[0].value == pytest.approx(expected, rel=1e-12) and expected > 0
    with pytest.raises(Exception, match=r"monitor\.reduce_wait\.enabled: got 'yes' \(str\); allowed: True or False"):
        parse_sections({"monitor": {"reduce_wait": {"enabled": "yes"}}}, features)
    with pytest.raises(Exception, match=r"monitor\.reduce_wat: unknown key 'reduce_wat' \(did you mean 'reduce_wait'\?\)"):
        parse_sections({"monitor": {"reduce_wat": {}}}, features)
    group.close()
