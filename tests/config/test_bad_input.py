"""The bad-input catalogue: every wrong configuration is one clean line and exit 1, never a traceback.

Each case is a YAML file run through `mindmon check-config` in this process (`mindmon.cli.main`);
the message must name the key path (or, for a broken file, the file and its line) and what is
allowed. The legitimate inputs next to them must still be accepted. A few go through a real
`mindmon demo --config` subprocess, which must print the same kind of line.
"""
import math
import os
import subprocess
import sys

import pytest
import yaml

from tests.support.bad_profiler import BAD_PROFILER_SECTIONS
from tests.support.demo_trainer import SMALL_MODEL
from mindmon.cli import main


BOOL_KEYS = ["monitor.train_state.local_loss", "monitor.train_state.device_loss", "profiler.enable_profiling",
             "profiler.mstx", "profiler.profile_memory", "profiler.profile_cpu", "profiler.with_stack",
             "optimizer.qk_clip_enabled"]
BAD_BOOLS = ["yes please", 1, 0.5, [True], {"on": True}]

POSITIVE_INT_KEYS = ["monitor.moe_monitor.save_tokens_per_expert_interval",
                     "monitor.tensorboard.tensorboard_log_interval", "monitor.tensorboard.tensorboard_queue_size",
                     "profiler.start_step", "profiler.end_step"]
BAD_POSITIVE_INTS = [0, -1, 1.5, "3", True, [1], math.inf]

DIRECTORY_KEYS = ["monitor.output_dir", "monitor.tensorboard.tensorboard_dir", "profiler.output_path"]
BAD_DIRECTORIES = ["out\0put", 5, ["x"], {"a": 1}, True]

FILTER_KEYS = ["monitor.train_state.local_norm", "monitor.train_state.device_norm"]
BAD_FILTERS = [5, 1.5, [1], [""], {"a": 1}, None]

RANK_KEYS = ["monitor.ranks", "profiler.profiler_rank"]
BAD_RANKS = [[], [-1], ["0"], 0, "all", [True]]

SECTION_KEYS = ["monitor", "profiler", "monitor.train_state", "monitor.moe_monitor", "monitor.tensorboard"]
BAD_SECTIONS = ["on", 1, [1], True]

SINGLE_CASES = [
    *[("monitor.moe_monitor.target_layers", v) for v in ([], [1, 1], [2, 0, 2], [-1], ["1"], 0, -3, "all", 1.5,
                                                         True, {"a": 1})],
    *[("monitor.data_parallel_group", v) for v in ("", 5, ["dp"], True)],
    *[("training.max_norm", v) for v in (math.nan, math.inf, -math.inf, -1, -0.5, "1.0", True, [1], None)],
    ("monitor.tensorboard.tensorboard_queue_size", 2 ** 31),
    ("monitor.tensorboard.tensorboard_queue_size", 1_000_001),
    ("monitor.output_dir", ""),
]


def _nest(dotted: str, value) -> dict:
    head, *rest = dotted.split(".")
    return {head: _nest(".".join(rest), value) if rest else value}


def _value_cases():
    groups = [(BOOL_KEYS, BAD_BOOLS), (POSITIVE_INT_KEYS, BAD_POSITIVE_INTS), (DIRECTORY_KEYS, BAD_DIRECTORIES),
              (FILTER_KEYS, BAD_FILTERS), (RANK_KEYS, BAD_RANKS), (SECTION_KEYS, BAD_SECTIONS)]
    cases = [(key, value) for keys, values in groups for key in keys for value in values]
    return [pytest.param(_nest(key, value), key, id=f"{key}={value!r}") for key, value in cases + SINGLE_CASES]


MAX_LOGITS = {"type": "MaxLogitsMonitor"}
STRUCTURE_CASES = [
    ({"monitor": {"no_such_key": 1}}, "monitor"),
    ({"monitor": {"train_state": {"local_norms": True}}}, "monitor.train_state"),
    ({"monitor": {"moe_monitor": {"interval": 1}}}, "monitor.moe_monitor"),
    ({"monitor": {"tensorboard": {"dir": "x"}}}, "monitor.tensorboard"),
    ({"profiler": {"enable": True}}, "profiler"),
    ({"callbacks": "MaxLogitsMonitor"}, "callbacks"),
    ({"callbacks": MAX_LOGITS}, "callbacks"),
    ({"callbacks": [1]}, "callbacks[0]"),
    ({"callbacks": [{"step_interval": 2}]}, "callbacks[0]"),
    ({"callbacks": [{"type": 7}]}, "callbacks[0]"),
    ({"callbacks": [{**MAX_LOGITS, "interval": 2}]}, "callbacks[0]"),
    ({"callbacks": [{"type": "Other"}, MAX_LOGITS, {"type": "Other"}, MAX_LOGITS]}, "callbacks[3]"),
    ({"callbacks": [{**MAX_LOGITS, "step_interval": 1}, {**MAX_LOGITS, "step_interval": 5}]}, "callbacks[1]"),
    *[({"callbacks": [{**MAX_LOGITS, "step_interval": v}]}, "callbacks[0].step_interval")
      for v in (0, -2, 1.5, "2", True, None)],
    *[({"profiler": section}, key) for section, key in BAD_PROFILER_SECTIONS],
]

# Files that are not a mapping of sections at all: (text or bytes, what the line must contain).
BROKEN_FILES = [
    ("monitor: [1\n", "line 2"),
    ("monitor:\n  train_state: {local_loss: True\n", "line 3"),
    ("monitor:\n\tfoo: 1\n", "line 2"),
    ("monitor: {a: b: c}\n", "line 1"),
    ("monitor: !custom_tag {local_loss: True}\n", "line 1: could not determine a constructor for the tag '!custom_tag'"),
    ("monitor: !!python/object/apply:os.system ['true']\n", "line 1: could not determine a constructor"),
    ("training: {max_norm: *undefined}\n", "line 1: found undefined alias"),
    ("monitor: &m {ranks: [0]}\nprofiler: &m2 [*m, *m3]\n", "line 2: found undefined alias"),
    ("a: &loop [*loop]\n", "line 1: an alias refers to a collection that contains it"),
    (b"monitor:\n  output_dir: ok\x00\n", "line 2: a NUL byte"),
    (b"monitor:\n  output_dir: caf\xe9\n", "line 2: not UTF-8 text (byte 0xe9)"),
    (b"\xff\xfemonitor: 1\n", "line 1: not UTF-8 text"),
    ("monitor:\n  output_dir: bell\x07\n", "line 2: a control character (U+0007); allowed: printable text"),
    ("~: 1\nmonitor: {}\n", "line 1: a null key"),
    ("monitor:\n  null: 1\n", "line 2: a null key"),
    ("monitor:\n  ranks: [0]\n  Null: 1\n", "line 3: a null key (Null)"),
    ("? [monitor]\n: 1\n", "line 1: a list or mapping used as a key"),
    ("monitor: {}\nprofiler: {}\nmonitor: {ranks: [0]}\n", "line 3: key 'monitor' appears twice (first on line 1)"),
    ("monitor:\n  ranks: [0]\n  ranks: [1]\n", "line 3: key 'ranks' appears twice"),
    ("model: " + "{a: " * 40 + "1" + "}" * 40 + "\n", "line 1: nested deeper than 32 levels"),
    ("model: " + "[" * 2000 + "]" * 2000 + "\n", "line 1: exceeded maximum nesting depth"),
    ("monitor:\n  output_dir: ${nowhere}\n", "monitor.output_dir: Interpolation key 'nowhere' not found"),
    ("monitor:\n  output_dir: ${training.dir}\ntraining: {steps: 1}\n", "monitor.output_dir: Interpolation key"),
    ("monitor:\n  output_dir: ${oc.env:MINDMON_TEST_UNSET_VARIABLE}\n", "monitor.output_dir: KeyError"),
    ("monitor:\n  output_dir: ${no_such_resolver:x}\n", "monitor.output_dir: Unsupported interpolation type"),
    ("monitor:\n  output_dir: ${\n", "monitor.output_dir:"),
    ("a: ${b}\nb: ${a}\n", "Recursive interpolation"),
    ("", "the top level is NoneType"),
    ("# only a comment\n", "the top level is NoneType"),
    ("- monitor\n- profiler\n", "the top level is list"),
    ("just a string\n", "the top level is str"),
    ("---\nmonitor: {}\n---\nprofiler: {}\n", "line 3: but found another document"),
]

# One billion "lol"s in 9 nested levels of 9 aliases each: a few hundred bytes.
BILLION_LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi"))


def _check_config(path, capsys):
    code = main(["check-config", str(path)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _assert_one_clean_line(code, err, *needles):
    assert code == 1
    assert "Traceback" not in err
    line = err.rstrip("\n")
    assert "\n" not in line and line.startswith("mindmon: "), err
    for needle in needles:
        assert needle in line, (needle, line)
    assert len(line) < 600, line  # a long value is cut, never printed whole


def _write(tmp_path, content, name="bad.yaml"):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content, encoding="utf-8")
    else:
        path.write_text(yaml.safe_dump(content), encoding="utf-8")
    return path


@pytest.mark.parametrize("raw, key", _value_cases() + [pytest.param(r, k, id=f"{k}:{i}")
                                                       for i, (r, k) in enumerate(STRUCTURE_CASES)])
def test_bad_value_is_one_line_naming_the_key(tmp_path, capsys, raw, key):
    path = _write(tmp_path, raw)
    code, out, err = _check_config(path, capsys)
    _assert_one_clean_line(code, err, f"mindmon: {path}: {key}", "allowed")
    assert out == ""


@pytest.mark.parametrize("content, expected", BROKEN_FILES, ids=[f"file{i}" for i in range(len(BROKEN_FILES))])
def test_broken_file_is_one_line_naming_file_and_line(tmp_path, capsys, content, expected):
    path = _write(tmp_path, content)
    code, _, err = _check_config(path, capsys)
    _assert_one_clean_line(code, err, f"mindmon: {path}: ", expected)


def test_missing_file_and_directory(tmp_path, capsys):
    code, _, err = _check_config(tmp_path / "absent.yaml", capsys)
    _assert_one_clean_line(code, err, f"{tmp_path / 'absent.yaml'}: No such file or directory")
    code, _, err = _check_config(tmp_path, capsys)
    _assert_one_clean_line(code, err, f"{tmp_path}: Is a directory")


def test_billion_laughs_is_refused_before_expanding(tmp_path, capsys):
    path = _write(tmp_path, BILLION_LAUGHS)
    assert len(BILLION_LAUGHS) < 450
    code, _, err = _check_config(path, capsys)   # expanded, it would be 10**9 nodes: this call would not end
    _assert_one_clean_line(code, err, ": aliases expand the document by", "allowed: at most 100000")
    # Independent count: level a is a list of 9 scalars (10 nodes), each next level a list of 9
    # copies of the one before; plus the root mapping and its 9 keys. The file itself spells out
    # the root, 9 keys, 9 lists and 9 scalars.
    sizes = [10]
    for _ in range(8):
        sizes.append(1 + 9 * sizes[-1])
    assert int(err.split("expand the document by ")[1].split()[0]) == 1 + 9 + sum(sizes) - 28


ACCEPTED = [
    {},
    {"monitor": None, "profiler": None, "callbacks": None},
    {"monitor": {"train_state": {"local_norm": True, "local_loss": True, "device_norm": ["attention", "norm"],
                                 "device_loss": True}, "ranks": [0, 3], "data_parallel_group": "dp_group"}},
    {"monitor": {"train_state": {"local_norm": "", "device_norm": False}}},
    {"monitor": {"moe_monitor": {"save_tokens_per_expert_interval": 10 ** 9, "target_layers": [3, 1, 0]}}},
    {"monitor": {"moe_monitor": {"save_tokens_per_expert_interval": None, "target_layers": 1_000_000}}},
    {"monitor": {"tensorboard": {"tensorboard_dir": None, "tensorboard_queue_size": 1_000_000}}},
    {"monitor": {"tensorboard": {"tensorboard_dir": "./tb", "tensorboard_log_interval": 10 ** 6}}},
    {"monitor": {"health_checkpoint": {"anything": "passes"}, "output_dir": "/tmp/rün dir"}},
    {"profiler": {"enable_profiling": True, "start_step": 3, "end_step": 5, "profiler_level": 7,
                  "profiler_rank": [0], "output_path": "./prof"}},
    {"callbacks": [{"type": "MaxLogitsMonitor", "step_interval": 5}, {"type": "TimeMonitor", "data_size": 1}]},
    {"training": {"max_norm": 0}},
    {"training": {"max_norm": 0.25}},
    {"training": {"max_norm": 3}},
    {"training": "not mindmon's to judge"},
    {"optimizer": {"type": "Muon", "qk_clip_enabled": True}},
]
ACCEPTED_TEXTS = [
    "\ufeffmonitor: {train_state: {local_loss: True}}\n",                       # a UTF-8 byte-order mark
    "base: &base {local_loss: True}\nmonitor: {train_state: *base}\n",          # an alias
    "base: &base {local_loss: True}\nmonitor:\n  train_state: {<<: *base, device_loss: True}\n",  # a merge key
    "dirs: {root: /tmp/run}\nmonitor: {output_dir: '${dirs.root}/monitor'}\n",  # an interpolation
    "monitor: {output_dir: '${oc.env:MINDMON_TEST_UNSET_VARIABLE,/tmp/fallback}'}\n",
    "model: " + "{a: " * 30 + "1" + "}" * 30 + "\n",                             # 31 levels
    "monitor:\n  output_dir: ./out   # comment\n...\n",
]


@pytest.mark.parametrize("content", ACCEPTED + ACCEPTED_TEXTS, ids=[f"ok{i}" for i in range(len(ACCEPTED + ACCEPTED_TEXTS))])
def test_legitimate_input_is_accepted(tmp_path, capsys, content):
    code, out, err = _check_config(_write(tmp_path, content), capsys)
    assert (code, err) == (0, "")
    assert yaml.safe_load(out).keys() == {"monitor", "profiler", "callbacks"}


def test_accepted_values_come_back_resolved(tmp_path, capsys):
    code, out, _ = _check_config(_write(tmp_path, ACCEPTED_TEXTS[2] + ACCEPTED_TEXTS[3].replace("monitor: ", "x: ")),
                                 capsys)
    assert code == 0
    assert yaml.safe_load(out)["monitor"]["train_state"]["device_loss"] is True


def test_catalogue_size():
    assert len(_value_cases()) + len(STRUCTURE_CASES) + len(BROKEN_FILES) >= 150


# Through a real `mindmon demo --config`: the same one line, before training starts; and a
# section set to null, which the overlay code must survive.
DEMO_CASES = [
    ('profiler: "on"\n', 1, "profiler: got 'on' (str); allowed: a mapping"),
    ("monitor: {tensorboard: x}\n", 1, "monitor.tensorboard: got 'x' (str); allowed: a mapping"),
    ("monitor:\n  train_state: [1\n", 1, "line 3: did not find expected ',' or ']'"),
    ("training: {max_norm: .nan}\n", 1, "training.max_norm: got nan (float)"),
]


@pytest.mark.parametrize("text, code, expected", DEMO_CASES, ids=[f"demo{i}" for i in range(len(DEMO_CASES))])
def test_demo_prints_config_errors_as_one_line(tmp_path, text, code, expected):
    path = _write(tmp_path, text)
    result = _demo(tmp_path, path)
    assert result.returncode == code
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mindmon: {path}: ") and expected in lines[0], result.stderr


def test_demo_survives_a_null_monitor_section(tmp_path):
    path = _write(tmp_path, {"monitor": None, "model": SMALL_MODEL})
    result = _demo(tmp_path, path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert "metrics (JSONL): none written on this rank" in result.stdout
    assert not (tmp_path / "out" / "monitor" / "rank_0" / "metrics.jsonl").exists()


def _demo(tmp_path, config):
    env = {k: v for k, v in os.environ.items() if k != "LOG_MF_PATH"}
    return subprocess.run([sys.executable, "-m", "mindmon.cli", "demo", "--steps", "1", "--output",
                           str(tmp_path / "out"), "--config", str(config)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)


# What `mindmon demo` itself reads, refused in this process before MindSpore starts.
DEMO_SECTION_CASES = [
    ({"training": None}, "training: got None (NoneType); allowed: a mapping"),
    ({"model": "tiny"}, "model: got 'tiny' (str); allowed: a mapping"),
    ({"training": {"steps": "x"}}, "training.steps: got 'x' (str); allowed: an int >= 1"),
    ({"training": {"global_batch_size": 0}}, "training.global_batch_size: got 0 (int); allowed: an int >= 1"),
    ({"model": {"num_layers": 2.5}}, "model.num_layers: got 2.5 (float); allowed: an int >= 1"),
    ({"model": {"mtp_num_layers": -1}}, "model.mtp_num_layers: got -1 (int); allowed: an int >= 0"),
    ({"monitor": None, "profiler": "on"}, "profiler: got 'on' (str)"),
    ({"monitor": {"tensorboard": "x"}}, "monitor.tensorboard: got 'x' (str)"),
    ({"monitor": {"tensorboard": {"tensorboard_dir": 3}}}, "monitor.tensorboard.tensorboard_dir: got 3 (int)"),
]


@pytest.mark.parametrize("raw, expected", DEMO_SECTION_CASES, ids=[f"demo_section{i}" for i in range(len(DEMO_SECTION_CASES))])
def test_demo_sections_refused_in_process(tmp_path, capsys, raw, expected):
    path = _write(tmp_path, raw)
    code = main(["demo", "--steps", "1", "--output", str(tmp_path / "out"), "--config", str(path)])
    _assert_one_clean_line(code, capsys.readouterr().err, f"mindmon: {path}: {expected}")
    assert not (tmp_path / "out").exists()


def test_demo_steps_must_be_positive(tmp_path, capsys):
    code = main(["demo", "--steps", "0", "--output", str(tmp_path / "out")])
    _assert_one_clean_line(code, capsys.readouterr().err, "configs/demo.yaml: --steps: got 0; allowed: a positive int")


def test_keys_of_different_types_are_not_duplicates(tmp_path, capsys):
    code, out, err = _check_config(_write(tmp_path, "model:\n  1: a\n  '1': b\n  true: c\n  'true': d\n"), capsys)
    assert (code, err) == (0, "")
