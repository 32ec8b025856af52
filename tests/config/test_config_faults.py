"""Values that used to pass validation and go wrong later, each checked where it would have failed:
a data-parallel group that does not exist (two real msrun workers), `training.max_norm` (clipping
against numpy), target_layers far beyond the model, rank selections, the TensorBoard queue bound,
a large YAML through the C loader."""
import logging
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml
from mindspore import Tensor, nn

from tests.support.demo_trainer import SMALL_MODEL, make_model, trainer_config
from mindmon import AccumulatingTrainStep, split_batch
from mindmon.config import MAX_TENSORBOARD_QUEUE, ConfigError
from mindmon.features.moe_tokens.config import MoEMonitorConfig
from mindmon.features import parse_sections, rank_selection_warnings
from mindmon.features.moe_tokens.monitor import select_layers
from mindmon.config import load_yaml
from tests.loop.test_plain_loop import Regression, _data



def test_unknown_data_parallel_group_stops_both_workers(tmp_path):
    """Under msrun with communication initialised, a group name MindSpore does not know is a
    ConfigError on every rank before step 1 (it used to fall back to a world of one and stop
    averaging the gradients)."""
    overlay = {"model": SMALL_MODEL, "training": {"global_batch_size": 8, "local_batch_size": 2},
               "monitor": {"data_parallel_group": "no_such_group", "train_state": {"device_loss": True}}}
    (tmp_path / "dp.yaml").write_text(yaml.safe_dump(overlay))
    env = {k: v for k, v in os.environ.items() if k != "LOG_MF_PATH"}
    result = subprocess.run([sys.executable, "-m", "mindmon.cli", "demo", "--workers", "2", "--steps", "1",
                             "--output", str(tmp_path / "out"), "--config", str(tmp_path / "dp.yaml")],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert result.returncode != 0
    expected = (f"mindmon: {tmp_path / 'dp.yaml'}: monitor.data_parallel_group: got 'no_such_group', "
                f"a communication group that does not exist (or does not hold this rank); allowed: None "
                f"(the world, 'mccl_world_group') or the name of a group created with "
                f"mindspore.communication.create_group before the Trainer is built")
    said = 0
    for rank in (0, 1):
        log = (tmp_path / "out" / "msrun" / f"worker_{rank}.log").read_text()
        assert "Traceback" not in log
        lines = [line for line in log.splitlines() if line.startswith("mindmon: ")]
        # Each rank finds the error; msrun ends the job when the first rank exits, so the other rank
        # may be stopped before it prints its line.
        assert lines in ([expected], []), log[-2000:]
        said += len(lines)
    assert said >= 1
    assert not (tmp_path / "out" / "monitor" / "rank_0" / "metrics.jsonl").exists()  # stopped before step 1


def test_a_group_name_without_communication_is_one_process():
    from mindmon.parallel.data_parallel import DataParallel

    assert (DataParallel("dp_group").size, DataParallel("dp_group").rank) == (1, 0)


def _one_clipped_step(rng, max_norm):
    """SGD with lr 1 after one step of two micro-batches: returns (parameter change, grad norm, numpy
    gradient of the mean squared error in float64)."""
    net = Regression()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=1.0)
    x, y = _data(rng)
    before = np.concatenate([net.weight.asnumpy().ravel(), net.bias.asnumpy().ravel()]).astype(np.float64)
    _, grad_norm = AccumulatingTrainStep(net, optimizer, num_micro_steps=2, max_norm=max_norm)(
        split_batch((Tensor(x), Tensor(y)), 2))
    after = np.concatenate([net.weight.asnumpy().ravel(), net.bias.asnumpy().ravel()]).astype(np.float64)
    diff = x.astype(np.float64) @ np.full((3, 1), 0.5) - y.astype(np.float64)
    gradient = np.concatenate([(2 * x.astype(np.float64).T @ diff / len(x)).ravel(), [2 * diff.mean()]])
    return before - after, grad_norm, gradient


@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_max_norm_clips_below_the_gradient_norm_and_not_above(factor):
    norm = np.linalg.norm(_one_clipped_step(np.random.default_rng(5), 0)[2])  # numpy's, from the same data
    moved, grad_norm, gradient = _one_clipped_step(np.random.default_rng(5), norm * factor)
    assert grad_norm == pytest.approx(norm, rel=1e-5)
    expected = gradient * min(1.0, factor)  # scaled to max_norm when below the norm, untouched above
    np.testing.assert_allclose(moved, expected, rtol=1e-4)


def test_max_norm_zero_turns_clipping_off(rng):
    moved, _, gradient = _one_clipped_step(rng, 0)
    np.testing.assert_allclose(moved, gradient, rtol=1e-4)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0, "1.0", True, None])
def test_max_norm_refused_by_the_train_step(value):
    with pytest.raises(ConfigError, match=r"^max_norm: got .*; allowed: a finite number > 0"):
        AccumulatingTrainStep(Regression(), nn.SGD(Regression().trainable_params()), 2, max_norm=value)


def test_max_norm_nan_stops_the_trainer_before_step_1(tmp_path):
    from mindformers.pynative.trainer import Trainer

    config = trainer_config(tmp_path, monitor={"train_state": {"device_loss": True}})
    config["training"]["max_norm"] = float("nan")
    with pytest.raises(ConfigError, match=r"^training\.max_norm: got nan \(float\)"):
        Trainer(config=config, model=make_model())


@pytest.mark.parametrize("target", [1_000_000, 10 ** 12, tuple(range(5, 200_000))])
def test_target_layers_far_beyond_the_model_is_a_short_error(target):
    """A target of 10**12 layers is answered from the model's layer count (enumerating it would never end)."""
    with pytest.raises(ConfigError) as caught:
        select_layers(make_model(), MoEMonitorConfig(1, target), logging.getLogger("test"))
    message = str(caught.value)
    assert len(message) < 400, message
    assert "decoder layer(s)" in message and "allowed: ids 0..1 (the model has 2 decoder layers)" in message
    if isinstance(target, int):
        assert f"got {target}; decoder layer(s) 2..{target - 1} do not exist" in message
    else:
        assert "(199995 items)" in message and "[5, 6, 7, 8, 9, 10, 11, 12, 13, 14] do not exist" in message


def test_rank_selections_that_miss_the_run_are_warned():
    config = parse_sections({"monitor": {"ranks": [2, 3]}, "profiler": {"enable_profiling": True,
                                                                         "profiler_rank": [0, 5]}})
    assert rank_selection_warnings(config, 2) == [
        "monitor.ranks: [2, 3] selects none of this run's ranks 0..1; nothing is collected",
        "profiler.profiler_rank: rank(s) [5] do not exist in this run of 2 rank(s)"]
    assert rank_selection_warnings(config, 6) == []
    assert rank_selection_warnings(parse_sections({"profiler": {"profiler_rank": [9]}}), 1) == []  # profiler off


def test_largest_tensorboard_queue_works_in_tensorboardx(tmp_path):
    """The bound is below what overflows tensorboardX (2**31 - 1), and the writer really opens with it."""
    from mindmon.core.engine import RunInfo
    from mindmon.core.records import Record
    from mindmon.sinks.tensorboard import TensorBoardSink

    sink = TensorBoardSink(str(tmp_path), queue_size=MAX_TENSORBOARD_QUEUE)
    sink.open(RunInfo(0))
    sink.write([Record(1, None, 0, "device_loss", "loss", 2.5)])
    sink.close()
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "rank_0"))


def test_a_large_yaml_goes_through_the_c_parser(tmp_path, monkeypatch):
    """About 4 MB of plain training config (a long list of data files, say) read whole, by libyaml's C parser
    (the pure-Python one takes minutes on such a file): which parser read it is checked, not its time."""
    files = [f"/data/shard_{i:07d}.mindrecord" for i in range(120_000)]
    (tmp_path / "big.yaml").write_text(yaml.safe_dump({"monitor": {"train_state": {"local_loss": True}},
                                                        "train_dataset": {"files": files}}))
    assert (tmp_path / "big.yaml").stat().st_size > 3_000_000
    python_parser_nodes = []
    real_parse_node = yaml.parser.Parser.parse_node
    monkeypatch.setattr(yaml.parser.Parser, "parse_node", lambda self, *args, **kwargs: python_parser_nodes.append(1)
                        or real_parse_node(self, *args, **kwargs))
    raw = load_yaml(str(tmp_path / "big.yaml"))
    assert yaml.__with_libyaml__ and python_parser_nodes == []   # not one node through the pure-Python parser
    assert raw["train_dataset"]["files"][-1] == files[-1] and len(raw["train_dataset"]["files"]) == 120_000


def test_unknown_callback_type_names_the_closest_registered_ones(tmp_path, capsys):
    from mindmon.cli import main

    path = tmp_path / "callbacks.yaml"
    path.write_text("callbacks:\n  - type: MaxLogitMonitor\n  - type: NoSuchMonitor\n")
    assert main(["check-config", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mindmon: {path}: callbacks[0].type: got 'MaxLogitMonitor', which no MindFormers callback is "
                   f"registered as; allowed: a registered callback type, e.g. MaxLogitsMonitor, MFLossMonitor, "
                   f"LossMonitor"]
    path.write_text("callbacks:\n  - type: TimeMonitor\n  - type: MaxLogitsMonitor\n")
    assert main(["check-config", str(path)]) == 0


def test_a_dataset_batched_by_the_local_batch_size_is_refused_before_training(tmp_path):
    """The Trainer's steps take global_batch_size / dp samples and mindmon cuts them into K micro-batches:
    a launch script that batches by local_batch_size would silently train on half-size micro-batches."""
    from mindformers.pynative.trainer import Trainer

    from mindmon.demo.data import make_dataset

    config = trainer_config(tmp_path, monitor={"train_state": {"device_loss": True}}, local_batch_size=2,
                            global_batch_size=4)
    dataset = make_dataset(8, SMALL_MODEL["seq_length"], SMALL_MODEL["vocab_size"], 2)
    with pytest.raises(ConfigError, match=r"^train_dataset: yields batches of 2 samples; allowed: global_batch_size "
                                          r"/ data_parallel = 4 samples per step"):
        Trainer(config=config, model=make_model(), train_dataset=dataset)
