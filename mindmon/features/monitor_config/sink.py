"""Where monitor_config's `*_format` keys send each metric: MindFormers' TrainingStateMonitor log lines
(mindmon.formats.training_state_log) and/or TensorBoard scalars with MindFormers' tags.

`TrainingStateLogSink` stands in for the LogSink when monitor_config is on: a record of a metric that
monitor_config switched on is logged in MindFormers' line if that metric's format has `log` (and not
at all otherwise); every other record keeps mindmon's own line. `tensorboard_tags(section)` is the
tag function the TensorBoard sink is given: monitor_config metrics get MindFormers' tag when their
format has `tensorboard`, nothing otherwise; other records keep mindmon's tags.
"""
import logging
from typing import Callable, FrozenSet, List, Optional, Tuple

from mindmon.sinks.log import LogSink
from mindmon.formats import training_state_log
from mindmon.formats.log_lines import format_lines
from mindmon.core.records import (DEVICE_LOSS, GRAD_NORM, LOCAL_LOSS, LOCAL_NORM, MAX_ATTENTION_LOGIT, MAX_ATTENTION_LOGIT_MAX,
                       MAX_ATTENTION_LOGIT_MEAN, Record)

# The monitor_config metric (its `<metric>_format` key) each record kind belongs to.
METRIC_OF_KIND = {LOCAL_NORM: "local_norm", LOCAL_LOSS: "local_loss", DEVICE_LOSS: "device_local_loss",
                  GRAD_NORM: "device_local_norm", MAX_ATTENTION_LOGIT: "max_attention_logit",
                  MAX_ATTENTION_LOGIT_MEAN: "max_attention_logit", MAX_ATTENTION_LOGIT_MAX: "max_attention_logit",
                  "adam_m_norm": "optimizer_state", "adam_v_norm": "optimizer_state", "weight_norm": "weight_state",
                  "weight_stable_rank": "stable_rank", "weight_eigenvalue": "stable_rank",
                  "throughput_linearity": "throughput", "global_norm_spike_count": "spike_check"}
BOTH = frozenset({"log", "tensorboard"})


def formats_of(section, kind: str) -> Optional[FrozenSet[str]]:
    """Where monitor_config sends a record kind; None when monitor_config does not own the kind."""
    metric = METRIC_OF_KIND.get(kind)
    if metric is None:
        return None
    if metric == "stable_rank":
        return section.stable_rank.formats if section.monitor_on else None
    if metric == "throughput":     # MindFormers writes it to both, always
        return BOTH
    if metric == "spike_check":    # the check logs its own messages
        return frozenset({"tensorboard"})
    return section.format(metric) or None


class TrainingStateLogSink(LogSink):
    """Example:
        sink = TrainingStateLogSink(logger, config.monitor.monitor_config)
        sink.write([Record(2, None, 0, "weight_norm", "global", 12.5)])
        # Epoch:[  1/  1], step:[    2/    ?] weight_norm: 12.5
    """

    def __init__(self, logger: Optional[logging.Logger], section):
        super().__init__(logger)
        self.section = section

    def lines(self, records: List[Record]) -> List[str]:
        own, others = [], []
        for record in records:
            formats = formats_of(self.section, record.kind)
            (others if formats is None else own).append((record, formats))
        lines = format_lines([r for r, _ in others], self.max_steps)
        ordered = sorted((r for r, formats in own if "log" in formats),
                         key=lambda r: (r.micro_step is None, r.micro_step or 0))
        for record in ordered:
            record_tag = training_state_log.tag(record)
            if record_tag is not None:
                lines.append(training_state_log.line(record.step, self.max_steps, record_tag, record.value))
        return lines


def tensorboard_tags(section, default: Callable[[Record], List[Tuple[str, float]]]):
    """The TensorBoard sink's tag function under monitor_config."""

    def tags(record: Record) -> List[Tuple[str, float]]:
        formats = formats_of(section, record.kind)
        if record.kind == GRAD_NORM:   # the trainer's curve stays; device_local_norm is added when asked
            extra = [("device_local_norm", record.value)] if formats and "tensorboard" in formats else []
            return default(record) + extra
        if formats is None:
            return default(record)
        if "tensorboard" not in formats:
            return []
        if record.kind == MAX_ATTENTION_LOGIT:   # per head, as mindmon's tags do
            return default(record)
        record_tag = training_state_log.tag(record, training_state_log.TENSORBOARD_KIND_TAGS)
        return [(record_tag or f"{record.kind}/{record.name}", record.value)]

    return tags
