"""The tokens-per-expert probe's DeepSeek-V3 rule (`selection="grouped"`) on a MindSpore gate that returns
logits and holds an `e_score_correction_bias`, against a float64 numpy implementation of that rule as
DeepSeek-V3's router applies it (transformers' DeepseekV3TopkRouter.get_topk_indices); a bias large enough
to change the choice, so plain top-k would be told apart. (tests/loop/test_mindnlp_moe.py runs the real
DeepSeek-V3 and Qwen2-MoE routers of mindnlp.)"""
import logging

import numpy as np
import pytest

pytestmark = pytest.mark.ms27

EXPERTS, TOPK, GROUPS, TOPK_GROUPS, HIDDEN, TOKENS = 8, 2, 4, 2, 6, 40


def make_net(weight, bias):
    """`layers.0`: a gate returning x @ weight.T, with DeepSeek-V3's correction bias as a buffer."""
    from mindspore import Parameter, Tensor, nn, ops

    class Gate(nn.Cell):
        def __init__(self):
            super().__init__()
            self.weight = Parameter(Tensor(weight), name="weight")
            self.e_score_correction_bias = Parameter(Tensor(bias), name="bias", requires_grad=False)

        def construct(self, x):
            return ops.matmul(x, ops.transpose(self.weight, (1, 0)))

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.layers = nn.CellList([Gate()])

        def construct(self, x):
            return self.layers[0](x)

    return Net()


def deepseek_choice(logits, bias):
    """DeepSeek-V3: scores = sigmoid(logits) + bias; group score = sum of its 2 best; keep the topk_groups
    best groups (others' scores 0); each token's top-k experts."""
    scores = 1.0 / (1.0 + np.exp(-logits.astype(np.float64))) + bias
    grouped = scores.reshape(len(scores), GROUPS, EXPERTS // GROUPS)
    group_scores = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
    kept = np.argsort(-group_scores, axis=1, kind="stable")[:, :TOPK_GROUPS]
    mask = np.zeros_like(group_scores, bool)
    np.put_along_axis(mask, kept, True, axis=1)
    masked = np.where(np.repeat(mask, EXPERTS // GROUPS, axis=1), scores, 0.0)
    return np.argsort(-masked, axis=1, kind="stable")[:, :TOPK]


def test_grouped_selection_counts_deepseek_v3_choice(caplog):
    from mindspore import Tensor

    from mindmon.probes import attach_tokens_per_expert_probes

    rng = np.random.default_rng(0)
    weight = rng.normal(0, 1, (EXPERTS, HIDDEN)).astype(np.float32)
    bias = np.array([0, 0, 0, 0, 0, 0, 1.5, 0], np.float32)   # pulls expert 6 (group 3) into most choices
    net = make_net(weight, bias)
    probes = attach_tokens_per_expert_probes(net, r"layers\.0$", EXPERTS, TOPK, selection="grouped",
                                             num_groups=GROUPS, topk_groups=TOPK_GROUPS)
    x = rng.normal(0, 1, (TOKENS, HIDDEN)).astype(np.float32)
    with caplog.at_level(logging.WARNING, logger="mindmon"):
        net(Tensor(x))
    logits = x.astype(np.float64) @ weight.T.astype(np.float64)
    want = np.bincount(deepseek_choice(logits, bias).ravel(), minlength=EXPERTS)
    plain = np.bincount(np.argsort(-logits, axis=1)[:, :TOPK].ravel(), minlength=EXPERTS)
    assert not np.array_equal(want, plain)   # the bias and the groups change the choice
    got = net.layers[0].tokens_per_expert.asnumpy()
    assert got.tolist() == want.tolist() and not caplog.records
    probes.detach()


@pytest.mark.parametrize("kwargs, message", [
    ({"selection": "softmax"}, "selection: got 'softmax'"),
    ({"selection": "grouped", "num_groups": 3, "topk_groups": 1}, "num_groups dividing num_experts"),
    ({"selection": "grouped", "num_groups": 4, "bias": "no_such_bias"}, "reads the cell's 'no_such_bias'"),
])
def test_bad_router_arguments_are_refused_before_training(kwargs, message):
    from mindmon.probes import attach_tokens_per_expert_probes

    net = make_net(np.zeros((EXPERTS, HIDDEN), np.float32), np.zeros(EXPERTS, np.float32))
    with pytest.raises(ValueError, match=message):
        attach_tokens_per_expert_probes(net, r"layers\.0$", EXPERTS, TOPK, **kwargs)
