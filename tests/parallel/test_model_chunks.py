"""The virtual-pipeline name space (mindmon/parallel/chunks.py) in one process: msprobe's `<chunk>:` names, targets
with and without the prefix, the CSV's vpp_stage column, and the clean errors of set_monitor/process_group.
The chunks trained on real msrun workers: tests/parallel/test_model_parallel.py."""
import json

import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn, ops

from mindmon.parallel.chunks import ModelChunks, as_model, names_match, split_chunk
from mindmon.config import ConfigError
from mindmon.features.tensor_stats.targets import select_parameters, squash_name
from mindmon.formats.msprobe_csv import format_row, format_text, header, read_csv
from mindmon.msprobe import TrainerMon
from mindmon.core.records import TensorStatsRecord


class Layer(nn.Cell):
    def __init__(self, width):
        super().__init__()
        self.weight = Parameter(Tensor(np.ones((width, width), np.float32)))
        self.bias = Parameter(Tensor(np.zeros(width, np.float32)))


class Chunk(nn.Cell):
    def __init__(self, chunk):
        super().__init__()
        self.layers = nn.CellList([Layer(2 + chunk)])
        for parameter in self.trainable_params():
            parameter.name = f"chunk{chunk}.{parameter.name}"


def test_names_and_matching():
    assert split_chunk("1:layers.0.weight") == (1, "layers.0.weight") and split_chunk("fc1") == (0, "fc1")
    assert names_match("1:layers.0", "layers.0") and names_match("1:layers.0", "1:layers.0")
    assert not names_match("1:layers.0", "0:layers.0")
    assert names_match("fc1", "0:fc1") and not names_match("fc1", "1:fc1")   # a single model is chunk 0
    assert names_match("0:layers.0.weight", "layers.0", prefix_of=True)
    assert not names_match("0:layers.01.weight", "layers.0", prefix_of=True)
    assert squash_name("1:model.layers.0.w") == "1:layers.0.w"


def test_chunks_as_one_model_and_targets_with_or_without_prefix():
    chunks = [Chunk(0), Chunk(1)]
    model = as_model(chunks)
    assert isinstance(model, ModelChunks) and as_model([chunks[0]]) is chunks[0]
    assert [n for n, _ in model.cells_and_names()] == ["0:", "0:layers", "0:layers.0", "1:", "1:layers", "1:layers.0"]
    parameters = chunks[0].trainable_params() + chunks[1].trainable_params()
    picked = select_parameters(model, parameters, ("0:layers.0", "layers.0.weight"))
    assert picked == [(0, "0:layers.0.weight"), (1, "0:layers.0.bias"), (2, "1:layers.0.weight")]
    with pytest.raises(ConfigError, match=r"^targets: '2:layers.0' selects no parameter"):
        select_parameters(model, parameters, ("2:layers.0",))
    # msprobe's prefixed target on a single model names chunk 0
    assert select_parameters(chunks[0], chunks[0].trainable_params(), ("0:layers.0.bias",)) == [(1, "layers.0.bias")]


def test_csv_vpp_stage_is_the_chunk(tmp_path):
    records = [TensorStatsRecord(1, None, 0, "grad_reduced", name, [2.0], ops=("norm",), shape=(2, 2), dtype="Float32")
               for name in ("1:layers.0.weight", "fc1")]
    columns = header(("norm",), micro_step=False)
    assert [format_row(r, columns, 6)[:3] for r in records] == [["1", "layers.0.weight", "0"], ["0", "fc1", "0"]]
    text = format_text(records, columns, 6)
    assert text.splitlines()[0].startswith("1,layers.0.weight,0,2.0,")
    path = tmp_path / "grad_reduced_0-0.csv"
    path.write_text(",".join(columns) + "\r\n" + text)
    assert [r.name for r in read_csv(str(path))] == ["1:layers.0.weight", "fc1"]


def test_bad_model_list_and_process_group(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"wg_distribution": True}))
    with pytest.raises(ConfigError) as error:
        TrainerMon(str(config), process_group=3)
    assert str(error.value) == ("process_group: got 3; allowed: the name of the pipeline-parallel communication "
                                "group (created with mindspore.communication.create_group), or None for one stage")
    monitor = TrainerMon(str(config), params_have_main_grad=False)
    with pytest.raises(ConfigError, match=r"^model: got an empty list; allowed: a model or the list of its"):
        monitor.set_monitor([], 1, nn.SGD(Chunk(0).trainable_params(), 0.1))


class LinearChunk(nn.Cell):
    def __init__(self, chunk, weight):
        super().__init__()
        self.layers = nn.CellList([Layer(weight.shape[0])])
        self.layers[0].weight.set_data(Tensor(weight.astype(np.float32)))
        for parameter in self.trainable_params():
            parameter.name = f"chunk{chunk}.{parameter.name}"

    def construct(self, x):
        return ops.matmul(x, self.layers[0].weight) + self.layers[0].bias


def test_trainer_mon_over_two_chunks_in_one_process(tmp_path, monkeypatch):
    """set_monitor([chunk0, chunk1]) in one process: grad_reduced rows under vpp_stage 0 and 1 with the
    chunks' own names, the norms of numpy's gradients of y = (x W0 + b0) W1 + b1, L = mean(y^2)."""
    import csv
    import glob

    import mindspore as ms

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"targets": {"layers.0.weight": {}}, "wg_distribution": True, "ops": ["norm"]}))
    rng = np.random.default_rng(0)
    w0, w1, x = rng.normal(size=(3, 3)), rng.normal(size=(3, 3)), rng.normal(size=(4, 3))
    chunks = [LinearChunk(0, w0), LinearChunk(1, w1)]
    optimizer = nn.SGD(chunks[0].trainable_params() + chunks[1].trainable_params(), 0.1)
    monitor = TrainerMon(str(config), params_have_main_grad=False)
    monitor.set_monitor(chunks, 1, optimizer)

    def loss(inputs):
        return (chunks[1](chunks[0](inputs)) ** 2).mean()

    _, grads = ms.value_and_grad(loss, None, optimizer.parameters)(Tensor(x.astype(np.float32)))
    optimizer(grads)
    monitor.close()
    h = x @ w0
    dy = 2 * (h @ w1) / (h @ w1).size
    want = {"0": np.linalg.norm(x.T @ (dy @ w1.T)), "1": np.linalg.norm(h.T @ dy)}
    (path,) = glob.glob(str(tmp_path / "out" / "*" / "grad_reduced_0-0.csv"))
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["vpp_stage"], r["name"]) for r in rows] == [("0", "layers.0.weight"), ("1", "layers.0.weight")]
    for row in rows:
        np.testing.assert_allclose(float(row["norm"]), want[row["vpp_stage"]], rtol=1e-5, atol=2e-6)
