"""The configuration core: the checks every section uses (one wording for every error), the core sections
(`monitor`'s own keys, `callbacks`), reading a YAML file. It imports no feature: each feature parses its
own section with these checks, and `mindmon.parse_sections` hands the registered features to
`parse_config`."""
from mindmon.config.checks import (ConfigError, ConfigTypeError, check_bool, check_directory, check_int, check_keys,
                                   check_one_of, check_positive_number, describe, describe_error, is_int, is_number,
                                   key_path, parse_ranks, short_repr, type_error, value_error)
from mindmon.config.filters import ParamFilter
from mindmon.config.fields import Section, setting
from mindmon.config.sections import (DEFAULT_OUTPUT_DIR, MAX_TENSORBOARD_QUEUE, PASSTHROUGH_MONITOR_KEYS, METRICS_FORMATS, MindmonConfig, MonitorConfig, OnOffSection,
                                     TensorBoardConfig, check_max_norm, dump_sections, parse_callbacks, parse_config)
from mindmon.config.yaml_file import ConfigFileError, load_yaml, read_yaml

__all__ = ["MAX_TENSORBOARD_QUEUE", "Section", "setting", "METRICS_FORMATS", "ConfigError", "ConfigFileError", "ConfigTypeError", "DEFAULT_OUTPUT_DIR", "MindmonConfig", "MonitorConfig", "OnOffSection",
           "PASSTHROUGH_MONITOR_KEYS", "ParamFilter", "TensorBoardConfig", "check_bool", "check_directory",
           "check_int", "check_keys", "check_max_norm", "check_one_of", "check_positive_number", "describe",
           "describe_error", "dump_sections", "is_int", "is_number", "key_path", "load_yaml", "parse_callbacks",
           "parse_config", "parse_ranks", "read_yaml", "short_repr", "type_error", "value_error"]
