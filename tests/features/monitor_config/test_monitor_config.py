"""MindFormers' graph-mode `monitor_config` on the PyNative Trainer: the section is validated like
mindmon's own, every metric of configs/monitor_config.yaml is checked against an independent numpy
computation, the stable rank against numpy's SVD, and the spike / NaN / print_struct checks skip
updates and stop the run as documented."""
import copy
import logging
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from mindspore import Parameter, Tensor, nn, value_and_grad

from tests.support.demo_trainer import make_data, make_model, train, trainer_config
from tests.support.jsonl import read_jsonl

ROOT = Path(__file__).resolve().parents[3]
K, LBS = 4, 2


def _parse(raw):
    from mindmon.features import parse_sections

    return parse_sections(raw)


# ---------------------------------------------------------------- configuration

def test_defaults_are_mindformers_defaults():
    """Compared with MindFormers' own template classes (the installed package), not with our code's constants."""
    from mindformers.tools.register.template import MonitorConfig as Template, StableRankConfig as SRTemplate

    section = _parse({"monitor_config": {}}).monitor_config
    for key in ("monitor_on", "dump_path", "invert", "step_interval", "print_struct", "check_for_global_norm",
                "global_norm_spike_threshold", "global_norm_spike_count_threshold", "throughput_baseline",
                "health_checkpoint"):
        assert getattr(section, key) == getattr(Template, key), key
    assert section.target == (".*",) and Template.target is None      # None = every parameter
    assert all(not section.formats[k] for k in section.formats)
    sr = section.stable_rank
    assert (sr.step_interval, sr.do_aggregation, sr.moe_show_mode, sr.power_iteration_num) == (
        SRTemplate.step_interval, SRTemplate.do_aggregation, SRTemplate.moe_show_mode, SRTemplate.power_iteration_num)
    assert not section.active


def test_stock_trainer_1_9_keeps_and_ignores_the_section():
    """Why mindmon reads it: MindFormers 1.9.0's PyNative TrainConfig accepts these keys and does nothing with them."""
    from mindformers.pynative.config.config import TrainConfig

    raw = trainer_config("/tmp/unused", monitor_config={"monitor_on": True, "local_norm_format": "log"},
                         check_for_nan_in_loss_and_grad=True, tensorboard={"tensorboard_dir": "x"})
    stock = TrainConfig.from_dict(copy.deepcopy(raw))
    assert stock.monitor_config.monitor_on is True and stock.check_for_nan_in_loss_and_grad is True


def test_mapping_onto_the_engine():
    config = _parse({"monitor_config": {"monitor_on": True, "target": ["layers\\.0"], "invert": True,
                                        "local_norm_format": "log", "local_loss_format": ["tensorboard"],
                                        "device_local_loss_format": "log", "max_attention_logit_format": "log",
                                        "step_interval": 3}})
    state = config.monitor.train_state
    assert state.local_loss and state.device_loss and not state.device_norm.enabled
    assert state.local_norm.matches("decoder.layers.1.mlp.weight") and not state.local_norm.matches("decoder.layers.0.x")
    # no TensorBoard configured: MindFormers falls back to the log
    assert config.monitor_config.format("local_loss") == {"log"}
    assert config.monitor_config.tensorboard_fallback == ("local_loss_format",)
    assert {"type": "MaxLogitsMonitor", "step_interval": 3} in config.callbacks
    off = _parse({"monitor_config": {"local_norm_format": "log"}})   # monitor_on False: nothing
    assert not off.monitor.train_state.active and not off.callbacks


BAD = [
    ({"monitor_on": "yes"}, "monitor_config.monitor_on"),
    ({"dump_path": ""}, "monitor_config.dump_path"),
    ({"dump_path": 3}, "monitor_config.dump_path"),
    ({"target": "layers"}, "monitor_config.target"),
    ({"target": ["layers[("]}, "monitor_config.target"),
    ({"invert": 1}, "monitor_config.invert"),
    ({"step_interval": 0}, "monitor_config.step_interval"),
    ({"step_interval": 1.5}, "monitor_config.step_interval"),
    *[({f"{k}_format": bad}, f"monitor_config.{k}_format")
      for k in ("local_loss", "local_norm", "device_local_norm", "device_local_loss", "optimizer_state",
                "weight_state", "max_attention_logit") for bad in ("csv", ["log", 3])],
    ({"throughput_baseline": 0}, "monitor_config.throughput_baseline"),
    ({"throughput_baseline": "fast"}, "monitor_config.throughput_baseline"),
    ({"throughput_baseline": float("nan")}, "monitor_config.throughput_baseline"),
    ({"print_struct": "no"}, "monitor_config.print_struct"),
    ({"check_for_global_norm": 1}, "monitor_config.check_for_global_norm"),
    ({"global_norm_spike_threshold": -1}, "monitor_config.global_norm_spike_threshold"),
    ({"global_norm_spike_threshold": True}, "monitor_config.global_norm_spike_threshold"),
    ({"global_norm_spike_count_threshold": 0}, "monitor_config.global_norm_spike_count_threshold"),
    ({"stable_rank_config": 5}, "monitor_config.stable_rank_config"),
    ({"stable_rank_config": {"format": "png"}}, "monitor_config.stable_rank_config.format"),
    ({"stable_rank_config": {"step_interval": -2}}, "monitor_config.stable_rank_config.step_interval"),
    ({"stable_rank_config": {"target": [""]}}, "monitor_config.stable_rank_config.target"),
    ({"stable_rank_config": {"do_aggregation": "x"}}, "monitor_config.stable_rank_config.do_aggregation"),
    ({"stable_rank_config": {"moe_show_mode": "some"}}, "monitor_config.stable_rank_config.moe_show_mode"),
    ({"stable_rank_config": {"power_iteration_num": 0}}, "monitor_config.stable_rank_config.power_iteration_num"),
    ({"stable_rank_config": {"colour": 1}}, "monitor_config.stable_rank_config.colour"),
    ({"health_checkpoint": 3}, "monitor_config.health_checkpoint"),
    ({"health_checkpoint": {"global_norm_spike_threshold": -3}},
     "monitor_config.health_checkpoint.global_norm_spike_threshold"),
    ({"unknown_key": 1}, "monitor_config.unknown_key"),
]


@pytest.mark.parametrize("section,path", BAD, ids=[f"{p}={list(s.values())[0]!r}" for s, p in BAD])
def test_bad_value_names_the_key(section, path):
    from mindmon.config import ConfigError

    with pytest.raises(ConfigError) as error:
        _parse({"monitor_config": section})
    message = str(error.value)
    assert message.startswith(path + ":") and "allowed" in message and "\n" not in message


def test_bad_top_level_nan_switch_and_section_type():
    from mindmon.config import ConfigError

    with pytest.raises(ConfigError, match=r"^check_for_nan_in_loss_and_grad: got 'yes' \(str\); allowed: True or False$"):
        _parse({"check_for_nan_in_loss_and_grad": "yes"})
    with pytest.raises(ConfigError, match=r"^monitor_config: got \[1\] \(list\); allowed: a mapping"):
        _parse({"monitor_config": [1]})


def test_mix_with_monitor_train_state_is_refused():
    from mindmon.config import ConfigError

    with pytest.raises(ConfigError, match=r"^monitor_config\.local_norm_format: got \['log'\] while monitor\.train_state "
                                          r"is also set .*allowed: one of the two"):
        _parse({"monitor": {"train_state": {"local_loss": True}},
                "monitor_config": {"monitor_on": True, "local_norm_format": "log"}})
    # metrics train_state does not compute combine freely with it
    config = _parse({"monitor": {"train_state": {"local_loss": True}},
                     "monitor_config": {"monitor_on": True, "weight_state_format": "log"}})
    assert config.monitor.train_state.local_loss and config.monitor_config.format("weight_state") == {"log"}


def test_check_config_command(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("monitor_config:\n  stable_rank_config:\n    power_iteration_num: -1\n")
    result = subprocess.run([sys.executable, "-m", "mindmon", "check-config", str(bad)], capture_output=True,
                            text=True, cwd=ROOT)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"mindmon: {bad}: monitor_config.stable_rank_config.power_iteration_num: got -1 (int); allowed: a positive int"]
    good = subprocess.run([sys.executable, "-m", "mindmon", "check-config", str(ROOT / "configs" / "monitor_config.yaml")],
                          capture_output=True, text=True, cwd=ROOT)
    assert good.returncode == 0, good.stderr
    assert yaml.safe_load(good.stdout)["monitor_config"]["stable_rank_config"]["power_iteration_num"] == 50


# ---------------------------------------------------------------- stable rank

def test_power_iteration_converges_on_a_known_spectrum():
    """stable_rank_config's power_iteration_num rounds of the shared power iteration (tolerance 0: a
    fixed count, as MindFormers counts them)."""
    from mindmon.features.l2.monitor import power_iteration

    rng = np.random.default_rng(0)
    singular = np.array([10.0, 5.0, 2.0, 1.0, 0.5])
    u, _ = np.linalg.qr(rng.standard_normal((8, 5)))
    v, _ = np.linalg.qr(rng.standard_normal((5, 5)))
    weight = (u @ np.diag(singular) @ v.T).astype(np.float32)
    start = rng.standard_normal(5).astype(np.float32)
    sigma, vector, used = power_iteration(weight, start, tolerance=0.0, max_iterations=40)
    assert used <= 40 and sigma ** 2 == pytest.approx(100.0, rel=1e-6)   # stops early only when exactly converged
    assert abs(vector @ v[:, 0]) == pytest.approx(1.0, rel=1e-6)                  # the top right singular vector
    few, _, _ = power_iteration(weight, start, tolerance=0.0, max_iterations=2)
    assert few ** 2 < 100.0                                                        # |Wv| <= sigma_max: from below


class _Weights(nn.Cell):
    def __init__(self, rng):
        super().__init__()
        self.dense = Parameter(Tensor(rng.standard_normal((12, 6)).astype(np.float32)), name="dense.weight")
        self.experts = Parameter(Tensor(rng.standard_normal((3, 5, 4)).astype(np.float32)), name="experts.weight")
        self.bias = Parameter(Tensor(np.ones(6, np.float32)), name="dense.bias")


def test_stable_rank_agrees_with_svd_and_warm_starts():
    from mindmon.features.monitor_config.config import StableRankSection
    from mindmon.features.monitor_config.monitors import StableRankMonitor

    model = _Weights(np.random.default_rng(1))
    monitor = StableRankMonitor(model, StableRankSection(formats=frozenset({"log"}), step_interval=2,
                                                         power_iteration_num=5))
    assert monitor.collect(1) == []                                          # every step_interval steps
    collected = [{(r.kind, r.name): r.value for r in monitor.collect(step)} for step in range(2, 42, 2)]
    last = collected[-1]
    dense = model.dense.asnumpy().astype(np.float64)
    sigma = np.linalg.svd(dense, compute_uv=False)
    assert last[("weight_eigenvalue", "dense.weight")] == pytest.approx(sigma[0] ** 2, rel=1e-6)
    assert last[("weight_stable_rank", "dense.weight")] == pytest.approx((sigma ** 2).sum() / sigma[0] ** 2, rel=1e-6)
    experts = model.experts.asnumpy().astype(np.float64)
    sigmas = [np.linalg.svd(m, compute_uv=False) for m in experts]
    ranks = [(s ** 2).sum() / s[0] ** 2 for s in sigmas]
    for e, s in enumerate(sigmas):
        assert last[("weight_eigenvalue", f"experts.weight/expert_{e}")] == pytest.approx(s[0] ** 2, rel=1e-6)
        assert last[("weight_stable_rank", f"experts.weight/expert_{e}")] == pytest.approx(ranks[e], rel=1e-6)
    assert last[("weight_stable_rank", "experts.weight/expert_max")] == pytest.approx(max(ranks), rel=1e-6)
    assert last[("weight_stable_rank", "experts.weight/expert_mean")] == pytest.approx(np.mean(ranks), rel=1e-6)
    assert not any("bias" in name for _, name in last)                      # 1-D: no stable rank
    # the warm start carries the iteration on: 5 iterations per call, 100 in all; 5 from a cold start fall short
    first = collected[0][("weight_eigenvalue", "dense.weight")]
    assert sigma[0] ** 2 - first > 1e3 * (sigma[0] ** 2 - last[("weight_eigenvalue", "dense.weight")])


# ---------------------------------------------------------------- log format

def test_log_lines_round_trip_and_parse_log(tmp_path):
    from mindmon.analysis.parse_log import LogParser
    from mindmon.formats.training_state_log import LineReader
    from mindmon.core.records import Record
    from mindmon.features.monitor_config.sink import TrainingStateLogSink
    from mindmon.core.engine import RunInfo

    section = _parse({"monitor_config": {"monitor_on": True, "local_norm_format": "log", "local_loss_format": "log",
                                         "weight_state_format": ["log"], "device_local_norm_format": "log"}}
                     ).monitor_config
    lines = []
    logger = logging.getLogger("test_monitor_config_lines")
    # A step's lines reach the logger as one block (one call per step): collect them line by line.
    logger.addHandler(type("H", (logging.Handler,), {"emit": lambda self, r: lines.extend(r.getMessage().split("\n"))})())
    logger.setLevel(logging.INFO)
    sink = TrainingStateLogSink(logger, section)
    sink.open(RunInfo(max_steps=20))
    written = [Record(3, 0, 0, "local_norm", "layers.0.w", 0.1234567891), Record(3, 1, 0, "local_norm", "layers.0.w", 2e-9),
               Record(3, 0, 0, "local_loss", "loss", 5.5), Record(3, 1, 0, "local_loss", "loss", float("nan")),
               Record(3, None, 0, "weight_norm", "global", 12.25), Record(3, None, 0, "grad_norm", "global", 1.5)]
    sink.write(written)
    assert "Epoch:[  1/  1], step:[    3/   20] local_norm/layers.0.w: 0.1234567891" in lines
    assert "Epoch:[  1/  1], step:[    3/   20] micro_local_lm_loss: 5.5" in lines
    assert "Epoch:[  1/  1], step:[    3/   20] device_local_norm: 1.5" in lines
    reader = LineReader()
    back = [r for line in lines for r in reader.read("2026-01-01 - INFO - " + line)]
    key = lambda r: (r.kind, r.micro_step, r.name)
    assert sorted(map(key, back)) == sorted(map(key, written))
    values = {key(r): r.value for r in back}
    for record in written:
        assert values[key(record)] == pytest.approx(record.value, nan_ok=True)
    parser = LogParser()
    parsed = [r for line in lines for r in parser.feed(line)]
    assert sorted(map(key, parsed)) == sorted(map(key, written))


# ---------------------------------------------------------------- the scenario YAML, trained

def _scenario():
    return yaml.safe_load((ROOT / "configs" / "monitor_config.yaml").read_text())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """configs/monitor_config.yaml's sections on the test model, through the real Trainer (the model and
    optimizer are kept, to compare with what was recorded at the last step)."""
    out = tmp_path_factory.mktemp("monitor_config")
    scenario = _scenario()
    config = trainer_config(out, steps=3, monitor={"train_state": {}},
                            monitor_config=scenario["monitor_config"],
                            check_for_nan_in_loss_and_grad=scenario["check_for_nan_in_loss_and_grad"],
                            tensorboard={**scenario["tensorboard"], "tensorboard_dir": str(out / "tb")})
    trainer = train(config)
    return config, read_jsonl(out / "rank_0" / "metrics.jsonl"), trainer, out


def _by(records, kind, step=None):
    return {(r["micro_step"], r["name"]): r["value"] for r in records
            if r["kind"] == kind and (step is None or r["step"] == step)}


def test_scenario_step1_losses_and_norms_match_a_replay(trained):
    """Step 1 replayed with a fresh copy of the model: per micro-batch loss and gradient of loss/K."""
    config, records, _, _ = trained
    model = make_model()
    model.set_train(True)
    names = [p.name for p in model.trainable_params()]
    batch = next(make_data(config).create_dict_iterator(output_numpy=True))
    grad_fn = value_and_grad(lambda ids, labels: model(ids, labels)[0], None, model.trainable_params())
    target = [re.compile(p) for p in _scenario()["monitor_config"]["target"]]
    selected = [n for n in names if any(p.search(n) for p in target)]
    assert selected and len(selected) < len(names)
    losses, accumulated, previous = [], {n: 0.0 for n in names}, {n: 0.0 for n in names}
    local_norm, local_loss = _by(records, "local_norm", 1), _by(records, "local_loss", 1)
    assert {name for _, name in local_norm} == set(selected)              # target regexes, exactly
    for k in range(K):
        rows = slice(k * LBS, (k + 1) * LBS)
        loss, grads = grad_fn(Tensor(batch["input_ids"][rows]), Tensor(batch["labels"][rows]))
        losses.append(float(loss.asnumpy()))
        assert local_loss[(k, "loss")] == pytest.approx(losses[-1], rel=1e-5)
        for name, grad in zip(names, grads):
            accumulated[name] = accumulated[name] + grad.asnumpy().astype(np.float64) / K
            norm = np.linalg.norm(accumulated[name])
            if name in selected:
                assert local_norm[(k, name)] == pytest.approx(norm - previous[name], rel=1e-4, abs=1e-7)
            previous[name] = norm
    assert _by(records, "device_loss", 1)[(None, "loss")] == pytest.approx(np.mean(losses), rel=1e-5)
    device_local_norm = np.sqrt(sum(np.sum(a * a) for a in accumulated.values()))
    assert _by(records, "grad_norm", 1)[(None, "global")] == pytest.approx(device_local_norm, rel=1e-4)


def test_scenario_weight_optimizer_and_stable_rank_at_the_last_step(trained):
    _, records, trainer, _ = trained
    from mindmon.features.tensor_stats.targets import find_moments

    weights = {p.name: p.asnumpy().astype(np.float64) for p in trainer.model.trainable_params()}
    assert _by(records, "weight_norm", 3)[(None, "global")] == pytest.approx(
        np.sqrt(sum(np.sum(w * w) for w in weights.values())), rel=1e-6)
    parameters = trainer.optimizer.parameters
    first, second = find_moments(trainer.optimizer, len(parameters))
    target = [re.compile(p) for p in _scenario()["monitor_config"]["target"]]
    m_norms, v_norms = _by(records, "adam_m_norm", 3), _by(records, "adam_v_norm", 3)
    selected = [i for i, p in enumerate(parameters) if any(t.search(p.name) for t in target)]
    assert {name for _, name in m_norms} == {parameters[i].name for i in selected}
    for i in selected:
        assert m_norms[(None, parameters[i].name)] == pytest.approx(np.linalg.norm(first[i].asnumpy().astype(np.float64)), rel=1e-6)
        assert v_norms[(None, parameters[i].name)] == pytest.approx(np.linalg.norm(second[i].asnumpy().astype(np.float64)), rel=1e-6)
    stable, eigen = _by(records, "weight_stable_rank", 3), _by(records, "weight_eigenvalue", 3)
    sr_target = [re.compile(p) for p in _scenario()["monitor_config"]["stable_rank_config"]["target"]]
    matrices = {n: w for n, w in weights.items() if w.ndim == 2 and any(t.search(n) for t in sr_target)}
    assert matrices and {name for _, name in stable} == set(matrices)
    for name, weight in matrices.items():
        sigma = np.linalg.svd(weight, compute_uv=False)
        # 50 power iterations per step, warm-started from the previous step's vector (150 by step 3); the
        # random initial weights have close top singular values, which power iteration separates slowly.
        # |Wv| for a unit v never exceeds sigma_max (up to float32 rounding: the iteration runs in float32).
        assert eigen[(None, name)] <= sigma[0] ** 2 * (1 + 1e-6)
        assert eigen[(None, name)] == pytest.approx(sigma[0] ** 2, rel=1e-4)
        assert stable[(None, name)] == pytest.approx(np.sum(sigma ** 2) / sigma[0] ** 2, rel=1e-4)


def test_scenario_max_logits_and_throughput(trained):
    _, records, _, _ = trained
    for step in (1, 2, 3):
        layers = [r["value"] for r in records if r["kind"] == "max_attention_logit" and r["step"] == step]
        assert len(layers) == 3          # 2 decoder layers + 1 MTP layer, every step_interval (1) steps
        heads = np.concatenate(layers)
        assert _by(records, "max_attention_logit_max", step)[(None, "all")] == pytest.approx(heads.max())
        assert _by(records, "max_attention_logit_mean", step)[(None, "all")] == pytest.approx(heads.mean())
        linearity = _by(records, "throughput_linearity", step)[(None, "global")]
        seconds = 8 / 1 / (linearity * _scenario()["monitor_config"]["throughput_baseline"])
        assert 0.005 < seconds < 120     # a plausible step time for 4 micro-steps of the test model


def test_scenario_tensorboard_uses_mindformers_tags(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, records, _, out = trained
    events = EventAccumulator(str(out / "tb" / "rank_0"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("device_accum_local_lm_loss", "device_local_norm", "weight_norm", "throughput_linearity",
                "local_lm_loss", "max_attention_logit/mean"):
        assert tag in tags, tag
    name = next(n for _, n in _by(records, "adam_m_norm", 3))
    assert events.Scalars(f"adam_m_norm/{name}")[-1].value == pytest.approx(_by(records, "adam_m_norm", 3)[(None, name)], rel=1e-6)
    assert [e.value for e in events.Scalars("weight_norm")] == pytest.approx(
        [_by(records, "weight_norm", s)[(None, "global")] for s in (1, 2, 3)], rel=1e-6)
    assert any(t.startswith("weight_stable_rank/") for t in tags) and any(t.startswith("local_norm/") for t in tags)
    assert not any(t.startswith("device_norm/") for t in tags)    # not asked for: not computed


def test_scenario_yaml_trains_in_the_demo(tmp_path):
    """`mindmon demo --config configs/monitor_config.yaml`: its log carries MindFormers' lines, and they
    read back to the values of the run's JSONL."""
    import os

    from mindmon.formats.training_state_log import LineReader

    env = {k: v for k, v in os.environ.items() if k != "LOG_MF_PATH"}   # the demo's log goes to <output>/log
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run([sys.executable, "-m", "mindmon", "demo", "--steps", "2", "--output", str(tmp_path),
                             "--config", str(ROOT / "configs" / "monitor_config.yaml")],
                            capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    records = read_jsonl(tmp_path / "monitor" / "rank_0" / "metrics.jsonl")
    log = (tmp_path / "log" / "rank_0" / "info.log").read_text().splitlines()
    reader = LineReader()
    logged = [r for line in log for r in reader.read(line)]
    kinds = {r.kind for r in logged}
    assert {"local_norm", "local_loss", "device_loss", "grad_norm", "adam_m_norm", "adam_v_norm", "weight_norm",
            "throughput_linearity", "weight_stable_rank", "weight_eigenvalue"} <= kinds
    jsonl = {(r["kind"], r["step"], r["micro_step"], r["name"]): r["value"] for r in records}
    for record in logged:
        assert record.value == pytest.approx(jsonl[(record.kind, record.step, record.micro_step, record.name)], rel=1e-12)
    assert (tmp_path / "tensorboard" / "rank_0").is_dir()


# ---------------------------------------------------------------- checks that act on training

def _guarded(tmp_path, steps, monitor_config, model=None, **top):
    config = trainer_config(tmp_path, steps=steps, monitor={}, monitor_config=monitor_config, **top)
    model = model or make_model()
    before = {p.name: p.asnumpy().copy() for p in model.trainable_params()}
    trainer = train(config, model)
    records = read_jsonl(tmp_path / "rank_0" / "metrics.jsonl")
    changed = [n for n, w in before.items() if not np.array_equal(w, model.parameters_dict()[n].asnumpy(), equal_nan=True)]
    return records, changed, trainer


def test_consecutive_spikes_skip_updates_and_stop(tmp_path):
    records, changed, _ = _guarded(tmp_path, 6, {"monitor_on": True, "check_for_global_norm": True,
                                                 "global_norm_spike_threshold": 1e-6,
                                                 "global_norm_spike_count_threshold": 2})
    assert max(r["step"] for r in records) == 2                     # stopped after the 2nd consecutive spike
    assert [r["value"] for r in records if r["kind"] == "global_norm_spike_count"] == [1.0, 2.0]
    assert all(r["value"] >= 1e-6 for r in records if r["kind"] == "grad_norm")
    assert changed == []                                            # every spike's update skipped


def test_spike_count_resets_below_threshold(tmp_path):
    """A threshold between the step norms: only the steps at or above it count, and the run goes on."""
    records, changed, _ = _guarded(tmp_path, 3, {"monitor_on": True, "check_for_global_norm": True,
                                                 "global_norm_spike_threshold": 1e9})
    assert max(r["step"] for r in records) == 3
    assert [r["value"] for r in records if r["kind"] == "global_norm_spike_count"] == [0.0, 0.0, 0.0]
    assert changed                                                  # updates applied


def test_nan_check_stops_after_the_step(tmp_path):
    model = make_model()
    weight = model.output_layer.weight
    poisoned = weight.asnumpy().copy()
    poisoned[0, 0] = np.nan
    weight.set_data(Tensor(poisoned))
    records, changed, _ = _guarded(tmp_path, 4, {}, model=model, check_for_nan_in_loss_and_grad=True)
    assert max(r["step"] for r in records) == 1
    loss = [r for r in records if r["kind"] == "loss"]
    assert loss[0]["value"] is None and loss[0]["nonfinite"] == "nan"   # JSONL's way of writing NaN
    assert changed == []                                            # the non-finite update was skipped


def test_print_struct_logs_names_and_stops(tmp_path, caplog):
    records, changed, trainer = _guarded(tmp_path, 4, {"monitor_on": True, "print_struct": True})
    assert max(r["step"] for r in records) == 1
    assert changed == []
    from tests.support.demo_trainer import mindformers_log

    log = mindformers_log()
    assert all(p.name in log for p in trainer.model.trainable_params())
    assert "print_struct: the" in log


def test_two_ranks_skip_and_stop_at_the_same_step(tmp_path):
    """Two real msrun workers (data parallel): the spike check skips every update and stops both ranks after
    the same step; the weights both report are the untouched initial ones (numpy, from a fresh model)."""
    import os

    from tests.support.demo_trainer import SMALL_MODEL
    from mindmon.demo.model import DemoModelConfig, DemoMoEGPT

    overlay = {"model": SMALL_MODEL, "training": {"global_batch_size": 8, "local_batch_size": 2},
               "monitor": {"train_state": {}},
               "monitor_config": {"monitor_on": True, "check_for_global_norm": True, "weight_state_format": "log",
                                  "global_norm_spike_threshold": 1e-6, "global_norm_spike_count_threshold": 2}}
    (tmp_path / "spikes.yaml").write_text(yaml.safe_dump(overlay))
    env = {k: v for k, v in os.environ.items() if k != "LOG_MF_PATH"}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run([sys.executable, "-m", "mindmon", "demo", "--workers", "2", "--steps", "5", "--output",
                             str(tmp_path), "--config", str(tmp_path / "spikes.yaml")],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    initial = np.sqrt(sum(np.sum(p.asnumpy().astype(np.float64) ** 2)
                          for p in DemoMoEGPT(DemoModelConfig.from_dict(SMALL_MODEL)).trainable_params()))
    for rank in (0, 1):
        records = read_jsonl(tmp_path / "monitor" / f"rank_{rank}" / "metrics.jsonl")
        assert max(r["step"] for r in records) == 2, rank
        assert [r["value"] for r in records if r["kind"] == "global_norm_spike_count"] == [1.0, 2.0]
        assert [r["value"] for r in records if r["kind"] == "weight_norm"] == pytest.approx([initial, initial], rel=1e-6)
