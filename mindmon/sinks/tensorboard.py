"""TensorBoard event files, per rank: `<tensorboard_dir>/rank_<r>/events.out.tfevents.*` (or the folder
itself when it is the rank's own already: kj600's run folder).

Tags follow Megatron-LM where it has one (`lm loss`, `grad-norm`, `learning-rate`, `loss-scale`,
`max_attention_logit`), `<kind>` for the losses and the overflow flags (`overflow`, `update_skipped`,
`skipped_steps`), and `<kind>/<name>[/<index>]` otherwise (the max attention logit over every head of every
layer is Megatron's `max_attention_logit`, their mean `max_attention_logit/mean`). Step-level values are
plotted against the training step; micro-step values against the global micro-step
(mindmon.formats.run_folder).
With `vs_samples` and the global batch size known, every tag is written a second time as
`<tag>_vs_samples` (Megatron's `<tag> vs samples`), against the samples consumed so far.

`detail="layer"` (`monitor.tensorboard_tags`' default) keeps the page readable on a model of thousands
of tensors: the per-parameter gradient norms become one curve per layer (`LayerNorms`), and rank 0's
cross-rank columns of single parameters are left out. The sink's own default is every tag
(`detail="parameter"`, `vs_samples=True`), as `mindmon to-tensorboard` writes them.

`msprobe_tensorboard_sink` writes the msprobe and kj600 front doors' TensorBoard in msprobe's spelling
instead (mindmon/formats/msprobe_tags.py): `0:fc1.weight/rank0/post_grad_norm`, every value against the
0-based step (per-micro-step values carry their micro-step in the tag), no `_vs_samples` copies.
"""
import math
import os
from collections import defaultdict
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

from mindmon.core.engine import RunInfo, Sink
from mindmon.sinks.lines import unwritable
from mindmon.formats import msprobe_tags
from mindmon.formats.histogram import HISTOGRAM_KINDS
from mindmon.formats.run_folder import global_micro_step, rank_dir
from mindmon.core.records import (ACROSS_RANKS, DEVICE_LOSS, DEVICE_NORM, GRAD_NORM, LEARNING_RATE, LOCAL_LOSS, LOCAL_NORM,
                             LOSS, LOSS_SCALE, MAX_ATTENTION_LOGIT, MAX_ATTENTION_LOGIT_MAX, MAX_ATTENTION_LOGIT_MEAN,
                             MICRO_NORM, OVERFLOW, SAMPLES, SKIPPED_STEPS, TOKENS_PER_EXPERT, TOKENS_PER_EXPERT_STEP,
                             UPDATE_SKIPPED, Record, TensorStatsRecord)

# Megatron's names for the scalars it also plots, as tensorboardX writes them (it turns the
# characters TensorBoard does not allow in a tag, such as spaces, into "_": "lm loss" -> "lm_loss").
MEGATRON_TAGS = {LOSS: "lm_loss", GRAD_NORM: "grad-norm", LEARNING_RATE: "learning-rate",
                 LOSS_SCALE: "loss-scale", MAX_ATTENTION_LOGIT_MAX: MAX_ATTENTION_LOGIT, MAX_ATTENTION_LOGIT_MEAN: f"{MAX_ATTENTION_LOGIT}/mean"}
# One curve per kind: the record's name ("loss") adds nothing.
KIND_TAGS = (DEVICE_LOSS, LOCAL_LOSS, OVERFLOW, UPDATE_SKIPPED, SKIPPED_STEPS)
VS_SAMPLES = "_vs_samples"
DETAILS = ("layer", "parameter")
# Per-parameter gradient norms, one curve per layer with detail="layer".
LAYER_KINDS = (LOCAL_NORM, MICRO_NORM, DEVICE_NORM)
# Rank 0's cross-rank columns of single parameters (`micro_norm/<param>/max`, `accumulated_norm/<param>/mean`).
PARAMETER_COLUMNS = (f"{MICRO_NORM}/", "accumulated_norm/")


def _list_tags(record: Record) -> Iterator[Tuple[str, float]]:
    if isinstance(record, TensorStatsRecord):   # <point>/<tensor>/<statistic>
        for op, value in zip(record.ops, record.value):
            yield f"{record.kind}/{record.name}/{op}", value
    elif record.kind == MAX_ATTENTION_LOGIT:   # per head, and the layer's max over its heads
        yield f"{MAX_ATTENTION_LOGIT}/{record.name}", max(record.value)
        for head, value in enumerate(record.value):
            yield f"{MAX_ATTENTION_LOGIT}/{record.name}/head_{head}", value
    elif record.kind in (TOKENS_PER_EXPERT, TOKENS_PER_EXPERT_STEP):
        for expert, value in enumerate(record.value):
            yield f"{record.kind}/{record.name}/expert_{expert}", value
    else:
        for index, value in enumerate(record.value):
            yield f"{record.kind}/{record.name}/{index}", value


def record_tags(record: Record) -> List[Tuple[str, float]]:
    """(tag, value) pairs of one record. `samples` is an axis, not a curve: no tag.

    Example:
        record_tags(Record(3, None, 0, "grad_norm", "global", 1.2))   # [("grad-norm", 1.2)]
    """
    if record.kind == SAMPLES or record.kind in HISTOGRAM_KINDS:   # histograms are images (below)
        return []
    if isinstance(record.value, list):
        return list(_list_tags(record))
    if record.kind in MEGATRON_TAGS:
        return [(MEGATRON_TAGS[record.kind], record.value)]
    if record.kind in KIND_TAGS:
        return [(record.kind, record.value)]
    return [(f"{record.kind}/{record.name}", record.value)]


def histogram_tag(record: Record) -> str:
    return f"{record.kind}/{record.name}"


def msprobe_record_tags(record: Record) -> List[Tuple[str, float]]:
    """msprobe's `<tag name>_<statistic>` for tensor statistics msprobe names (its points, the L2 features,
    the collectives); mindmon's tags for the rest (losses and mindmon's own monitors, which msprobe lacks)."""
    name = msprobe_tags.tag_name(record.kind, record.name, record.micro_step, record.rank) \
        if isinstance(record, TensorStatsRecord) else None
    if name is None:
        return record_tags(record)
    return [(msprobe_tags.scalar_tag(name, op), value) for op, value in zip(record.ops, record.value)]


def msprobe_histogram_tag(record: Record) -> str:
    """The heat map's tag: the bare tag name, as msprobe's heat maps (`0:fc1.weight/rank0/adam_update`)."""
    return msprobe_tags.tag_name(record.kind, record.name, None, record.rank) or histogram_tag(record)


def msprobe_step(record: Record) -> int:
    """msprobe's x axis: the 0-based step (records count from 1) for every value."""
    return record.step - 1


def layer_of(parameter: str) -> str:
    """The layer a parameter belongs to: its name up to and including the first dot-separated component
    that is a number; a parameter outside numbered layers is a group of its own.

    Example:
        layer_of("decoder.layers.3.self_attention.linear_qkv.weight")   # "decoder.layers.3"
        layer_of("embedding.word_embeddings.weight")                     # itself
    """
    parts = parameter.split(".")
    for index, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:index + 1])
    return parameter


class LayerNorms:
    """A step's per-parameter gradient norms as per-layer norms, and rank 0's per-parameter cross-rank
    columns left out (TensorBoardSink with detail="layer").

    A layer's `device_norm` and `micro_norm` are sqrt(sum of its parameters' squared norms): the norm of
    the layer's gradients taken as one vector. Its `local_norm` at micro-step k is the increment of that
    norm of the layer's accumulated gradient, L_k - L_{k-1}, with L_k = sqrt(sum over the layer's
    parameters of A_k^2) and each parameter's A_k the sum of its increments 0..k of the step (L_{-1} = 0):
    the same definition as a parameter's, so a layer's increments add up to its accumulated norm.
    Only the parameters the norm filters select count.
    """

    def __init__(self):
        self._layers = {}          # parameter -> layer_of(parameter)
        self._step = None          # the step the accumulated norms below belong to
        self._accumulated = {}     # parameter -> A_k, its accumulated-gradient norm so far in the step
        self._layer_norms = {}     # layer -> L_k at the last micro-step seen

    def regroup(self, records: Sequence[Record]) -> List[Record]:
        kept, groups = [], defaultdict(list)
        for record in records:
            if record.kind in LAYER_KINDS and type(record) is Record and not isinstance(record.value, list):
                groups[(record.kind, record.step, record.micro_step)].append(record)
            elif not (record.kind == ACROSS_RANKS and record.name.startswith(PARAMETER_COLUMNS)):
                kept.append(record)
        for (kind, step, micro_step), members in sorted(groups.items(), key=_in_step_order):
            by_layer = self._by_layer(members)
            if kind == LOCAL_NORM:
                values = self._increments(step, by_layer)
            else:
                values = {layer: _norm([r.value for r in rs]) for layer, rs in by_layer.items()}
            first = members[0]
            kept += [Record(step, micro_step, first.rank, kind, layer, value, first.iteration)
                     for layer, value in values.items()]
        return kept

    def _by_layer(self, members: List[Record]):
        by_layer = defaultdict(list)
        for record in members:
            layer = self._layers.get(record.name)
            if layer is None:
                layer = self._layers[record.name] = layer_of(record.name)
            by_layer[layer].append(record)
        return by_layer

    def _increments(self, step: int, by_layer) -> dict:
        if step != self._step:
            self._step, self._accumulated, self._layer_norms = step, {}, {}
        increments = {}
        for layer, members in by_layer.items():
            for record in members:
                self._accumulated[record.name] = self._accumulated.get(record.name, 0.0) + record.value
            norm = _norm([self._accumulated[r.name] for r in members])
            increments[layer] = norm - self._layer_norms.get(layer, 0.0)
            self._layer_norms[layer] = norm
        return increments


def _in_step_order(group) -> tuple:
    (kind, step, micro_step), _ = group
    return step, -1 if micro_step is None else micro_step, kind


def _norm(values: Sequence[float]) -> float:
    return math.sqrt(sum(v * v for v in values))


class Axes:
    """Where a record sits on the x axes: training step (or global micro-step), and samples.

    `micro_steps_per_step` (K) and `global_batch_size` come from the trainer when it knows them;
    K otherwise grows with the largest micro_step seen, which is exact once every micro-step of a
    step has been seen (local_loss and local_norm records cover them all).
    """

    def __init__(self, global_batch_size: Optional[int] = None, micro_steps_per_step: Optional[int] = None):
        self.global_batch_size = global_batch_size
        self.micro_steps = micro_steps_per_step or 0
        self._known_micro_steps = micro_steps_per_step is not None

    def see(self, records: List[Record]) -> None:
        for record in records:
            if record.kind == SAMPLES and record.step > 0:
                self.global_batch_size = round(record.value / record.step)
            elif record.micro_step is not None and not self._known_micro_steps:
                self.micro_steps = max(self.micro_steps, record.micro_step + 1)

    def step(self, record: Record) -> int:
        if record.micro_step is None:
            return record.step
        if record.iteration is not None:
            return record.iteration
        return global_micro_step(record.step, record.micro_step, self.micro_steps)

    def samples(self, record: Record) -> Optional[int]:
        if not self.global_batch_size:
            return None
        if record.micro_step is None:
            return record.step * self.global_batch_size
        per_micro = self.global_batch_size // max(self.micro_steps, 1)
        return (record.step - 1) * self.global_batch_size + (record.micro_step + 1) * per_micro


class TensorBoardSink(Sink):
    """Writes every record as TensorBoard scalars (tensorboardX's summaries), written at every step end
    in one piece, to `<tensorboard_dir>/rank_<r>/` (`per_rank=False`: to `tensorboard_dir` itself, a folder
    of this rank's own); a full disk leaves the file whole up to the last step (mindmon.sinks.event_file).

    Example:
        sink = TensorBoardSink("./output/tensorboard")
        sink.open(RunInfo(rank=0, global_batch_size=8))
        sink.write([Record(1, None, 0, "grad_norm", "global", 1.19)])   # tags grad-norm, grad-norm_vs_samples
        sink.close()

    `detail` ("parameter" or "layer", LayerNorms) and `vs_samples` choose the tags; the defaults write
    every one (`monitor.tensorboard_tags` defaults to "layer" and no `_vs_samples` copies).
    """

    def __init__(self, tensorboard_dir: str, log_interval: int = 1, queue_size: int = 1000, tags=record_tags,
                 image_tag=histogram_tag, step_of: Optional[Callable[[Record], int]] = None, per_rank: bool = True,
                 detail: str = "parameter", vs_samples: bool = True):
        if detail not in DETAILS:
            raise ValueError(f"detail: got {detail!r}; allowed: one of {list(DETAILS)}")
        self.tensorboard_dir = tensorboard_dir
        self.layers = LayerNorms() if detail == "layer" else None
        self.vs_samples = vs_samples
        self.per_rank = per_rank
        self.tags = tags   # record -> [(tag, value)]; monitor_config gives MindFormers' tags (sinks/training_state.py)
        self.image_tag = image_tag   # histogram record -> the tag of its heat map image
        self.step_of = step_of       # record -> its x; given, it replaces the axes below and no _vs_samples copy
        self.heatmaps = None         # mindmon.sinks.heatmap.Heatmaps, at the first histogram record
        self.log_interval = log_interval
        self.queue_size = queue_size
        self.log_dir: Optional[str] = None
        self.axes = Axes()
        self._writer = None

    def open(self, run: RunInfo) -> None:
        from mindmon.extras import require

        require("tensorboard", "tensorboardX")
        from mindmon.sinks.event_file import EventFile

        self.log_dir = rank_dir(self.tensorboard_dir, run.rank) if self.per_rank else self.tensorboard_dir
        self.axes = Axes(run.global_batch_size, run.micro_steps_per_step)
        try:
            os.makedirs(self.log_dir, exist_ok=True)
            self._writer = EventFile(self.log_dir, max_pending=self.queue_size)
        except (OSError, ValueError) as error:
            raise unwritable("monitor.tensorboard.tensorboard_dir", self.tensorboard_dir, self.log_dir, error) from None

    def write(self, records: Sequence[Record]) -> None:
        records = [r for r in records if r.step % self.log_interval == 0]
        self.axes.see(records)
        if self.layers is not None:
            records = self.layers.regroup(records)
        at = defaultdict(list)   # x -> its scalars: one event each (tensorboardX's add_scalar: one per value)
        for record in records:
            if self.step_of is not None:
                step, samples = self.step_of(record), None
            else:
                step = self.axes.step(record)
                samples = self.axes.samples(record) if self.vs_samples else None
            if record.kind in HISTOGRAM_KINDS:
                self._add_heatmap(record, step)
            for tag, value in self.tags(record):
                at[step].append((tag, value))
                if samples is not None:
                    at[(VS_SAMPLES, samples)].append((tag + VS_SAMPLES, value))
        self._add_scalars(at)

    def _add_scalars(self, at) -> None:
        """Every x's scalars in one event. MindSpore selects protobuf's pure-Python implementation, where
        an event per value (add_scalar) cost about 140 us a value here, and a Value made with keyword
        arguments 3.5x what `value.add()` costs (docs/performance.md, "Cross-rank summaries")."""
        from tensorboardX.proto.summary_pb2 import Summary

        for x, scalars in at.items():
            summary = Summary()
            for tag, value in scalars:
                entry = summary.value.add()
                entry.tag, entry.simple_value = tag, float(value)
            self._writer.add_summary(summary, x[1] if isinstance(x, tuple) else x)

    def _add_heatmap(self, record: Record, step: int) -> None:
        """The record's heat map with its new column, as an image (kj600's form of the update/ratio
        histograms): drawn again at every step, so the image at step s shows steps up to s."""
        if self.heatmaps is None:
            from mindmon.sinks.heatmap import Heatmaps

            self.heatmaps = Heatmaps()
        image = self.heatmaps.add(record, step)
        self._writer.add_image(self.image_tag(record), image, step, dataformats="HWC")

    def flush(self) -> None:
        if self._writer is not None and not self.closed:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def msprobe_tensorboard_sink(tensorboard_dir: str, per_rank: bool = True) -> TensorBoardSink:
    """TensorBoard in msprobe's spelling (the msprobe and kj600 front doors'): tags
    `0:fc1.weight/rank0/post_grad_norm`, heat maps `0:fc1.weight/rank0/adam_update`, x = the 0-based step.
    The events go to `<tensorboard_dir>/rank_<r>/`, or with `per_rank=False` into `tensorboard_dir` itself
    (a folder named for one rank, as msprobe's and kj600's run folders are).

    Example:
        TrainerMon.from_config(config, sinks=[msprobe_tensorboard_sink("./tb")])   # ./tb/rank_0/events...
    """
    return TensorBoardSink(tensorboard_dir, tags=msprobe_record_tags, image_tag=msprobe_histogram_tag,
                           step_of=msprobe_step, per_rank=per_rank)
