"""MaxLogitsMonitor standing alone, as MindFormers' own trainer callback is used (no mindmon run behind it):
`on_step_end(args, state, model=m)` on the demo model after real forward passes, values against numpy from
forward hooks on the same passes. Its use inside MindFormers 2.0.0's stock Trainer is in test_mindformers2.py."""
import logging
import re
from types import SimpleNamespace

import numpy as np
import pytest
from mindspore import Tensor

from tests.support.demo_trainer import make_model
from mindmon.config import ConfigError
from mindmon.features.max_logits.callback import MaxLogitsMonitor, MaxLogitsReset
from mindmon.features.max_logits.config import MaxLogitsSection
from tests.features.max_logits.test_max_logits import _capture_reference

pytestmark = pytest.mark.ms27


class Counted:
    """The demo model with its two max-logit calls counted."""

    def __init__(self, model):
        self.model, self.gets, self.resets = model, 0, 0

    def get_max_attention_logit(self):
        self.gets += 1
        return self.model.get_max_attention_logit()

    def reset_max_attention_logit(self):
        self.resets += 1
        self.model.reset_max_attention_logit()


def _forward(model, step_counter, step, seed=0):
    step_counter.step = step
    ids = np.random.default_rng(seed).integers(0, 32, (2, 8)).astype(np.int32)
    model(Tensor(ids), Tensor(np.roll(ids, -1, axis=1)))


@pytest.fixture
def tracked():
    model = make_model()
    model.track_max_attention_logit = True
    counter = SimpleNamespace(step=0)
    return model, counter, _capture_reference(model, counter)


def _lines(caplog):
    return [r.getMessage() for r in caplog.records]


def test_reads_once_logs_numpy_values_and_resets_once(tracked, caplog):
    model, counter, reference = tracked
    _forward(model, counter, 1)
    counted = Counted(model)
    logger = logging.getLogger("test_max_logits_callback")
    with caplog.at_level(logging.INFO, logger=logger.name):
        MaxLogitsMonitor(logger=logger).on_step_end(None, SimpleNamespace(global_step=1, max_steps=10), model=counted)
    assert (counted.gets, counted.resets) == (1, 1)
    lines = _lines(caplog)
    names = sorted(name for (_, name) in reference)
    every_head = np.concatenate([reference[(1, name)] for name in names])
    expected = [f"step:[    1/   10] max_attention_logit/{name}: [{', '.join(f'{v:.4g}' for v in reference[(1, name)])}]"
                for name in names]
    assert sorted(lines[:len(names)]) == expected
    assert lines[len(names):] == [f"step:[    1/   10] max_attention_logit/mean: {every_head.mean():.4g}",
                                  f"step:[    1/   10] max_attention_logit/max: {every_head.max():.4g}"]
    assert all(np.all(np.isneginf(v.asnumpy())) for v in model.get_max_attention_logit().values())


def test_off_interval_steps_reset_without_reading(tracked, caplog):
    model, counter, _ = tracked
    callback, counted = MaxLogitsMonitor(step_interval=2, logger=logging.getLogger("t")), Counted(model)
    with caplog.at_level(logging.INFO, logger="t"):
        for step in (1, 2, 3):
            _forward(model, counter, step, seed=step)
            callback.on_step_end(None, SimpleNamespace(global_step=step, max_steps=3), model=[counted])
    assert (counted.gets, counted.resets) == (1, 3)
    assert {re.match(r"step:\[\s*(\d+)/", line).group(1) for line in _lines(caplog)} == {"2"}


@pytest.mark.parametrize("callback", [MaxLogitsMonitor(enable_logging=False), MaxLogitsReset()])
def test_without_logging_it_only_resets(tracked, caplog, callback):
    model, counter, _ = tracked
    _forward(model, counter, 1)
    counted = Counted(model)
    with caplog.at_level(logging.INFO):
        callback.on_step_end(None, SimpleNamespace(global_step=1, max_steps=1), model=counted)
    assert (counted.gets, counted.resets) == (0, 1)
    assert not [line for line in _lines(caplog) if "max_attention_logit" in line]


def test_qk_clip_heads_counted_where_the_model_has_a_threshold(tracked, caplog):
    model, counter, reference = tracked
    every_head = []
    callback = MaxLogitsMonitor(logger=logging.getLogger("t"))
    with caplog.at_level(logging.INFO, logger="t"):
        for step in (1, 2):
            _forward(model, counter, step, seed=step)
            heads = np.concatenate([v for (s, _), v in sorted(reference.items()) if s == step])
            model.qk_clip_threshold = float(np.median(heads))   # some heads above it, some not
            every_head.append(int(np.sum(heads > model.qk_clip_threshold)))
            callback.on_step_end(None, SimpleNamespace(global_step=step, max_steps=2), model=model)
    counts = [int(line.split(": ")[1]) for line in _lines(caplog) if "qk_clip_heads" in line]
    assert counts == every_head and 0 < counts[0] < 6
    assert callback.qk_clip_events == sum(every_head)


def test_switches_a_passed_in_models_tracking_on_at_train_begin():
    model = make_model()
    assert not model.track_max_attention_logit
    MaxLogitsMonitor().on_train_begin(None, SimpleNamespace(global_step=0), model=[model])
    assert model.track_max_attention_logit


@pytest.mark.parametrize("entry, message", [
    ({"type": "MaxLogitsMonitor", "enable_logging": "no"}, r"callbacks\[0\].enable_logging: got 'no'"),
    ({"type": "MaxLogitsReset", "step_interval": 2}, r"callbacks\[0\].step_interval: unknown key 'step_interval'; allowed keys: \['type'\]"),
])
def test_bad_entries_name_the_key(entry, message):
    with pytest.raises(ConfigError, match=message):
        MaxLogitsSection.parse("callbacks", [entry])


def test_sections():
    assert MaxLogitsSection.parse("callbacks", [{"type": "MaxLogitsReset"}]) == MaxLogitsSection(1, False)
    assert MaxLogitsSection.parse("callbacks", [{"type": "MaxLogitsMonitor", "step_interval": 3,
                                                 "enable_logging": False}]) == MaxLogitsSection(3, False)
    with pytest.raises(ValueError, match="enable_logging"):
        MaxLogitsMonitor(enable_logging=1)
