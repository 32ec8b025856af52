"""mindmon on MindFormers 2.0.0's own PyNative Trainer (`make test-ms210`: MindSpore 2.10, MindFormers 2.0.0,
the single-device hyper_parallel stand-in of tests/support). The Trainer, its config handling, its callbacks
and its training loop are MindFormers' own; mindmon's step replaces its `training_step` as on 1.9.0.

The 1.9.0 route's value checks run here unchanged (imported below): norms, losses, tokens per expert and max
logits against numpy and against forward hooks on the same run. The rest of the file shows each row of
docs/mindformers.md's table of what stock 2.0.0 gets wrong: stock's numbers come from a stock run in another
process (MINDMON_AUTOLOAD=0, tests/support/mindformers2_stock_run.py) on the same model, data and config.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.demo_trainer import mindformers_log, make_data, make_model, trainer_config
from tests.support.jsonl import read_jsonl
from tests.features.max_logits.test_max_logits import _capture_reference, test_values_equal_numpy_every_step  # noqa: F401
from tests.features.moe_tokens.test_moe_tokens import test_every_micro_step_equals_router_count  # noqa: F401
from tests.features.train_state.test_train_state import (K, _reference_step1, run, test_batch_sizes_that_do_not_divide_are_rejected,  # noqa: F401
                              test_every_step_is_complete_and_consistent, test_filter_matching_nothing_fails_before_training,
                              test_filters_select_exactly, test_only_device_norm_still_collects,
                              test_step1_matches_numpy, test_yaml_error_stops_the_trainer_before_step_1)
from tests.support import HERE

pytestmark = pytest.mark.mindformers2

SUPPORT = Path(HERE)
ALL_TRAIN_STATE = {"local_norm": True, "local_loss": True, "device_norm": True, "device_loss": True}


def test_mindformers_2_0_0_is_what_runs():
    import hyper_parallel
    import mindformers

    assert mindformers.__version__ == "2.0.0"
    assert hyper_parallel.IS_STANDIN   # the single-device stand-in, never a real hyper_parallel


def test_attached_once_with_mindmons_group_as_the_trainers_monitor(run):
    from mindformers.pynative.tools.monitor import MonitorGroup as StockMonitorGroup
    from mindformers.pynative.trainer import Trainer

    from mindmon.core.group import MonitorGroup
    from mindmon.integrations.mindformers_versions import STEP_ADAPTERS

    _, _, trainer = run
    assert isinstance(trainer.monitor.group, MonitorGroup) and trainer.monitor.group is trainer._mindmon.group
    assert not isinstance(trainer.monitor, StockMonitorGroup)
    assert Trainer.training_step is STEP_ADAPTERS["2.0."]
    line = ("mindmon: attached to the MindFormers 2.0.0 PyNative Trainer (monitor/profiler/callbacks sections, K "
            "micro-steps per step; mindmon's MonitorGroup in place of MindFormers' own)")
    assert mindformers_log().count(line) == 1


@pytest.mark.parametrize("train_state, wanted", [
    ({"device_norm": True}, {"device_norm": True, "device_loss": False, "local_loss": False}),
    ({"local_loss": True}, {"device_norm": False, "device_loss": False, "local_loss": True, "local_norm": False}),
    ({"device_loss": True, "local_norm": ["layernorm"]},
     {"device_norm": False, "device_loss": True, "local_loss": False, "local_norm": True}),
])
def test_should_record_answers_per_key(tmp_path, train_state, wanted):
    from mindformers.pynative.trainer import Trainer

    config = trainer_config(tmp_path, steps=1, monitor={"train_state": train_state})
    trainer = Trainer(config=config, model=make_model(), train_dataset=make_data(config))
    assert {key: trainer.monitor.should_record(key) for key in wanted} == wanted
    assert trainer.monitor.group.should_record("device_loss") is wanted["device_loss"]


# --- stock 2.0.0 beside mindmon on the same config, model and data ------------------------------------------

def _stock_config(config):
    """The same run for the stock Trainer: its own keys only (it refuses mindmon's output_dir)."""
    stock = json.loads(json.dumps(config))
    stock["monitor"] = {key: value for key, value in config["monitor"].items() if key != "output_dir"}
    return stock


def _stock_run(tmp_path, config, *options):
    env = {k: v for k, v in os.environ.items() if k not in ("LOG_MF_PATH",)}
    env.update(MINDMON_AUTOLOAD="0", LOG_MF_PATH=str(tmp_path / "stock_log"))
    result = subprocess.run([sys.executable, str(SUPPORT / "mindformers2_stock_run.py"), json.dumps(_stock_config(config)), *options],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert result.returncode == 0 and "stock run done" in result.stdout, result.stderr[-3000:]
    return (tmp_path / "stock_log" / "rank_0" / "info.log").read_text()


def _loss_lines(log):
    """LossCallback's (step, loss, grad_norm), MindFormers' own line in either run."""
    return [(int(m.group(1)), float(m.group(2)), float(m.group(3))) for m in
            re.finditer(r"step:\[\s*(\d+)/\s*\d+\], loss:\s*([\d.]+),.*?grad_norm:\s*([\d.]+)", log)]


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory):
    """Two steps, clipping out of reach in both (stock's in-place clip does not act on CPU, see below)."""
    out = tmp_path_factory.mktemp("side_by_side")
    config = trainer_config(out, steps=2, monitor={"train_state": ALL_TRAIN_STATE,
                                                   "moe_monitor": {"save_tokens_per_expert_interval": 1}},
                            callbacks=[{"type": "MaxLogitsMonitor", "step_interval": 1}])
    config["training"]["max_norm"] = 1e6
    stock_log = _stock_run(out, config, "--mindmon-max-logits")
    log_before = len(mindformers_log())
    from mindformers.pynative.trainer import Trainer

    Trainer(config=json.loads(json.dumps(config)), model=make_model(), train_dataset=make_data(config)).train()
    return config, stock_log, mindformers_log()[log_before:], read_jsonl(out / "rank_0" / "metrics.jsonl")


def test_same_losses_and_grad_norms_as_stock(side_by_side):
    _, stock_log, mindmon_log, _ = side_by_side
    stock, mindmon = _loss_lines(stock_log), _loss_lines(mindmon_log)
    assert [s for s, _, _ in stock] == [1, 2] and len(mindmon) == 2
    for (step, loss, norm), (_, our_loss, our_norm) in zip(stock, mindmon):
        assert our_loss == pytest.approx(loss, abs=2e-6) and our_norm == pytest.approx(norm, abs=2e-6), step


def test_stock_device_norm_is_the_last_micro_batch_and_mindmons_the_accumulated_gradient(side_by_side):
    config, stock_log, _, records = side_by_side
    losses, grads, names = _reference_step1(config)
    stock = _stock_norms(stock_log, "device_norm", step=1)
    ours = {r["name"]: r["value"] for r in records if r["kind"] == "device_norm" and r["step"] == 1}
    wrong = 0
    for name in names:
        last = np.linalg.norm(grads[K - 1][name])
        accumulated = np.linalg.norm(sum(grads[k][name] for k in range(K)))
        assert stock[name] == pytest.approx(last, rel=1e-4, abs=2e-6)
        assert ours[name] == pytest.approx(accumulated, rel=1e-4, abs=1e-7)
        wrong += abs(last - accumulated) > 1e-4 * accumulated + 2e-6
    assert wrong > len(names) // 2   # the two differ on most parameters, so the check can tell them apart


def test_stock_local_loss_is_divided_by_k_and_counted_from_1(side_by_side):
    config, stock_log, _, records = side_by_side
    losses, _, _ = _reference_step1(config)
    stock = [json.loads(line[line.index("{"):]) for line in stock_log.splitlines()
             if '"local_loss"' in line and '"step": 1,' in line]
    assert [(row["micro_step"], row["local_loss"]) for row in stock] == \
        [(k + 1, pytest.approx(losses[k] / K, rel=1e-5)) for k in range(K)]
    ours = sorted((r["micro_step"], r["value"]) for r in records if r["kind"] == "local_loss" and r["step"] == 1)
    assert ours == [(k, pytest.approx(losses[k], rel=1e-5)) for k in range(K)]


def test_stock_norm_lines_are_not_json_and_mindmons_records_are(side_by_side):
    _, stock_log, _, records = side_by_side
    lines = [line[line.index('{ "local_norm"'):] for line in stock_log.splitlines() if '{ "local_norm"' in line]
    assert lines
    for line in lines:
        with pytest.raises(json.JSONDecodeError):
            json.loads(line)
    params = len(make_model().trainable_params())
    assert len([r for r in records if r["kind"] == "local_norm"]) == 2 * K * params


def test_stock_moe_monitor_prints_nothing_and_mindmons_prints_every_micro_step(side_by_side):
    _, stock_log, mindmon_log, _ = side_by_side
    assert '{"iter"' not in stock_log
    lines = [json.loads(line[line.index('{"iter"'):]) for line in mindmon_log.splitlines() if '{"iter"' in line]
    assert sorted((l["iter"], l["block"]) for l in lines) == sorted((i, b) for i in range(2 * K) for b in ("decoder", "mtp"))


def _max_logits_step1(config):
    """numpy's per-head max of QK^T/sqrt(d) over step 1's micro-batches, from forward hooks on a fresh copy."""
    from mindspore import Tensor

    model, counter = make_model(), type("Step", (), {"step": 1})()
    reference = _capture_reference(model, counter)
    batch = next(make_data(config).create_dict_iterator(output_numpy=True))
    local = config["training"]["local_batch_size"]
    for k in range(K):
        rows = slice(k * local, (k + 1) * local)
        model(Tensor(batch["input_ids"][rows]), Tensor(batch["labels"][rows]))
    return {name: heads for (_, name), heads in reference.items()}


def _logged_heads(log, source, step):
    pattern = re.compile(re.escape(source) + r".*step:\[\s*" + str(step) + r"/\s*\d+\] max_attention_logit/(\S+): \[(.*)\]")
    return {m.group(1): [float(v) for v in m.group(2).split(", ")] for m in map(pattern.search, log.splitlines()) if m}


def test_stock_max_logits_of_a_passed_in_model_are_minus_inf_and_mindmons_callback_alone_reads_them(side_by_side):
    config, stock_log, mindmon_log, records = side_by_side
    reference = _max_logits_step1(config)
    stock = _logged_heads(stock_log, "callback/max_logits_monitor.py", step=1)
    assert set(stock) == set(reference) and all(v == [-np.inf] * 2 for v in stock.values())
    # mindmon's callback in the same stock process (no mindmon run), in MindFormers' log
    alone = _logged_heads(stock_log, "features/max_logits/callback.py", step=1)
    assert set(alone) == set(reference)
    for name, heads in alone.items():
        np.testing.assert_allclose(heads, reference[name], rtol=5e-4)
    ours = {r["name"]: r["value"] for r in records if r["kind"] == "max_attention_logit" and r["step"] == 1}
    for name, heads in ours.items():
        np.testing.assert_allclose(heads, reference[name], rtol=1e-5, atol=1e-6)
    assert "max_attention_logit/max: -inf" not in mindmon_log


def test_stock_clipping_leaves_the_gradients_as_they_were_on_cpu():
    """MindFormers' clip (`grad.mul_(scale)`, in place) on a gradient of norm 5 clipped to 1: on MindSpore
    2.10's CPU the gradient is left as it was. mindmon's clip (test_train_state_values.py) returns new tensors."""
    import mindspore as ms
    from mindspore import Parameter, Tensor
    from mindformers.pynative.trainer.utils import _calculate_global_grad_norm

    parameter = Parameter(Tensor(np.zeros(2, np.float32)), name="w")
    parameter.grad = Tensor(np.array([3.0, 4.0], np.float32))
    norm, grads = _calculate_global_grad_norm([parameter], max_norm=1.0)
    assert float(norm.asnumpy()) == pytest.approx(5.0)
    np.testing.assert_allclose(grads[0].asnumpy(), [3.0, 4.0])   # should have been [0.6, 0.8]
    assert grads[0].dtype == ms.float32


def _stock_norms(log, kind, step):
    """Stock's `{ "<kind>": name:   value }` lines of one step (the block after its `{ "step": N` header)."""
    values, current = {}, None
    for line in log.splitlines():
        header = re.search(r'\{ "step": (\d+)', line)
        if header:
            current = int(header.group(1))
        found = re.search(r'\{ "' + kind + r'": (\S+):\s+([-\d.]+) \}', line)
        if found and current == step:
            values[found.group(1)] = float(found.group(2))
    return values


# --- the demo ----------------------------------------------------------------------------------------------

def test_demo_runs_on_mindformers_2(tmp_path):
    env = dict(os.environ, LOG_MF_PATH=str(tmp_path / "log"),
               PYTHONPATH=os.pathsep.join([str(SUPPORT / "hyper_parallel_standin"),
                                           os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "mindmon.cli", "demo", "--steps", "2", "--output",
                             str(tmp_path / "out")], capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    log = (tmp_path / "log" / "rank_0" / "info.log").read_text()
    assert "mindmon: attached to the MindFormers 2.0.0 PyNative Trainer" in log
    records = read_jsonl(next((tmp_path / "out").rglob("metrics.jsonl")))
    assert {r["step"] for r in records if r["kind"] == "device_loss"} == {1, 2}
