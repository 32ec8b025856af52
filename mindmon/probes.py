"""Model-side accumulators, attached by forward hooks, for models that do not keep them.

MaxLogitsMonitor reads `get_max_attention_logit()` and the MoE monitor reads `tokens_per_expert`;
MindFormers' newer models and the demo keep these themselves, most MindSpore models do not. The
probes add them to named cells, so both monitors work unchanged on such a model.
"""
from mindmon.features.max_logits.probe import MaxLogitProbes, attach_max_logit_probes, track_attention_function
from mindmon.features.moe_tokens.probe import TokensPerExpertProbes, attach_tokens_per_expert_probes

__all__ = ["MaxLogitProbes", "TokensPerExpertProbes", "attach_max_logit_probes", "attach_tokens_per_expert_probes",
           "track_attention_function"]
