"""The `monitor.trackers` section: which experiment trackers (MLflow, SwanLab, W&B) get the run's values,
and the Prometheus endpoint (docs/trackers.md). Parsing imports none of the trackers."""
from dataclasses import dataclass, fields
from typing import Any, Optional

from mindmon.config import check_bool, check_int, check_keys, check_one_of, check_positive_number, type_error

PATH = "monitor.trackers"
DEFAULT_PROJECT = "mindmon"
DEFAULT_CLOSE_TIMEOUT = 30.0


def _text(path: str, value: Any, allowed: str = "a non-empty string") -> str:
    if not isinstance(value, str) or not value or "\0" in value:
        raise type_error(path, value, allowed)
    return value


def _optional_text(path: str, section: dict, key: str) -> Optional[str]:
    value = section.get(key)
    return None if value is None else _text(f"{path}.{key}", value)


def _close_timeout(path: str, section: dict) -> float:
    if section.get("close_timeout") is None:
        return DEFAULT_CLOSE_TIMEOUT
    return check_positive_number(f"{path}.close_timeout", section["close_timeout"])


class _Dict:
    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class MlflowConfig(_Dict):
    tracking_uri: str
    """The tracking server (`http://host:5000`) or store (`sqlite:///mlruns.db`, a folder)."""
    experiment: str = DEFAULT_PROJECT
    run_name: Optional[str] = None
    artifacts: bool = True
    """At close: the HTML report (needs mindmon[analysis,report]) and the anomaly dumps as the run's artifacts."""
    close_timeout: float = DEFAULT_CLOSE_TIMEOUT

    KEYS = ("tracking_uri", "experiment", "run_name", "artifacts", "close_timeout")

    @classmethod
    def parse(cls, path: str, section: Any) -> "MlflowConfig":
        section = check_keys(path, section, cls.KEYS)
        if section.get("tracking_uri") is None:
            raise type_error(f"{path}.tracking_uri", section.get("tracking_uri"),
                             "the tracking server's URI (http://host:port) or a store URI")
        return cls(_text(f"{path}.tracking_uri", section["tracking_uri"]),
                   _optional_text(path, section, "experiment") or DEFAULT_PROJECT,
                   _optional_text(path, section, "run_name"),
                   check_bool(f"{path}.artifacts", section.get("artifacts", True)),
                   _close_timeout(path, section))


SWANLAB_MODES = ("offline", "local")


@dataclass(frozen=True)
class SwanlabConfig(_Dict):
    project: str = DEFAULT_PROJECT
    experiment: Optional[str] = None
    mode: str = "offline"
    """offline: files for a later `swanlab sync`; local: files only, read by SwanLab's local tools."""
    log_dir: Optional[str] = None
    """Default: `<monitor.output_dir>/swanlog`."""
    close_timeout: float = DEFAULT_CLOSE_TIMEOUT

    KEYS = ("project", "experiment", "mode", "log_dir", "close_timeout")

    @classmethod
    def parse(cls, path: str, section: Any) -> "SwanlabConfig":
        section = check_keys(path, section, cls.KEYS)
        return cls(_optional_text(path, section, "project") or DEFAULT_PROJECT,
                   _optional_text(path, section, "experiment"),
                   check_one_of(f"{path}.mode", section.get("mode", "offline"), SWANLAB_MODES),
                   _optional_text(path, section, "log_dir"), _close_timeout(path, section))


@dataclass(frozen=True)
class WandbConfig(_Dict):
    project: str = DEFAULT_PROJECT
    run_name: Optional[str] = None
    dir: Optional[str] = None
    """Where `wandb/offline-run-*` goes; default: `monitor.output_dir`. Upload later with `wandb sync`."""
    close_timeout: float = DEFAULT_CLOSE_TIMEOUT

    KEYS = ("project", "run_name", "dir", "close_timeout")

    @classmethod
    def parse(cls, path: str, section: Any) -> "WandbConfig":
        section = check_keys(path, section, cls.KEYS)
        return cls(_optional_text(path, section, "project") or DEFAULT_PROJECT,
                   _optional_text(path, section, "run_name"), _optional_text(path, section, "dir"),
                   _close_timeout(path, section))


@dataclass(frozen=True)
class PrometheusConfig(_Dict):
    port: int
    """0: a free port, chosen when the run opens (logged)."""
    addr: str = "0.0.0.0"

    KEYS = ("port", "addr")

    @classmethod
    def parse(cls, path: str, section: Any) -> "PrometheusConfig":
        section = check_keys(path, section, cls.KEYS)
        port = check_int(f"{path}.port", section.get("port"), 0, 65535)
        return cls(port, _text(f"{path}.addr", section.get("addr", "0.0.0.0"), "an address to listen on (a string)"))


@dataclass(frozen=True)
class TrackersConfig:
    mlflow: Optional[MlflowConfig] = None
    swanlab: Optional[SwanlabConfig] = None
    wandb: Optional[WandbConfig] = None
    prometheus: Optional[PrometheusConfig] = None

    PARSERS = {"mlflow": MlflowConfig, "swanlab": SwanlabConfig, "wandb": WandbConfig, "prometheus": PrometheusConfig}

    @property
    def active(self) -> bool:
        return any(getattr(self, key) is not None for key in self.PARSERS)

    @classmethod
    def parse(cls, path: str, section: Any) -> Optional["TrackersConfig"]:
        if section is None:
            return None
        section = check_keys(path, section, tuple(cls.PARSERS))
        # a present key switches its tracker on; `wandb:` with no value means "with the defaults"
        return cls(**{key: parser.parse(f"{path}.{key}", section[key])
                      for key, parser in cls.PARSERS.items() if key in section})

    def to_dict(self) -> dict:
        return {key: None if getattr(self, key) is None else getattr(self, key).to_dict() for key in self.PARSERS}
