"""msprobe's config.json: every key validated, errors naming the key; later capabilities accepted."""
import json
import logging

import pytest

from mindmon.config import ConfigError
from mindmon.msprobe import TrainerMon, load_config_json, parse_tensor_stats

pytestmark = pytest.mark.ms27   # also runs on MindSpore 2.7 (make test-ms27)

# msprobe's documented full configuration (its "detailed configuration" example), targets emptied.
DOCUMENTED_FULL = {
    "targets": {}, "dynamic_on": False, "start_step": 0, "collect_times": 100000000, "step_interval": 1,
    "print_struct": False, "module_ranks": [0, 1, 2, 3], "ur_distribution": True, "xy_distribution": True,
    "all_xy": True, "forward_only": False, "backward_only": False, "mv_distribution": True,
    "param_distribution": True, "wg_distribution": True, "monitor_mbs_grad": True,
    "cc_distribution": {"enable": True, "cc_codeline": []},
    "alert": {"rules": [{"rule_name": "AnomalyTurbulence", "args": {"threshold": 0.5}}], "dump": False},
    "format": "csv", "ops": ["min", "max", "norm", "zeros", "nans", "mean"], "eps": 1e-8, "ndigits": 12,
    "step_count_per_record": 1, "append_output": [], "squash_name": False,
}

BAD = [
    ({"targets": []}, "targets"),
    ({"targets": {"fc1": []}}, "targets.fc1"),
    ({"param_distribution": "yes"}, "param_distribution"),
    ({"wg_distribution": 1}, "wg_distribution"),
    ({"mv_distribution": None}, "mv_distribution"),
    ({"monitor_mbs_grad": "true"}, "monitor_mbs_grad"),
    ({"ur_distribution": "yes"}, "ur_distribution"),
    ({"mg_direction": 1}, "mg_direction"),
    ({"ops": "norm"}, "ops"),
    ({"ops": ["norm", "std"]}, "ops"),
    ({"eps": 0}, "eps"),
    ({"eps": "1e-8"}, "eps"),
    ({"ndigits": -1}, "ndigits"),
    ({"ndigits": 1.5}, "ndigits"),
    ({"start_step": -1}, "start_step"),
    ({"start_step": "0"}, "start_step"),
    ({"step_interval": 0}, "step_interval"),
    ({"collect_times": -1}, "collect_times"),   # 0 is allowed: an edit to 0 stops a dynamic run early
    ({"module_ranks": [0, -1]}, "module_ranks"),
    ({"module_ranks": "0"}, "module_ranks"),
    ({"format": "tensorboard"}, "format"),
    ({"format": 1}, "format"),
    ({"step_count_per_record": 0}, "step_count_per_record"),
    ({"step_count_per_record": 1000001}, "step_count_per_record"),
    ({"squash_name": "false"}, "squash_name"),
    ({"append_output": ["Dec03_21-34-40"]}, "append_output"),
    ({"append_output": ["Dec03_21-34-40", "yesterday"]}, "append_output"),
    ({"append_output": "Dec03_21-34-40"}, "append_output"),
    ({"significant_digits": 1}, "significant_digits"),
    ({"opts": ["norm"]}, "opts"),
    ({"xy_distribution": "yes"}, "xy_distribution"),
    ({"alert": []}, "alert"),
    ({"sa_order": 1}, "sa_order"),
]


@pytest.mark.parametrize("section, key", BAD, ids=[f"{key}={section[key.split('.')[0]]!r}" for section, key in BAD])
def test_bad_key_is_named(section, key):
    with pytest.raises(ConfigError) as error:
        parse_tensor_stats(section)
    assert str(error.value).startswith(f"{key}:"), str(error.value)
    assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match=rf"^monitor\.tensor_stats\.{key}:"):
        parse_tensor_stats(section, "monitor.tensor_stats")


def test_bad_config_file(tmp_path):
    path = tmp_path / "monitor_config.json"
    path.write_text('{"ops": ["norm"],}')
    with pytest.raises(ConfigError, match="^config_file_path: .* not valid JSON"):
        TrainerMon(str(path))
    with pytest.raises(ConfigError, match="^config_file_path: cannot read"):
        TrainerMon(str(tmp_path / "missing.json"))
    path.write_text("[]")
    with pytest.raises(ConfigError, match="^config:"):
        load_config_json(str(path))


def test_defaults_as_msprobe_documents():
    config = parse_tensor_stats({})
    assert (config.ops, config.eps, config.ndigits, config.start_step, config.step_interval, config.collect_times,
            config.format, config.step_count_per_record, config.module_ranks, config.targets) == \
        (("norm",), 1e-8, 6, 0, 1, 100000000, "csv", 1, (), ())
    assert not config.active


def test_ops_keep_config_order_and_empty_means_norm():
    assert parse_tensor_stats({"ops": ["nans", "min", "nans", "mean"]}).ops == ("nans", "min", "mean")
    assert parse_tensor_stats({"ops": []}).ops == ("norm",)
    # msprobe also lists shape and dtype (always written as columns) and id among its ops.
    assert parse_tensor_stats({"ops": ["max", "shape", "dtype", "id"]}).ops == ("max", "id")
    assert parse_tensor_stats({"ops": ["shape"]}).ops == ("norm",)


def test_documented_full_config_parses_and_names_later_capabilities(caplog):
    with caplog.at_level(logging.WARNING, logger="mindmon"):
        config = parse_tensor_stats(DOCUMENTED_FULL)
    assert config.param_distribution and config.wg_distribution and config.mv_distribution
    assert config.module_ranks == (0, 1, 2, 3) and config.ndigits == 12
    messages = [r.getMessage() for r in caplog.records]
    assert config.ur_distribution and not any("ur_distribution" in m for m in messages)   # implemented
    assert parse_tensor_stats({"mg_direction": True}).mg_direction
    with caplog.at_level(logging.WARNING, logger="mindmon"):
        parse_tensor_stats({"mg_distribution": True})
    assert sum("mg_distribution" in r.getMessage() for r in caplog.records) == 1
    assert config.cc.enable and not any("cc_distribution" in m for m in messages)  # implemented: no warning
    assert config.alert is not None and config.alert.active   # alerts are built: the block is parsed
    # Activations are implemented: parsed, not named as missing.
    assert config.xy_distribution and config.all_xy and config.collects_activations
    assert not any("xy_distribution" in m or "print_struct" in m for m in messages)


def test_collection_steps():
    config = parse_tensor_stats({"start_step": 2, "step_interval": 3, "collect_times": 2})
    assert [s for s in range(12) if config.collects(s)] == [2, 5]


def test_errors_at_set_monitor_name_the_argument(tmp_path):
    from tests.support.msprobe_reference import K, make_model, make_optimizer

    path = tmp_path / "monitor_config.json"
    path.write_text(json.dumps({"wg_distribution": True, "targets": {"fc3": {}}}))
    model = make_model()
    optimizer = make_optimizer("AdamWeightDecay", model.trainable_params())
    with pytest.raises(ConfigError, match="^targets: 'fc3' selects no parameter"):
        TrainerMon(str(path)).set_monitor(model, K, optimizer)
    path.write_text(json.dumps({"wg_distribution": True}))
    with pytest.raises(ConfigError, match="^grad_acc_steps: got 0"):
        TrainerMon(str(path)).set_monitor(model, 0, optimizer)
    with pytest.raises(ConfigError, match="^optimizer: got object"):
        TrainerMon(str(path)).set_monitor(model, K, object())
