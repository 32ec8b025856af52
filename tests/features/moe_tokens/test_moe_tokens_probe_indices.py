"""A tokens-per-expert probe on a router that returns the chosen expert ids, as DeepSeek-V3's
DeepseekV3TopkRouter does (`(topk_indices, topk_weights)`): left at the default selection it would count
the top-k of the ids, so its first forward refuses with one line naming `selection="indices"`; with that
selection it counts what numpy counts from the same gate's logits."""
import logging

import numpy as np
import pytest

pytestmark = pytest.mark.ms27

EXPERTS, TOPK, HIDDEN, TOKENS = 8, 2, 6, 40   # TOKENS * TOPK divides by EXPERTS: the ids reshape into rows


def make_router(weight, id_dtype):
    """`layers.0`: a gate returning (each token's TOPK expert ids as `id_dtype`, their softmax weights)."""
    from mindspore import Parameter, Tensor, nn, ops

    class Router(nn.Cell):
        def __init__(self):
            super().__init__()
            self.weight = Parameter(Tensor(weight), name="weight")

        def construct(self, x):
            scores = ops.softmax(ops.matmul(x, ops.transpose(self.weight, (1, 0))), -1)
            weights, ids = ops.topk(scores, TOPK)
            return ops.cast(ids, id_dtype), weights

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.layers = nn.CellList([Router()])

        def construct(self, x):
            return self.layers[0](x)

    return Net()


def numpy_counts(x, weight):
    """Tokens per expert of each token's TOPK largest logits (softmax keeps the order), in float64; the
    gap between the k-th and the next logit is checked to be far above float32 rounding."""
    logits = x.astype(np.float64) @ weight.T.astype(np.float64)
    ordered = np.sort(logits, axis=1)[:, ::-1]
    assert (ordered[:, TOPK - 1] - ordered[:, TOPK]).min() > 1e-5   # float32 rounds at ~1e-7 here
    chosen = np.argsort(-logits, axis=1, kind="stable")[:, :TOPK]
    return np.bincount(chosen.ravel(), minlength=EXPERTS)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    weight = rng.normal(0, 1, (EXPERTS, HIDDEN)).astype(np.float32)
    return weight, rng.normal(0, 1, (TOKENS, HIDDEN)).astype(np.float32)


@pytest.mark.parametrize("id_dtype, shown", [("int32", "Int32"), ("int64", "Int64")])
def test_default_selection_on_expert_ids_is_refused_once_and_the_forward_goes_on(caplog, id_dtype, shown):
    import mindspore as ms
    from mindspore import Tensor

    from mindmon.probes import attach_tokens_per_expert_probes

    weight, x = _data()
    net = make_router(weight, getattr(ms, id_dtype))
    probes = attach_tokens_per_expert_probes(net, r"layers\.0$", EXPERTS, TOPK, output_index=0)
    with caplog.at_level(logging.WARNING, logger="mindmon"):
        ids, _ = net(Tensor(x))
        net(Tensor(x))   # detached: no second line
    lines = [record.getMessage() for record in caplog.records]
    assert lines == [f'mindmon: tokens-per-expert probe layers.0: ValueError: the router\'s output[0] holds '
                     f'integer expert ids ({shown}), not a score per expert; pass selection="indices"; the probe '
                     f'is detached and training goes on']
    assert probes.handles == []
    # the forward's own result is untouched, and nothing was counted
    assert np.bincount(ids.asnumpy().ravel(), minlength=EXPERTS).tolist() == numpy_counts(x, weight).tolist()
    assert net.layers[0].tokens_per_expert.asnumpy().tolist() == [0.0] * EXPERTS
    probes.detach()


@pytest.mark.parametrize("id_dtype", ["int32", "int64"])
def test_indices_selection_counts_the_router_choice(caplog, id_dtype):
    import mindspore as ms
    from mindspore import Tensor

    from mindmon.probes import attach_tokens_per_expert_probes

    weight, x = _data(1)
    net = make_router(weight, getattr(ms, id_dtype))
    probes = attach_tokens_per_expert_probes(net, r"layers\.0$", EXPERTS, TOPK, output_index=0,
                                             selection="indices")
    _, second = _data(2)
    with caplog.at_level(logging.WARNING, logger="mindmon"):
        net(Tensor(x))
        net(Tensor(second))   # cumulative over forwards
    want = numpy_counts(x, weight) + numpy_counts(second, weight)
    assert want.sum() == 2 * TOKENS * TOPK and len(set(want.tolist())) > 1
    assert net.layers[0].tokens_per_expert.asnumpy().tolist() == want.astype(float).tolist()
    assert not caplog.records and len(probes.handles) == 1
    probes.detach()


def test_a_tuple_without_output_index_names_output_index(caplog):
    import mindspore as ms
    from mindspore import Tensor

    from mindmon.probes import attach_tokens_per_expert_probes

    weight, x = _data()
    net = make_router(weight, ms.int64)
    probes = attach_tokens_per_expert_probes(net, r"layers\.0$", EXPERTS, TOPK, selection="indices")
    with caplog.at_level(logging.WARNING, logger="mindmon"):
        net(Tensor(x))
    assert [record.getMessage() for record in caplog.records] == [
        "mindmon: tokens-per-expert probe layers.0: ValueError: the router returns 2 outputs; pass output_index= "
        "the one to read; the probe is detached and training goes on"]
    probes.detach()
