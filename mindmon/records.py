"""The record that flows from a monitor to the sinks."""
from dataclasses import dataclass
from typing import Dict, List, Optional, Union

# Kinds written by the train_state monitor.
LOCAL_LOSS = "local_loss"      # loss of one micro-batch (not divided by K)
LOCAL_NORM = "local_norm"      # A_k - A_{k-1}: increment of the accumulated-gradient norm at micro-step k
MICRO_NORM = "micro_norm"      # |g_k|: norm of micro-batch k's own contribution (gradient of loss_k / K)
DEVICE_NORM = "device_norm"    # A_{K-1}: norm of the accumulated gradient, before clipping
DEVICE_LOSS = "device_loss"    # mean of the step's micro-batch losses

# Kinds written by MaxLogitsMonitor and the MoE monitor; `name` is the layer.
MAX_ATTENTION_LOGIT = "max_attention_logit"   # list, per head: running max of QK^T/sqrt(d) over the step
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

# Per-step values the trainer hands to callbacks at step end (MonitorCallback); micro_step is None.
LOSS = "loss"                      # name "loss": the step's loss the trainer returns (mean of its micro-batch losses)
GRAD_NORM = "grad_norm"            # name "global": global norm of the accumulated gradient, before clipping
LEARNING_RATE = "learning_rate"    # name "lr": lr_scheduler(step), as MindFormers' LossCallback prints it
SAMPLES = "samples"                # name "consumed": samples consumed after the step (step x global batch size)


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

    def to_json(self) -> dict:
        out = {"step": self.step, "micro_step": self.micro_step, "rank": self.rank,
               "kind": self.kind, "name": self.name, "value": self.value}
        if self.iteration is not None:
            out["iter"] = self.iteration
        return out


def moe_layer_fields(name: str) -> Dict[str, Union[str, int]]:
    """Megatron's fields for an MoE layer record name: `decoder.layers.3` -> block, layer;
    `mtp.layers.0` -> block, mtp_idx, layer (the MTP module's one transformer layer, 0)."""
    block, _, index = name.split(".")
    if block == "mtp":
        return {"block": "mtp", "mtp_idx": int(index), "layer": 0}
    return {"block": block, "layer": int(index)}
