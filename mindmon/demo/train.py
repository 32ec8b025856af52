"""Launch code for the demo, written the way a MindFormers user writes theirs.

It builds the model, the data and the stock MindFormers Trainer from a YAML and calls `train()`.
It never calls mindmon's monitoring API: the monitoring comes from the YAML's `monitor:` section
through the autoload hook that installing mindmon adds.
"""
import os
import sys
import tempfile
from typing import Optional

import yaml

from mindmon.config import DEFAULT_OUTPUT_DIR, ConfigError, describe, is_int
from mindmon.features import parse_sections, rank_selection_warnings
from mindmon.config import read_yaml

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_config() -> str:
    """`configs/demo.yaml`: shipped inside the installed package, or at the top of a source checkout."""
    for path in (os.path.join(_PACKAGE, "configs", "demo.yaml"),
                 os.path.join(os.path.dirname(_PACKAGE), "configs", "demo.yaml")):
        if os.path.exists(path):
            return path
    raise FileNotFoundError("configs/demo.yaml not found; reinstall mindmon or pass --config")


def overlay(base: dict, scenario: dict) -> dict:
    """The demo config with a scenario's sections laid over it, two levels deep: a scenario's
    `monitor.train_state` replaces the demo's whole `train_state`, while `monitor.output_dir` and
    the other sections the scenario does not mention stay. Lists (`callbacks`) replace."""
    merged = dict(base)
    for section, value in scenario.items():
        if isinstance(value, dict) and isinstance(base.get(section), dict):
            merged[section] = {**base[section], **value}
        else:
            merged[section] = value
    return merged


def _mapping(config: dict, key: str) -> dict:
    value = config.get(key)
    return value if isinstance(value, dict) else {}


def _apply_overrides(config: dict, steps: Optional[int], output: Optional[str]) -> dict:
    """`--steps` and `--output` on a validated config; every output the YAML switches on moves under `--output`."""
    if steps is not None:
        config["training"] = {**config["training"], "steps": steps}
    if output is not None:
        monitor = config["monitor"] = {**_mapping(config, "monitor"), "output_dir": os.path.join(output, "monitor")}
        if _mapping(monitor, "tensorboard").get("tensorboard_dir"):  # the sink is on: keep it in output
            monitor["tensorboard"] = {**monitor["tensorboard"], "tensorboard_dir": os.path.join(output, "tensorboard")}
        if _mapping(config, "tensorboard").get("tensorboard_dir"):  # MindFormers' top-level section (monitor_config)
            config["tensorboard"] = {**config["tensorboard"], "tensorboard_dir": os.path.join(output, "tensorboard")}
        if _mapping(config, "profiler").get("enable_profiling"):  # likewise the profiler's traces
            config["profiler"] = {**config["profiler"], "output_path": os.path.join(output, "profile")}
    return config


def checked_config(config_path: Optional[str], steps: Optional[int], output: Optional[str]) -> dict:
    """The demo config with the scenario file laid over it, validated (a `ConfigError` naming the key
    comes before any override touches a section), then `--steps`/`--output` applied."""
    config = read_yaml(default_config())
    if config_path is not None:
        config = overlay(config, read_yaml(config_path))
    parse_sections(config)
    _check_demo_sections(config, steps)
    return _apply_overrides(config, steps, output)


# The sizes the demo reads (DemoModelConfig's int fields), with the least each may be.
_DEMO_SIZES = {"training.steps": 1, "training.local_batch_size": 1, "training.global_batch_size": 1,
               **{f"model.{k}": 1 for k in ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers",
                                            "num_attention_heads", "seq_length", "num_experts", "moe_router_topk")},
               "model.first_moe_layer": 0, "model.mtp_num_layers": 0}


def _check_demo_sections(config: dict, steps: Optional[int]) -> None:
    """What the demo itself reads from `training:` and `model:` (the Trainer checks the rest)."""
    if steps is not None and steps <= 0:
        raise ConfigError(f"--steps: got {steps}; allowed: a positive int")
    for section in ("training", "model"):
        if not isinstance(config.get(section), dict):
            raise ConfigError(f"{section}: got {describe(config.get(section))}; allowed: a mapping (the demo needs one)")
    for key, least in _DEMO_SIZES.items():
        section, name = key.split(".")
        value = config[section].get(name)
        if value is not None and (not is_int(value) or value < least):
            raise ConfigError(f"{key}: got {describe(value)}; allowed: an int >= {least}")


def metrics_file(config: dict, rank: int) -> str:
    monitor_dir = _mapping(config, "monitor").get("output_dir", DEFAULT_OUTPUT_DIR)
    return os.path.join(monitor_dir, f"rank_{rank}", "metrics.jsonl")


def _join_process_group():
    """(rank, world size): under msrun (RANK_SIZE > 1) join the CPU process group first."""
    if int(os.environ.get("RANK_SIZE", "1")) <= 1:
        return 0, 1
    from mindspore.communication import get_group_size, get_rank, init

    init("mccl")
    return get_rank(), get_group_size()


def run(config_path: Optional[str] = None, steps: Optional[int] = None, output: Optional[str] = None) -> dict:
    """Train the demo model; returns the config used (after overrides)."""
    import mindspore as ms

    # Synchronous PyNative: on a small CPU machine the asynchronous op queue makes each step
    # several times slower (measured: 0.13 s vs 1.4 s per forward/backward of this model).
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU", pynative_synchronize=True)
    rank, world = _join_process_group()
    from mindformers.pynative.trainer import Trainer

    from mindmon.demo.data import make_dataset
    from mindmon.demo.model import DemoModelConfig, DemoMoEGPT

    config = checked_config(config_path, steps, output)
    for warning in rank_selection_warnings(parse_sections(config), world):
        print(f"mindmon: warning: {warning}", file=sys.stderr)
    model_config = DemoModelConfig.from_dict(config["model"])
    training = config["training"]
    # Each data-parallel rank trains its own shard: global_batch_size / world samples per step.
    dataset = make_dataset(num_samples=training["steps"] * training["global_batch_size"],
                           seq_length=model_config.seq_length, vocab_size=model_config.vocab_size,
                           batch_size=training["global_batch_size"] // world, seed=training.get("seed", 0),
                           num_shards=world, shard_id=rank)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
        yaml.safe_dump(config, handle, sort_keys=False)
    try:
        trainer = Trainer(config=handle.name, model=DemoMoEGPT(model_config), train_dataset=dataset)
        trainer.train()
    finally:
        os.unlink(handle.name)
    return config
