"""mindmon's `speed` block in msprobe's config.json: a plain loop with msprobe's TrainerMon (K micro-batches of
token ids, the summed gradients to the optimizer) gets step time, throughput and memory records in the
JSONL, every step, beside the tensor statistics of the collected steps. Each step time is checked against
the test's own clock around the optimizer's call (where the step ends), the throughput against the tokens
the test fed divided by that step time, the peak memory against the process's own peak."""
import json
import time

import numpy as np
import pytest

import mindspore as ms
from mindspore import nn, value_and_grad

from mindmon.config import ConfigError
from mindmon.msprobe import TrainerMon

K, STEPS, BATCH, SEQ, VOCAB = 2, 4, 3, 5, 11


class TokenModel(nn.Cell):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 4)
        self.out = nn.Dense(4, 1)

    def construct(self, ids):
        return self.out(self.embedding(ids))


def resident_bytes() -> int:
    """The process's resident memory now (VmRSS), as the test reads it."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def run(tmp_path, monkeypatch, config):
    """The loop; returns (JSONL lines, [(optimizer called, optimizer returned, resident bytes then)] by the
    test's clock)."""
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    ms.set_seed(0)
    model = TokenModel()
    model.set_train(True)
    optimizer = nn.SGD(model.trainable_params(), learning_rate=0.1)
    monitor = TrainerMon(str(path), params_have_main_grad=False)
    monitor.set_monitor(model, grad_acc_steps=K, optimizer=optimizer)
    grad_fn = value_and_grad(lambda ids: (model(ids) ** 2).mean() / K, None, optimizer.parameters)
    rng = np.random.default_rng(3)
    clock = []
    for _ in range(STEPS):
        summed = None
        for _ in range(K):
            _, grads = grad_fn(ms.Tensor(rng.integers(0, VOCAB, (BATCH, SEQ)), ms.int32))
            summed = grads if summed is None else tuple(a + b for a, b in zip(summed, grads))
        called = time.perf_counter()
        optimizer(summed)
        clock.append((called, time.perf_counter(), resident_bytes()))
    monitor.close()
    lines = (tmp_path / "out" / "rank_0" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines], clock


def test_step_time_throughput_and_memory_from_the_speed_block(tmp_path, monkeypatch):
    rows, clock = run(tmp_path, monkeypatch, {"speed": {"enabled": True}, "wg_distribution": True,
                                              "start_step": 1, "collect_times": 1, "ops": ["norm"]})
    value = {(r["step"], r["kind"], r["name"]): r["value"] for r in rows if r["micro_step"] is None}
    assert {r["step"] for r in rows if r["kind"] == "step_time"} == set(range(1, STEPS + 1))
    for step in range(2, STEPS + 1):
        # The step runs from the previous step's end to its own, each inside an optimizer call by the clock:
        # no more than from the previous call to this return, no less than from the previous return to this
        # call.
        seconds = value[(step, "step_time", "step")]
        (called_before, returned_before, _), (called, returned, _) = clock[step - 2], clock[step - 1]
        assert called - returned_before <= seconds <= returned - called_before, (step, seconds)
    for step in range(1, STEPS + 1):
        seconds = value[(step, "step_time", "step")]
        assert value[(step, "throughput", "tokens_per_second")] == pytest.approx(K * BATCH * SEQ / seconds, rel=1e-12)
        assert value[(step, "throughput", "samples_per_second")] == pytest.approx(K * BATCH / seconds, rel=1e-12)
        micro = [r for r in rows if r["step"] == step and r["kind"] == "step_time" and r["name"] == "micro_batch"]
        assert sorted(r["micro_step"] for r in micro) == list(range(K))
    for step in range(2, STEPS + 1):
        # A step's peak is at least what was resident at a moment inside it: right after the previous
        # step's optimizer call returned (its records were written inside that call).
        (peak,) = [value[(step, "memory", n)] for n in ("peak_rss", "peak_rss_since_start")
                   if (step, "memory", n) in value]
        assert peak >= clock[step - 2][2], (step, peak, clock[step - 2][2])
    # The statistics keep their window: step 1 (0-based) only, beside every step's times.
    assert {r["step"] for r in rows if r["kind"] == "grad_reduced"} == {2}


def test_speed_alone_switches_the_monitor_on(tmp_path, monkeypatch):
    rows, _ = run(tmp_path, monkeypatch, {"speed": {"enabled": True}})
    assert {r["step"] for r in rows if (r["kind"], r["name"]) == ("step_time", "step")} == set(range(1, STEPS + 1))
    assert not [r for r in rows if r["kind"] in ("grad_reduced", "param_origin")]


@pytest.mark.parametrize("speed, message", [
    ({"enabled": "yes"}, "speed.enabled: got 'yes' (str); allowed: True or False"),
    ({"enable": True}, "speed.enable: unknown key 'enable' (did you mean 'enabled'?)"),
])
def test_a_bad_speed_key_is_one_line_before_training(tmp_path, speed, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"speed": speed}))
    with pytest.raises(ConfigError) as error:
        TrainerMon(str(path))
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_the_yaml_route_refuses_the_config_json_speed_block():
    from mindmon.msprobe import parse_tensor_stats

    with pytest.raises(ConfigError, match=r"^monitor\.tensor_stats\.speed: a block of TrainerMon's config\.json; "
                                          r"allowed here: monitor\.speed"):
        parse_tensor_stats({"speed": {"enabled": True}}, "monitor.tensor_stats")


def test_kj600_recipe_gets_every_step_once_the_optimizer_is_given(tmp_path, monkeypatch):
    """kj600's README order: hook_modules, then set_wrapped_optimizer; the speed block times every step from
    there, its throughput the tokens fed."""
    from mindmon.kj600.module_hook import TrainerMon as Kj600TrainerMon

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.setenv("KJ600_OUTPUT_DIR", str(tmp_path / "kj600"))
    path = tmp_path / "kj600.json"
    path.write_text(json.dumps({"speed": {"enabled": True}, "wg_distribution": True, "ops": ["norm"]}))
    ms.set_seed(0)
    model = TokenModel()
    model.set_train(True)
    optimizer = nn.SGD(model.trainable_params(), learning_rate=0.1)
    monitor = Kj600TrainerMon(str(path), params_have_main_grad=False)
    monitor.hook_modules(model, K)
    Kj600TrainerMon.set_wrapped_optimizer(optimizer)
    grad_fn = value_and_grad(lambda ids: (model(ids) ** 2).mean() / K, None, optimizer.parameters)
    rng = np.random.default_rng(4)
    for _ in range(STEPS):
        summed = None
        for _ in range(K):
            _, grads = grad_fn(ms.Tensor(rng.integers(0, VOCAB, (BATCH, SEQ)), ms.int32))
            summed = grads if summed is None else tuple(a + b for a, b in zip(summed, grads))
        optimizer(summed)
    monitor.close()
    rows = [json.loads(line) for line in (tmp_path / "out" / "rank_0" / "metrics.jsonl").read_text().splitlines()]
    value = {(r["step"], r["name"]): r["value"] for r in rows if r["kind"] in ("step_time", "throughput")
             and r["micro_step"] is None}
    assert sorted(step for step, name in value if name == "step") == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert value[(step, "tokens_per_second")] == pytest.approx(K * BATCH * SEQ / value[(step, "step")], rel=1e-12)


def test_kj600_without_an_optimizer_still_writes_its_statistics(tmp_path, monkeypatch):
    """The speed block waits for an optimizer that never comes; the gradient statistics of every step (a step
    being K forwards) are still written."""
    from mindmon.kj600.module_hook import TrainerMon as Kj600TrainerMon

    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    monkeypatch.setenv("KJ600_OUTPUT_DIR", str(tmp_path / "kj600"))
    path = tmp_path / "kj600.json"
    path.write_text(json.dumps({"speed": {"enabled": True}, "wg_distribution": True, "ops": ["norm"]}))
    ms.set_seed(0)
    model = TokenModel()
    model.set_train(True)
    monitor = Kj600TrainerMon(str(path), params_have_main_grad=False)
    monitor.hook_modules(model, K)
    grad_fn = value_and_grad(lambda ids: (model(ids) ** 2).mean() / K, None, model.trainable_params())
    rng = np.random.default_rng(5)
    for _ in range(STEPS * K):
        grad_fn(ms.Tensor(rng.integers(0, VOCAB, (BATCH, SEQ)), ms.int32))
    monitor.close()
    rows = [json.loads(line) for line in (tmp_path / "out" / "rank_0" / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rows if r["kind"] == "grad_unreduced"} == set(range(1, STEPS + 1))
    assert not [r for r in rows if r["kind"] == "step_time"]
