"""The record that flows from a monitor to the sinks, and the kinds mindmon writes
(docs/semantics.md defines each one)."""
from dataclasses import dataclass, fields
from typing import List, Optional, Sequence, Tuple, Union

# Kinds written by the train_state monitor.
LOCAL_LOSS = "local_loss"      # loss of one micro-batch (not divided by K)
LOCAL_NORM = "local_norm"      # A_k - A_{k-1}: increment of the accumulated-gradient norm at micro-step k
MICRO_NORM = "micro_norm"      # |g_k|: norm of micro-batch k's own contribution (gradient of loss_k / K)
DEVICE_NORM = "device_norm"    # A_{K-1}: norm of the accumulated gradient, before clipping
DEVICE_LOSS = "device_loss"    # mean of the step's micro-batch losses

# Kinds written by MaxLogitsMonitor and the MoE monitor; `name` is the layer.
MAX_ATTENTION_LOGIT = "max_attention_logit"   # list, per head: running max of QK^T/sqrt(d) over the step
MAX_ATTENTION_LOGIT_MEAN = "max_attention_logit_mean"  # name "all": mean over every head of every layer
MAX_ATTENTION_LOGIT_MAX = "max_attention_logit_max"    # name "all": max over every head of every layer
TOKENS_PER_EXPERT = "tokens_per_expert"       # list, per expert: tokens routed in one micro-step
TOKENS_PER_EXPERT_STEP = "tokens_per_expert_step"  # list, per expert: the step's tokens, summed over
                                                   # micro-steps and, with several ranks, over the ranks
# Per-step load summaries of one MoE layer, from its tokens_per_expert_step.
MOE_MAX_OVER_MEAN = "moe_max_over_mean"       # busiest expert's tokens / mean tokens per expert
MOE_CV = "moe_cv"                             # coefficient of variation (std / mean) of tokens per expert
MOE_MIN_TOKENS = "moe_min_tokens"
MOE_MAX_TOKENS = "moe_max_tokens"
MOE_IDLE_EXPERTS = "moe_idle_experts"         # experts that got no token in the step
MOE_SUMMARY_KINDS = (MOE_MAX_OVER_MEAN, MOE_CV, MOE_MIN_TOKENS, MOE_MAX_TOKENS, MOE_IDLE_EXPERTS)
MOE_DROPPED_TOKENS = "moe_dropped_tokens"     # routing slots dropped by the capacity limit in the step (data-parallel sum)

# Written by rank 0 with monitor.across_ranks: name `<kind>/<parameter or layer>/<statistic>`, a statistic
# (min, mean, max, min_rank, max_rank) over the data-parallel ranks of one per-rank value.
ACROSS_RANKS = "across_ranks"

# Per-step values the trainer hands to callbacks at step end (MonitorCallback); micro_step is None.
LOSS = "loss"                      # name "loss": the step's loss the trainer returns (mean of its micro-batch losses)
GRAD_NORM = "grad_norm"            # name "global": global norm of the accumulated gradient, before clipping
LEARNING_RATE = "learning_rate"    # name "lr": lr_scheduler(step), as MindFormers' LossCallback prints it
SAMPLES = "samples"                # name "consumed": samples consumed after the step (step x global batch size)
MAX_NORM = "max_norm"              # name "global": the clipping threshold in force (written with grad_norm, clipping on)

# Per-step values of mixed-precision training (the loss_scale feature); micro_step is None.
LOSS_SCALE = "loss_scale"          # name "scale": the loss scale after the step's adjustment (the next step's)
OVERFLOW = "overflow"              # name "grads": 1.0 when the step's gradients were not finite, else 0.0
UPDATE_SKIPPED = "update_skipped"  # name "update": 1.0 when the optimizer's update was not applied, else 0.0
SKIPPED_STEPS = "skipped_steps"    # name "total": steps skipped so far in this process, this one in
LOSS_SCALE_KINDS = (LOSS_SCALE, OVERFLOW, UPDATE_SKIPPED, SKIPPED_STEPS)

# The parts of a model's loss (the loss_components feature); `name` is the component ("lm loss", ...).
LOSS_COMPONENT = "loss_component"            # one micro-batch's value of the component (not divided by K)
LOSS_COMPONENT_STEP = "loss_component_step"  # its mean over the step's micro-batches and the data-parallel ranks


# Per-step time, throughput and memory (the speed feature); micro_step is None but for the per-micro-batch
# `forward_backward`.
STEP_TIME = "step_time"            # seconds: name "step" (the whole window) or a phase of it, or "compute"
THROUGHPUT = "throughput"          # name samples_per_second, tokens_per_second (this rank), job_* (the job)
WALL_CLOCK = "wall_clock"          # name "step_end": Unix time in seconds when the step's records were made
ETA = "eta"                        # name "seconds": to the last step, at the mean step time so far
MEMORY = "memory"                  # bytes: name peak_rss (the process, this step), device_peak_* (the device)
SLOW_RANK = "slow_rank"            # name "rank <r>": its computing time / the median over the ranks (rank 0)
RANK_LOST = "rank_lost"            # rank 0, name "rank <r>", value 1.0: the peer watchdog found it gone (step: rank 0's)
HANG = "hang"                      # rank 0, name "<ranks> in <phase> of step <s>": seconds no rank had progressed
THROUGHPUT_DROP = "throughput_drop"  # rank 0, name "samples_per_second": this step's / the median of the last 20
FLOPS = "flops"                    # name "useful" (the model's work, for MFU) or "executed" (every matmul run)
MFU = "mfu"                        # name "mfu" (useful / time / peak), "hfu" (executed), "peak_tflops" (the peak used)
SPEED_KINDS = (STEP_TIME, THROUGHPUT, WALL_CLOCK, ETA, MEMORY, SLOW_RANK, THROUGHPUT_DROP, FLOPS, MFU)


@dataclass(frozen=True)
class Record:
    """One value: `step` is 1-based like MindFormers' `step:[  1/ 20]`; `micro_step` is 0-based,
    None for step-level values. `value` is a float, or a list (per head, per expert)."""

    step: int
    micro_step: Optional[int]
    rank: int
    kind: str
    name: str
    value: Union[float, List[float]]
    iteration: Optional[int] = None  # global micro-step count, where upstream prints one (`iter`)

    @classmethod
    def many(cls, step: int, micro_step: Optional[int], rank: int, kind: str, names: Sequence[str],
             values: Sequence) -> List["Record"]:
        """One record per (name, value): the constructor's records, made without its `object.__setattr__`
        per field (a frozen dataclass's `__init__`). A step makes hundreds or thousands: measured warm, a
        Record 0.87 us by the constructor against 0.55, a TensorStatsRecord 2.5 against 0.9."""
        common, records = _common(cls, step=step, micro_step=micro_step, rank=rank, kind=kind), []
        for name, value in zip(names, values):
            record = object.__new__(cls)
            record.__dict__.update(common, name=name, value=value)
            records.append(record)
        return records


@dataclass(frozen=True)
class TensorStatsRecord(Record):
    """A tensor's statistics at one collection point (`kind`: param_origin, grad_reduced, exp_avg, ...):
    `value` holds one number per entry of `ops`; `shape` and `dtype` describe the tensor."""

    ops: Tuple[str, ...] = ()
    shape: Tuple[int, ...] = ()
    dtype: str = ""

    def stat(self, op: str) -> float:
        return self.value[self.ops.index(op)]

    @classmethod
    def for_tensors(cls, step: int, micro_step: Optional[int], rank: int, kind: str, names: Sequence[str],
                    values: Sequence[List[float]], ops: Tuple[str, ...],
                    layouts: Sequence[Tuple[Tuple[int, ...], str]]) -> List["TensorStatsRecord"]:
        """`Record.many` for tensors: names, values and (shape, dtype) layouts side by side, one `ops`."""
        common, records = _common(cls, step=step, micro_step=micro_step, rank=rank, kind=kind, ops=ops), []
        for name, value, (shape, dtype) in zip(names, values, layouts):
            record = object.__new__(cls)
            record.__dict__.update(common, name=name, value=value, shape=shape, dtype=dtype)
            records.append(record)
        return records

    def per_statistic(self) -> List[Record]:
        """One plain record per statistic, named `<tensor>/<op>` (for consumers of scalars)."""
        return [Record(self.step, self.micro_step, self.rank, self.kind, f"{self.name}/{op}", value)
                for op, value in zip(self.ops, self.value)]


def _common(cls, **values) -> dict:
    """Every field of `cls` at its default, then `values`: what a step's records share."""
    defaults = _DEFAULTS.get(cls)
    if defaults is None:
        defaults = _DEFAULTS[cls] = {field.name: field.default for field in fields(cls)}
    return dict(defaults, **values)


_DEFAULTS: dict = {}
