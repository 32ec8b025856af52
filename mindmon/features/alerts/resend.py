"""`mindmon alerts resend RUN_DIR [--config FILE]`: delivers what a run left in its spool files
(`<RUN_DIR>/anomaly_detected/rank<r>/spool/<recipient id>.jsonl`), oldest first; what was
delivered leaves the spool, what fails stays there. A database insert skips anomalies already
there (their key), so resending twice, or a spool whose first part had arrived, adds nothing twice.

The spool names its recipient with the password masked (a webhook with its URL's path and query
masked, since chat services put the bot's token there): such a recipient is taken from `--config` (the run's YAML with `monitor.alert`, or msprobe's config.json with `alert`).
"""
import glob
import json
import os
import sys
from typing import List, Optional

from mindmon.config import ConfigError
from mindmon.features.alerts.buffer import read_spool
from mindmon.features.alerts.inform import MASK, mask_secrets, parse_inform, recipient_id

SPOOL_PATTERN = os.path.join("**", "spool", "*.jsonl")


def add_arguments(parser) -> None:
    parser.add_argument("run_dir", help="the run's output folder (monitor.output_dir), or its anomaly_detected folder")
    parser.add_argument("-c", "--config", default=None,
                        help="the run's YAML (monitor.alert) or msprobe config.json (alert): the recipients' "
                             "passwords, which the spool does not hold")


def load_informs(path: str) -> tuple:
    """The recipients of the `alert` block in a YAML (`monitor.alert` or `alert`) or JSON file."""
    from mindmon.config import load_yaml

    if path.endswith(".json"):
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    else:
        data = load_yaml(path)
    if isinstance(data, dict) and isinstance(data.get("alert"), dict):
        return parse_inform("alert.inform", data["alert"].get("inform"))
    monitor = data.get("monitor") if isinstance(data, dict) else None
    if isinstance(monitor, dict) and isinstance(monitor.get("alert"), dict):
        return parse_inform("monitor.alert.inform", monitor["alert"].get("inform"))
    raise ConfigError(f"{path}: no alert block (monitor.alert in a YAML, alert in msprobe's config.json)")


def _inform_for(path: str, recipient: dict, informs: tuple):
    wanted = os.path.basename(path)[:-len(".jsonl")]
    for inform in informs:
        if recipient_id(inform) == wanted:
            return inform
    if MASK in json.dumps(recipient):
        return None
    recipient = {key: value for key, value in recipient.items() if key != "url_id"}   # a webhook's, not a key
    return parse_inform("spool", recipient)[0]


def resend_one(path: str, informs: tuple) -> Optional[str]:
    """Delivers one spool file; None when it was emptied, else why not (one line)."""
    from mindmon.features.alerts.buffer import DeliveryBuffer, Spool
    from mindmon.features.alerts.recipients import build_recipient

    recipient_dict, items = read_spool(path)
    inform = _inform_for(path, recipient_dict, informs)
    if inform is None:
        return (f"{path}: its recipient has a password, a signing secret or a token in its URL; give the run's "
                f"configuration with --config")
    try:
        recipient = build_recipient(inform, "inform")
    except ConfigError as error:   # the driver the URL names is not installed
        return f"{path}: {error}"
    buffer = DeliveryBuffer(0, Spool(path, len(items), inform.to_dict()))
    try:
        while True:
            batch = buffer.take(recipient.batch_limit)
            if not batch:
                break
            recipient.deliver(batch)
            buffer.done(len(batch))
            print(f"mindmon alerts: {len(batch)} anomalies delivered to {inform.describe()}")
    except Exception as error:
        return mask_secrets(f"{inform.describe()}: {type(error).__name__}: {error}", inform.secrets())
    finally:
        left, _ = buffer.finish()
        recipient.close()
    return None if left == 0 else f"{path}: {left} anomalies left"


def run(args) -> int:
    informs = ()
    try:
        if args.config:
            informs = load_informs(args.config)
    except (ConfigError, OSError) as error:
        print(f"mindmon: {args.config}: {error}", file=sys.stderr)
        return 1
    spools: List[str] = sorted(glob.glob(os.path.join(args.run_dir, SPOOL_PATTERN), recursive=True))
    if not spools:
        print(f"mindmon alerts: no spool files under {args.run_dir}: nothing to resend")
        return 0
    failures = [reason for reason in (resend_one(path, informs) for path in spools) if reason]
    for reason in failures:
        print(f"mindmon: {' '.join(reason.split())}", file=sys.stderr)
    return 1 if failures else 0
