"""The `monitor.trackers` section: which experiment trackers (MLflow, SwanLab, W&B) get the run's values,
and the Prometheus endpoint (docs/trackers.md). Parsing imports none of the trackers."""
from dataclasses import dataclass
from typing import Any, Optional

from mindmon.config import Section, setting, type_error
from mindmon.config.fields import (Check, boolean, custom, integer, keys_of, nested, one_of, parse_section, positive_number,
                                   text)

PATH = "monitor.trackers"
DEFAULT_PROJECT = "mindmon"
DEFAULT_CLOSE_TIMEOUT = 30.0


def _tracking_uri(path: str, value: Any) -> str:
    if value is None:
        raise type_error(path, value, "the tracking server's URI (http://host:port) or a store URI")
    return text().run(path, value)


def _named(default: Optional[str]) -> Check:
    """A name; `key: ~` keeps `default`."""
    return custom("str", lambda path, value: default if value is None else text().run(path, value))


def _close_timeout() -> Check:
    return custom("number > 0 (seconds)", lambda path, value: DEFAULT_CLOSE_TIMEOUT if value is None
                  else positive_number().run(path, value))


@dataclass(frozen=True)
class MlflowConfig(Section):
    tracking_uri: str = setting(check=custom("str", _tracking_uri), shown_default="required")
    """The tracking server (`http://host:5000`) or a store URI (`sqlite:///mlflow.db`, a folder)."""

    experiment: str = setting(DEFAULT_PROJECT, _named(DEFAULT_PROJECT))
    """The experiment, created when missing."""

    run_name: Optional[str] = setting(None, _named(None), shown_default="MLflow's")
    """The run's name."""

    artifacts: bool = setting(True, boolean())
    """At close, upload the HTML report (needs `mindmon[analysis,report]`) and each rank's anomaly dump as
    the run's artifacts."""

    close_timeout: float = setting(DEFAULT_CLOSE_TIMEOUT, _close_timeout())
    """At train end, how long to wait for MLflow to take what is queued."""


SWANLAB_MODES = ("offline", "local")


@dataclass(frozen=True)
class SwanlabConfig(Section):
    project: str = setting(DEFAULT_PROJECT, _named(DEFAULT_PROJECT))
    """SwanLab's project."""

    experiment: Optional[str] = setting(None, _named(None), shown_default="SwanLab's")
    """The run's name."""

    mode: str = setting("offline", one_of(SWANLAB_MODES))
    """Files only: `offline` ones are uploaded later by `swanlab sync <run folder>`; `local` ones are read by
    SwanLab's local tools."""

    log_dir: Optional[str] = setting(None, _named(None), shown_default="`<output_dir>/swanlog`")
    """Where SwanLab's run folders go."""

    close_timeout: float = setting(DEFAULT_CLOSE_TIMEOUT, _close_timeout())
    """At train end, how long to wait for SwanLab to take what is queued."""


@dataclass(frozen=True)
class WandbConfig(Section):
    project: str = setting(DEFAULT_PROJECT, _named(DEFAULT_PROJECT))
    """W&B's project."""

    run_name: Optional[str] = setting(None, _named(None), shown_default="W&B's")
    """The run's name."""

    dir: Optional[str] = setting(None, _named(None), shown_default="`<output_dir>`")
    """W&B writes `<dir>/wandb/offline-run-*`, uploaded later by `wandb sync`."""

    close_timeout: float = setting(DEFAULT_CLOSE_TIMEOUT, _close_timeout())
    """At train end, how long to wait for W&B to take what is queued."""


@dataclass(frozen=True)
class PrometheusConfig(Section):
    port: int = setting(check=integer(0, 65535), shown_default="required")
    """The endpoint's port (`0`: a free one, chosen when the run opens and logged)."""

    addr: str = setting("0.0.0.0", text("an address to listen on (a string)"))
    """The address it listens on."""


@dataclass(frozen=True)
class TrackersConfig(Section):
    """A tracker's key present switches it on (`wandb:` with no value: W&B with its defaults)."""

    mlflow: Optional[MlflowConfig] = setting(None, nested(MlflowConfig))
    swanlab: Optional[SwanlabConfig] = setting(None, nested(SwanlabConfig))
    wandb: Optional[WandbConfig] = setting(None, nested(WandbConfig))
    prometheus: Optional[PrometheusConfig] = setting(None, nested(PrometheusConfig))

    @property
    def active(self) -> bool:
        return any(getattr(self, key) is not None for key in keys_of(TrackersConfig))

    @classmethod
    def parse(cls, path: str, raw: Any) -> Optional["TrackersConfig"]:
        return None if raw is None else parse_section(cls, path, raw)
