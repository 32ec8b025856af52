"""The probes' small contracts, without the Trainer: which cells a pattern selects and what the error
names, the tokens-per-expert counter on tuple outputs and 3-d scores against numpy, its bounds on
topk, and detaching. Fast; they pin down what the end-to-end probe tests leave open."""
import mindspore as ms
import numpy as np
import pytest
from mindspore import nn

from mindmon.probes import attach_tokens_per_expert_probes
from mindmon.core.names import cells_matching

pytestmark = pytest.mark.ms27   # needs neither MindFormers nor MindSpore 2.9

EXPERTS = 5


class Identity(nn.Cell):
    def construct(self, x):
        return x


class Blocks(nn.Cell):
    """Eight named sub-cells: more than an error message lists."""

    def __init__(self):
        super().__init__()
        self.layers = nn.CellList([Identity() for _ in range(8)])


def test_a_pattern_matching_nothing_lists_the_first_six_cell_names():
    with pytest.raises(ValueError) as error:
        cells_matching(Blocks(), r"attention$", "probe")
    assert str(error.value) == ("probe: the pattern 'attention$' matches no cell of Blocks; allowed: a regular "
                                "expression over cell names such as ['layers', 'layers.0', 'layers.1', "
                                "'layers.2', 'layers.3', 'layers.4']")


def test_named_cells_are_the_matching_ones_in_model_order():
    model = Blocks()
    assert [name for name, _ in cells_matching(model, r"layers\.[357]$", "probe")] == ["layers.3", "layers.5", "layers.7"]
    assert cells_matching(model, r"^layers$", "probe") == [("layers", model.layers)]


class Router(nn.Cell):
    """Returns (hidden, scores): the scores are the second output, shaped (batch, seq, experts)."""

    def construct(self, hidden, scores):
        return hidden, scores


class RoutedModel(nn.Cell):
    def __init__(self):
        super().__init__()
        self.decoder = nn.CellList([Router(), Router()])

    def construct(self, hidden, scores):
        return [router(hidden, s) for router, s in zip(self.decoder, scores)]


def _numpy_counts(scores, topk):
    """Per expert: how many tokens have it among their topk largest scores (float64, no ties)."""
    flat = np.asarray(scores, np.float64).reshape(-1, EXPERTS)
    chosen = np.argsort(-flat, axis=1)[:, :topk]
    return np.bincount(chosen.ravel(), minlength=EXPERTS)


def _scores(rng, batch=2, seq=3):
    return [rng.permutation(batch * seq * EXPERTS).reshape(batch, seq, EXPERTS).astype(np.float32) for _ in range(2)]


def test_tuple_output_and_3d_scores_count_like_numpy_and_accumulate():
    rng = np.random.default_rng(0)
    model = RoutedModel()
    probes = attach_tokens_per_expert_probes(model, r"^decoder\.\d$", num_experts=EXPERTS, topk=2, output_index=1)
    assert [p.cell for p in probes.probes] == list(model.decoder)
    for router in model.decoder:
        assert router.tokens_per_expert.dtype == ms.float32
        np.testing.assert_array_equal(router.tokens_per_expert.asnumpy(), np.zeros(EXPERTS))
    hidden = ms.Tensor(np.zeros((2, 3), np.float32))
    first, second = _scores(rng), _scores(rng)
    model(hidden, [ms.Tensor(s) for s in first])
    model(hidden, [ms.Tensor(s) for s in second])
    for index, router in enumerate(model.decoder):
        want = _numpy_counts(first[index], 2) + _numpy_counts(second[index], 2)   # cumulative over calls
        np.testing.assert_array_equal(router.tokens_per_expert.asnumpy(), want)
        assert want.sum() == 2 * 6 * 2
    probes.probes[0].reset()
    np.testing.assert_array_equal(model.decoder[0].tokens_per_expert.asnumpy(), np.zeros(EXPERTS))


def test_topk_bounds_and_a_topk_of_every_expert():
    with pytest.raises(ValueError, match=r"^topk: got 0; allowed: 1..num_experts \(5\)$"):
        attach_tokens_per_expert_probes(RoutedModel(), r"^decoder\.\d$", num_experts=EXPERTS, topk=0)
    with pytest.raises(ValueError, match=r"^attach_tokens_per_expert_probes: the pattern 'gate\$' matches no cell"):
        attach_tokens_per_expert_probes(RoutedModel(), r"gate$", num_experts=EXPERTS, topk=1)
    with pytest.raises(ValueError, match=r"^topk: got 6; allowed"):
        attach_tokens_per_expert_probes(RoutedModel(), r"^decoder\.\d$", num_experts=EXPERTS, topk=6)
    model = RoutedModel()
    attach_tokens_per_expert_probes(model, r"^decoder\.0$", num_experts=EXPERTS, topk=EXPERTS, output_index=1)
    model(ms.Tensor(np.zeros(1, np.float32)), [ms.Tensor(s) for s in _scores(np.random.default_rng(1))])
    np.testing.assert_array_equal(model.decoder[0].tokens_per_expert.asnumpy(), np.full(EXPERTS, 6.0))


def test_output_index_none_reads_the_whole_output_and_detach_removes_everything():
    rng = np.random.default_rng(2)
    model = nn.CellList([Identity()])
    probes = attach_tokens_per_expert_probes(model, r"^0$", num_experts=EXPERTS, topk=1)
    scores = _scores(rng)[0]
    model[0](ms.Tensor(scores))
    np.testing.assert_array_equal(model[0].tokens_per_expert.asnumpy(), _numpy_counts(scores, 1))
    with pytest.raises(ValueError, match=r"^Identity already counts tokens_per_expert; attach no probe to it$"):
        attach_tokens_per_expert_probes(model, r"^0$", num_experts=EXPERTS, topk=1)
    probes.detach()
    probes.detach()   # a second detach finds nothing left to remove, and says nothing
    assert getattr(model[0], "tokens_per_expert", None) is None
    model[0](ms.Tensor(scores))   # the hook is gone: nothing is counted again
    assert getattr(model[0], "tokens_per_expert", None) is None
    attach_tokens_per_expert_probes(model, r"^0$", num_experts=EXPERTS, topk=1)   # attachable again
