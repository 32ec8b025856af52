"""Every config error names the key path, the value and what is allowed; defaults are the seed's."""
import subprocess
import sys

import pytest
import yaml

from tests.support.bad_profiler import BAD_PROFILER_SECTIONS
from mindmon.config import ConfigError, ParamFilter
from mindmon.features import parse_sections


def _error(raw):
    with pytest.raises(ConfigError) as info:
        parse_sections(raw)
    return info.value


@pytest.mark.parametrize("key,value", [
    ("local_norm", 3), ("local_norm", 1.5), ("local_norm", None), ("local_norm", {"a": 1}),
    ("device_norm", 0), ("local_loss", "yes"), ("local_loss", 1), ("device_loss", None),
])
def test_train_state_wrong_type(key, value):
    error = _error({"monitor": {"train_state": {key: value}}})
    assert isinstance(error, TypeError)
    assert f"monitor.train_state.{key}" in str(error) and repr(value) in str(error)
    assert "allowed" in str(error)


@pytest.mark.parametrize("value,message", [
    ([1, "x"], "strings only"), (["attention", ""], "non-empty substrings"),
])
def test_norm_filter_bad_items(value, message):
    error = _error({"monitor": {"train_state": {"local_norm": value}}})
    assert "monitor.train_state.local_norm item" in str(error) and message in str(error)


def test_unknown_keys_are_named():
    error = _error({"monitor": {"train_state": {"local_norms": True}}})
    assert "monitor.train_state" in str(error) and "local_norms" in str(error) and "local_norm'" in str(error)
    error = _error({"monitor": {"tain_state": {}}})
    assert "'tain_state'" in str(error) and "train_state" in str(error)
    error = _error({"profiler": {"enable_profiler": True}})
    assert "profiler" in str(error) and "enable_profiling" in str(error)


def test_norm_filter_forms():
    parse = ParamFilter.parse
    assert parse("k", True).matches("anything") and parse("k", True).enabled
    assert not parse("k", False).enabled and not parse("k", "").enabled and not parse("k", []).enabled
    layer0 = parse("k", "layers.0")
    assert layer0.matches("decoder.layers.0.mlp.weight") and not layer0.matches("decoder.layers.1.mlp.weight")
    both = parse("k", ["attention", "layernorm"])
    assert both.matches("x.self_attention.linear_qkv.weight") and both.matches("x.input_layernorm.bias")
    assert not both.matches("x.mlp.linear_fc1.weight")


def test_defaults_are_the_seed_tables():
    config = parse_sections({}).to_dict()
    assert config["monitor"]["train_state"] == {"local_norm": False, "local_loss": False,
                                                "device_norm": False, "device_loss": False}
    assert config["monitor"]["moe_monitor"] == {"save_tokens_per_expert_interval": None, "target_layers": None}
    assert config["profiler"] == {"enable_profiling": False, "start_step": 1, "end_step": 1, "output_path": None,
                                  "profiler_rank": None, "profiler_level": 0, "mstx": False,
                                  "profile_memory": False, "profile_cpu": True, "with_stack": True}
    assert config["callbacks"] == []


@pytest.mark.parametrize("value,exc", [(True, TypeError), (False, TypeError), (1.5, TypeError), ("10", TypeError),
                                       (0, ValueError), (-3, ValueError)])
def test_tokens_per_expert_interval(value, exc):
    with pytest.raises(exc) as info:
        parse_sections({"monitor": {"moe_monitor": {"save_tokens_per_expert_interval": value}}})
    assert "monitor.moe_monitor.save_tokens_per_expert_interval" in str(info.value)
    assert parse_sections({"monitor": {"moe_monitor": {"save_tokens_per_expert_interval": 10}}}).monitor.moe_monitor.active


@pytest.mark.parametrize("value", [0, -1, [], [0, -2], [1, "2"], "3", 2.0, True])
def test_target_layers_invalid(value):
    error = _error({"monitor": {"moe_monitor": {"target_layers": value}}})
    assert "monitor.moe_monitor.target_layers" in str(error)


@pytest.mark.parametrize("section,key", BAD_PROFILER_SECTIONS + [
    ({"enable_profiling": "yes"}, "profiler.enable_profiling"),
    ({"profiler_rank": [0, -1]}, "profiler.profiler_rank"),
    ({"profiler_rank": 0}, "profiler.profiler_rank"),
    ({"output_path": 3}, "profiler.output_path"),
])
def test_profiler_errors(section, key):
    error = _error({"profiler": section})
    assert key in str(error)


def test_profiler_level_outside_range_is_accepted_as_level_none():
    profiler = parse_sections({"profiler": {"profiler_level": 7}}).profiler
    assert profiler.profiler_level == 7 and not profiler.level_is_valid


@pytest.mark.parametrize("interval", [0, -2, 1.5, True, "1"])
def test_max_logits_step_interval(interval):
    error = _error({"callbacks": [{"type": "MaxLogitsMonitor", "step_interval": interval}]})
    assert "callbacks[0].step_interval" in str(error) and "positive int" in str(error)


def test_check_config_cli(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump({"training": {"steps": 3},
                                    "monitor": {"train_state": {"local_norm": "layers.0", "device_loss": True}},
                                    "callbacks": [{"type": "MaxLogitsMonitor", "step_interval": 2}]}))
    result = subprocess.run([sys.executable, "-m", "mindmon.cli", "check-config", str(good)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    printed = yaml.safe_load(result.stdout)
    assert printed["monitor"]["train_state"] == {"local_norm": ["layers.0"], "local_loss": False,
                                                 "device_norm": False, "device_loss": True}
    assert printed["profiler"]["profile_cpu"] is True
    assert printed["callbacks"] == [{"type": "MaxLogitsMonitor", "step_interval": 2}]
    bad = tmp_path / "bad.yaml"
    bad.write_text("monitor:\n  train_state:\n    local_loss: maybe\n")
    result = subprocess.run([sys.executable, "-m", "mindmon.cli", "check-config", str(bad)],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert "monitor.train_state.local_loss" in result.stderr and "'maybe'" in result.stderr


def test_check_config_resolves_interpolation(tmp_path):
    path = tmp_path / "interp.yaml"
    path.write_text("base: ./runs/a\nmonitor:\n  output_dir: ${base}/monitor\n")
    result = subprocess.run([sys.executable, "-m", "mindmon.cli", "check-config", str(path)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["monitor"]["output_dir"] == "./runs/a/monitor"
