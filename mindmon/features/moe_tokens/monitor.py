"""`monitor.moe_monitor`: tokens per expert, per micro-step and MoE layer (docs/semantics.md).

The model keeps a cumulative `tokens_per_expert` count in each MoE layer (MindFormers' MoE layer and
the demo's do; `mindmon.probes` adds one to a router that lacks it). The monitor snapshots every
selected layer's count at step begin and after each micro-step; the difference of two snapshots is
what one micro-batch routed. A micro-step is written when its global micro-step `iter`
(mindmon.formats.run_folder) is a multiple of `save_tokens_per_expert_interval`.
"""
import logging
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

from mindmon.compat import named_cells
from mindmon.config import ConfigError, short_repr
from mindmon.features.moe_tokens.config import MoEMonitorConfig
from mindmon.core.engine import NO_CROSS_RANK, CrossRankPayload, CrossRankSizes, Monitor
from mindmon.core.events import MicroBatchEnd, StepBegin
from mindmon.formats.run_folder import global_micro_step
from mindmon.core.records import (MOE_CV, MOE_DROPPED_TOKENS, MOE_IDLE_EXPERTS, MOE_MAX_OVER_MEAN, MOE_MAX_TOKENS,
                       MOE_MIN_TOKENS, TOKENS_PER_EXPERT, TOKENS_PER_EXPERT_STEP, Record)


_MTP_LAYER = re.compile(r"(?:^|\.)mtp\.layers\.(\d+)(?:\.|$)")
# Decoder layers of the other common schemes: HuggingFace (`model.layers.<L>.mlp.gate`), GPT-2 style
# (`transformer.h.<L>`), plain `layers.<L>` / `blocks.<L>`. Each names the layer `decoder.layers.<L>`.
BUILT_IN_LAYER_PATTERNS = (r"(?:^|\.)decoder\.layers\.(\d+)(?:\.|$)", r"(?:^|\.)model\.layers\.(\d+)(?:\.|$)",
                           r"(?:^|\.)h\.(\d+)(?:\.|$)", r"(?:^|\.)(?:layers|blocks)\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class MoELayer:
    """One counter: `name` is how records call the layer (`decoder.layers.1`, `mtp.layers.0`),
    `module` is the cell that holds `tokens_per_expert`."""

    name: str
    module: str


def layer_patterns(config: MoEMonitorConfig) -> List["re.Pattern"]:
    """`layer_pattern` (its one group: the layer id) first, then the built-in schemes."""
    patterns = ((config.layer_pattern,) if config.layer_pattern else ()) + BUILT_IN_LAYER_PATTERNS
    return [re.compile(p) for p in patterns]


def _layer_id(module: str, patterns) -> Optional[int]:
    for pattern in patterns:
        match = pattern.search(module)
        if match:
            return int(match.group(1))
    return None


def find_moe_layers(model, config: MoEMonitorConfig = MoEMonitorConfig()) -> Dict[str, tuple]:
    """{record name: (MoELayer, cell)} for every cell (or mindnlp module) with a `tokens_per_expert`
    tensor, in model order: `mtp.layers.<i>` for MTP layers (matched first, since their inner transformer
    layer may itself be named like a decoder layer), `decoder.layers.<L>` for a decoder layer of any
    scheme (`layer_patterns`)."""
    found, patterns = {}, layer_patterns(config)
    for module, cell in named_cells(model):
        if getattr(cell, "tokens_per_expert", None) is None:
            continue
        mtp, decoder = _MTP_LAYER.search(module), _layer_id(module, patterns)
        if mtp:
            layer = MoELayer(f"mtp.layers.{mtp.group(1)}", module)
        elif decoder is not None:
            layer = MoELayer(f"decoder.layers.{decoder}", module)
        else:
            raise ConfigError(f"monitor.moe_monitor: the MoE module {module!r} is under no layer name mindmon "
                              f"knows ({', '.join(BUILT_IN_LAYER_PATTERNS)}, 'mtp.layers.<i>'); allowed: "
                              f"monitor.moe_monitor.layer_pattern, a regular expression whose group is the layer id")
        found.setdefault(layer.name, (layer, cell))
    return found


def decoder_layer_count(model, config: MoEMonitorConfig = MoEMonitorConfig()) -> int:
    patterns = layer_patterns(config)
    ids = {i for name, _ in named_cells(model) if not _MTP_LAYER.search(name)
           for i in [_layer_id(name, patterns)] if i is not None}
    return max(ids) + 1 if ids else 0


def select_layers(model, config: MoEMonitorConfig, logger: logging.Logger) -> List[tuple]:
    """The (MoELayer, cell) pairs `target_layers` asks for; a target that is no MoE layer is
    logged and skipped, one that does not exist is an error."""
    found = find_moe_layers(model, config)
    key = "monitor.moe_monitor.target_layers"
    if config.target_layers is None:
        selected = list(found.values())
    else:
        targets = range(config.target_layers) if isinstance(config.target_layers, int) else config.target_layers
        count = decoder_layer_count(model, config)
        if (targets[-1] if isinstance(targets, range) else max(targets)) >= count:
            # Name the missing ids compactly: target_layers may be 1000000 (a range, never listed out).
            missing = (f"{count}..{config.target_layers - 1}" if isinstance(config.target_layers, int)
                       else str(sorted(t for t in targets if t >= count)[:10]))
            raise ConfigError(f"{key}: got {short_repr(config.target_layers)}; decoder layer(s) {missing} do not exist; "
                              f"allowed: ids 0..{count - 1} (the model has {count} decoder layers)")
        selected = []
        for target in targets:
            name = f"decoder.layers.{target}"
            if name in found:
                selected.append(found[name])
            else:
                logger.warning(f"{name} is not a MoE layer")
    if not selected:
        raise ConfigError(f"{key}: got {short_repr(config.target_layers)}, which selects no MoE layer (no module with "
                          f"tokens_per_expert; found: {sorted(found) or 'none'}); allowed: ids of MoE layers, "
                          f"or attach counters with mindmon.probes.attach_tokens_per_expert_probes")
    return selected


class MoETokensMonitor(Monitor):
    """Records `tokens_per_expert` per selected micro-step and layer, and per-step load summaries.

    Example:
        monitor = MoETokensMonitor(MoEMonitorConfig(save_tokens_per_expert_interval=1), model, rank=0)
        monitor.on_event(StepBegin())
        for k, batch in enumerate(micro_batches):
            train_micro_step(batch)
            monitor.on_event(MicroBatchEnd(k))
        records = monitor.collect(step=1)   # tokens_per_expert, moe_cv, moe_idle_experts, ...
    """

    EVENTS = (StepBegin, MicroBatchEnd)

    def __init__(self, config: MoEMonitorConfig, model, rank: int = 0, on_host: bool = True,
                 logger: Optional[logging.Logger] = None, cross_rank: bool = False, layout=None):
        self.config = config
        self.rank = rank
        self.on_host = on_host
        # Experts placed over expert-parallel ranks: each rank counts the tokens its own experts received
        # (from every rank of the group); the layer's vector is every rank's experts in rank order, and the
        # step totals are those vectors' sums (a data-parallel sum would add other ranks' experts).
        expert_parallel = layout.groups.get("ep") if layout is not None else None
        self.expert_parallel = expert_parallel if expert_parallel is not None and expert_parallel.active else None
        self.summed_over_ranks = cross_rank and self.expert_parallel is None  # step totals summed over data parallel
        selected = select_layers(model, config, logger or logging.getLogger("mindmon"))
        self.layers = [layer for layer, _ in selected]
        self.cells = [cell for _, cell in selected]
        self._has_drops = any(getattr(cell, "tokens_dropped", None) is not None for cell in self.cells)
        self.reset()

    def reset(self) -> None:
        self._snapshots: List = []
        self._all_ranks: Optional[List[np.ndarray]] = None
        self._dropped_at_begin: Optional[List[float]] = None
        self._dropped_all_ranks: Optional[np.ndarray] = None

    def _dropped(self) -> List[float]:
        """The cumulative `tokens_dropped` of the layers whose router has a capacity limit (a probe's
        `selection="mask"`); NaN for the others."""
        counts = [getattr(cell, "tokens_dropped", None) for cell in self.cells]
        return [np.nan if c is None else float(c.asnumpy()) for c in counts]

    def cross_rank_sizes(self, num_micro_steps: int) -> CrossRankSizes:
        """Each layer's tokens per expert, then (with a capacity-limited router) one value per layer: its
        dropped slots, summed over data parallel as the tokens are."""
        if not self.summed_over_ranks:
            return NO_CROSS_RANK
        drops = len(self.cells) if self._has_drops else 0
        return CrossRankSizes(data_parallel=sum(self._layer_sizes()) + drops)

    def _layer_sizes(self) -> List[int]:
        return [int(np.prod(cell.tokens_per_expert.shape)) for cell in self.cells]

    def _step_dropped(self) -> np.ndarray:
        """This rank's dropped slots of the step so far per layer (0 for a layer without a capacity limit)."""
        if self._dropped_at_begin is None:
            return np.zeros(len(self.cells), np.float32)
        return np.nan_to_num(np.array(self._dropped()) - np.array(self._dropped_at_begin)).astype(np.float32)

    def cross_rank(self, num_micro_steps: int) -> Optional[CrossRankPayload]:
        """This rank's step totals per layer (and dropped slots), to be summed over the ranks with the
        gradients; on a device they stay there until the all-reduce."""
        step_tokens = self.step_tokens() if self.summed_over_ranks else None
        if step_tokens is None:
            return None
        drops = self._step_dropped() if self._has_drops else np.zeros(0, np.float32)
        if isinstance(step_tokens, np.ndarray):
            return CrossRankPayload(data_parallel=np.concatenate([step_tokens.reshape(-1), drops]).astype(np.float32))
        from mindspore import Tensor, mint
        import mindspore as ms

        tokens = step_tokens.reshape(-1).astype(ms.float32)
        return CrossRankPayload(data_parallel=mint.cat([tokens, Tensor(drops)]) if drops.size else tokens)

    def step_tokens(self):
        """This rank's tokens per expert of the step so far, (layers, experts), numpy or still on the
        device; None before the first micro-step."""
        if len(self._snapshots) < 2:
            return None
        return self._snapshots[-1] - self._snapshots[0]

    def receive_cross_rank(self, summed: CrossRankPayload) -> None:
        counts = np.rint(summed.data_parallel).astype(np.int64)
        sizes = self._layer_sizes()
        layers = np.split(counts[:sum(sizes)], np.cumsum(sizes)[:-1])
        self._all_ranks = [layer.reshape(cell.tokens_per_expert.shape) for layer, cell in zip(layers, self.cells)]
        if self._has_drops:
            self._dropped_all_ranks = counts[sum(sizes):]

    def on_event(self, event) -> None:
        if isinstance(event, StepBegin):
            self._snapshots = [self._snapshot()]
            if self._has_drops:
                self._dropped_at_begin = self._dropped()
        elif isinstance(event, MicroBatchEnd) and self._snapshots:
            self._snapshots.append(self._snapshot())

    def _snapshot(self):
        """The cumulative counts of every selected layer, copied (the model keeps adding to them)."""
        counts = [cell.tokens_per_expert for cell in self.cells]
        if self.on_host:
            return np.stack([c.asnumpy() for c in counts]).astype(np.float64)
        from mindspore import ops

        return ops.stack(counts)

    def collect(self, step: int) -> List[Record]:
        if len(self._snapshots) < 2:
            self.reset()
            return []
        dropped = self._dropped_records(step)
        counts = self._to_host(self._snapshots)            # (K + 1, layers, experts), cumulative
        per_micro_step = self._every_expert(np.rint(np.diff(counts, axis=0)).astype(np.int64))
        step_totals = self._all_ranks if self._all_ranks is not None else list(per_micro_step.sum(axis=0))
        self.reset()
        num_micro_steps = per_micro_step.shape[0]
        records = []
        for micro_step, routed in enumerate(per_micro_step):
            iteration = global_micro_step(step, micro_step, num_micro_steps)
            if iteration % self.config.save_tokens_per_expert_interval == 0:
                records += [Record(step, micro_step, self.rank, TOKENS_PER_EXPERT, layer.name,
                                   [int(v) for v in tokens], iteration)
                            for layer, tokens in zip(self.layers, routed)]
        for layer, step_tokens in zip(self.layers, step_totals):
            records.append(Record(step, None, self.rank, TOKENS_PER_EXPERT_STEP, layer.name,
                                  [int(v) for v in step_tokens]))
            records += self._summaries(step, layer.name, step_tokens)
        return records + dropped

    def _dropped_records(self, step: int) -> List[Record]:
        if self._dropped_at_begin is None:
            return []
        now = self._dropped()
        summed = self._dropped_all_ranks   # over data parallel, when the step's all-reduce carried them
        steps = [after - before if summed is None else summed[i]
                 for i, (before, after) in enumerate(zip(self._dropped_at_begin, now))]
        return [Record(step, None, self.rank, MOE_DROPPED_TOKENS, layer.name, float(round(value)))
                for layer, value, after in zip(self.layers, steps, now) if not np.isnan(after)]

    def _every_expert(self, per_micro_step: np.ndarray) -> np.ndarray:
        """(K, layers, local experts) -> (K, layers, every expert): one gather over the expert-parallel
        group, rank r's experts at [r * local, (r + 1) * local). Counts are exact in float32 below 2^24."""
        if self.expert_parallel is None:
            return per_micro_step
        rows = self.expert_parallel.gather(per_micro_step.astype(np.float64).reshape(-1))
        every = np.rint(rows).astype(np.int64).reshape(self.expert_parallel.size, *per_micro_step.shape)
        return np.concatenate(list(every), axis=-1)

    @staticmethod
    def _to_host(snapshots: Sequence) -> np.ndarray:
        if isinstance(snapshots[0], np.ndarray):
            return np.stack(snapshots)
        from mindspore import ops

        return ops.stack(list(snapshots)).asnumpy().astype(np.float64)  # one transfer per step

    def _summaries(self, step: int, name: str, tokens: np.ndarray) -> List[Record]:
        values = {MOE_MIN_TOKENS: float(tokens.min()), MOE_MAX_TOKENS: float(tokens.max()),
                  MOE_IDLE_EXPERTS: float((tokens == 0).sum())}
        mean = float(tokens.mean())
        if mean > 0:
            values[MOE_MAX_OVER_MEAN] = float(tokens.max()) / mean
            values[MOE_CV] = float(tokens.std()) / mean
        return [Record(step, None, self.rank, kind, name, value) for kind, value in values.items()]
