"""MaxLogitsMonitor: the `callbacks:` entry that asks for the max attention logit per layer and head."""
from mindmon.features.max_logits.config import check_step_interval
from mindmon.trainer_callbacks import TrainerCallback


class MaxLogitsMonitor(TrainerCallback):
    """A declaration, registered under MindFormers' name so the YAML stays what MindFormers users write:

        callbacks:
          - type: MaxLogitsMonitor
            step_interval: 1

    The MindFormers integration reads its `step_interval` and builds a MaxAttentionLogitMonitor into
    the run's MonitorGroup; the values then reach every sink like all other records (log lines
    `step:[    2/   10] max_attention_logit/<layer>: [1.5, 12.25]`, `.../mean: 4.219`, `.../max: 12.25`,
    JSONL, TensorBoard). In a plain loop, put the same entry in the `callbacks` list given to
    `mindmon.build_group` (docs/plain-loop.md).
    """

    def __init__(self, step_interval: int = 1):
        self.step_interval = check_step_interval(step_interval)
