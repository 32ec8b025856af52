"""TensorBoard tags with loss components: Megatron's names. Megatron writes each part under its own name
(`lm loss`, `load_balancing_loss`, `z_loss`, `mtp_1 loss`; tensorboardX turns spaces into `_`), and its
`lm loss` is the language-model part alone. So once the components are written, the step's whole loss
(the `loss` record, `lm_loss` otherwise) takes MindFormers' tag for it, `loss`, and `lm_loss` is the
language-model component's."""
import re

from mindmon.core.records import LOSS, LOSS_COMPONENT, LOSS_COMPONENT_STEP

# What tensorboardX does to a tag with other characters (and logs at every call): each becomes "_".
NOT_IN_A_TAG = re.compile(r"[^-/\w.]")


def tag_of(name: str) -> str:
    return NOT_IN_A_TAG.sub("_", name)


def with_component_tags(tags):
    """`tags` (record -> [(tag, value)]) with the components' and the whole loss's tags."""

    def component_tags(record):
        if record.kind == LOSS_COMPONENT_STEP:
            return [(tag_of(record.name), record.value)]
        if record.kind == LOSS_COMPONENT:     # per micro-batch, against the global micro-step
            return [(tag_of(f"{LOSS_COMPONENT}/{record.name}"), record.value)]
        if record.kind == LOSS:
            return [("loss", record.value)]
        return tags(record)

    return component_tags
