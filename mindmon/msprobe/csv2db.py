"""`mindmon csv2db RUN_DIR [-o DB] [--micro_step true|false]`: a run's msprobe-format CSV files (TrainerMon's
`<point>_<first>-<last>.csv` in `*-rank<r>-*` folders, TrainerMonitorV2's `<slug>_step<first>-<last>.csv` in
`rank_<r>` folders) into one SQLite database in msprobe's trend schema (its `csv2db`/`data2db`: tables
monitoring_metrics, monitoring_targets, monitoring_tags, tag_target_mapping, global_stats, trend_data), so
msprobe's readers and trend viewer open it.

The rules are msprobe's: metrics in msprobe's order of supported metrics, statistics likewise; a target is
(name, vpp_stage, micro_step); with `--micro_step true` (the default) a target's micro_step is 0 and the
step axis counts micro-steps (a step's first micro-step at the sum of the earlier steps' micro-step counts);
values beyond +-1e9 clipped, infinities just past them. monitor_v2's files become the metrics they hold:
weight_grad `unreduced`/`reduced` -> grad_unreduced/grad_reduced, param -> param_origin/param_updated,
optimizer -> exp_avg/exp_avg_sq (named by the parameter), module `forward`/`backward` -> actv/actv_grad;
their 1-based micro-steps count from 0 here, as TrainerMon's do.

Example:
    mindmon csv2db monitor_output            # -> monitor_output/monitor_data.trend.db
"""
import argparse
import csv
import os
import re
import sqlite3
import sys
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

DB_FILE = "monitor_data.trend.db"
METRICS = ("actv", "actv_grad", "exp_avg", "exp_avg_sq", "grad_unreduced", "grad_reduced", "param_origin",
           "param_updated", "other")
STATISTICS = ("norm", "min", "max", "zeros", "nans", "mean", "entropy", "softmax_max", "entropy_mean",
              "softmax_max_mean", "sr", "kernel_norm", "std_x", "jacobian", "proxy", "token_similarity")
V2_METRICS = {("weight_grad", "unreduced"): "grad_unreduced", ("weight_grad", "reduced"): "grad_reduced",
              ("param", "param_origin"): "param_origin", ("param", "param_updated"): "param_updated",
              ("optimizer", "exp_avg"): "exp_avg", ("optimizer", "exp_avg_sq"): "exp_avg_sq",
              ("module", "forward"): "actv", ("module", "backward"): "actv_grad"}
LIMIT = 1e9
V1_FOLDER = re.compile(r"([\w-]{0,20})-rank(\d{1,5})-")
V2_FOLDER = re.compile(r"^rank_(\d+)$")
V1_FILE = re.compile(r"^(?P<metric>.+)_(\d+)-(\d+)\.csv$")
V2_FILE = re.compile(r"^(?P<slug>[A-Za-z_]+)_step(-?\d+)-(-?\d+)\.csv$")

SCHEMA = """
CREATE TABLE IF NOT EXISTS monitoring_targets (
    target_id INTEGER PRIMARY KEY AUTOINCREMENT, target_name TEXT NOT NULL, vpp_stage INTEGER NOT NULL,
    micro_step INTEGER NOT NULL DEFAULT 0, UNIQUE(target_name, vpp_stage, micro_step));
CREATE TABLE IF NOT EXISTS monitoring_metrics (
    metric_id INTEGER PRIMARY KEY AUTOINCREMENT, metric_name TEXT UNIQUE NOT NULL);
CREATE TABLE IF NOT EXISTS monitoring_tags (
    tag_id INTEGER PRIMARY KEY AUTOINCREMENT, tag_name TEXT NOT NULL, category TEXT NOT NULL,
    metric_id INTEGER NOT NULL, UNIQUE(tag_name, category, metric_id),
    FOREIGN KEY (metric_id) REFERENCES monitoring_metrics(metric_id));
CREATE TABLE IF NOT EXISTS tag_target_mapping (
    tag_id INTEGER NOT NULL, target_id INTEGER NOT NULL, PRIMARY KEY (tag_id, target_id),
    FOREIGN KEY (tag_id) REFERENCES monitoring_tags(tag_id),
    FOREIGN KEY (target_id) REFERENCES monitoring_target(target_id));
"""


@dataclass
class Row:
    rank: int
    metric: str
    name: str
    vpp_stage: int
    step: int
    micro_step: int
    values: Dict[str, Optional[float]]


@dataclass
class Scan:
    """What the database's dimension tables hold, gathered over every rank's files."""

    targets: Dict[str, Dict[Tuple[str, int, int], None]] = field(default_factory=dict)
    statistics: Dict[str, set] = field(default_factory=dict)
    micro_steps: Dict[int, int] = field(default_factory=dict)   # step -> its micro-step count
    steps: List[int] = field(default_factory=list)
    max_rank: int = 0


def rank_folders(run_dir: str) -> List[Tuple[int, str]]:
    """(rank, folder) of every TrainerMon run folder and TrainerMonitorV2 rank folder below run_dir."""
    found = []
    for root, folders, _ in os.walk(run_dir):
        for name in sorted(folders):
            v1, v2 = V1_FOLDER.search(name), V2_FOLDER.match(name)
            if v1 or v2:
                found.append((int((v1 or v2).group(2) if v1 else v2.group(1)), os.path.join(root, name)))
    return sorted(found)


def value(text: str) -> Optional[float]:
    """msprobe's clipping of a statistic: +-1e9 at most, infinities just past it, text that is no number None."""
    try:
        number = float(text.strip())
    except ValueError:
        return None
    if number == float("inf"):
        return LIMIT + 1
    if number == float("-inf"):
        return -LIMIT - 1
    return max(-LIMIT, min(LIMIT, number))


def read_rows(rank: int, path: str) -> Iterator[Row]:
    name = os.path.basename(path)
    v2, v1 = V2_FILE.match(name), V1_FILE.match(name)
    if v2 is None and (v1 is None or v1.group("metric") not in METRICS):
        return
    with open(path, newline="", encoding="utf-8") as handle:
        for fields in csv.DictReader(handle):
            row = _v2_row(rank, v2.group("slug"), fields) if v2 else _v1_row(rank, v1.group("metric"), fields)
            if row is not None:
                yield row


def _ints(fields: dict, *keys) -> Optional[List[int]]:
    try:
        return [int(fields.get(key) or 0) if key == "micro_step" else int(fields[key]) for key in keys]
    except (KeyError, TypeError, ValueError):
        return None   # a row msprobe would skip (cc rows have no vpp_stage)


def _statistics(fields: dict) -> Dict[str, Optional[float]]:
    return {op: value(fields[op]) for op in STATISTICS if fields.get(op) is not None}


def _v1_row(rank: int, metric: str, fields: dict) -> Optional[Row]:
    numbers = _ints(fields, "vpp_stage", "step", "micro_step")
    if numbers is None or "name" not in fields:
        return None
    return Row(rank, metric, fields["name"], *numbers, _statistics(fields))


def _v2_row(rank: int, slug: str, fields: dict) -> Optional[Row]:
    metric = V2_METRICS.get((slug, fields.get("scope")))
    numbers = _ints(fields, "vpp_stage", "step", "micro_step")
    if metric is None or numbers is None:
        return None
    name = fields.get("module_name", "")
    if metric in ("exp_avg", "exp_avg_sq"):   # `exp_avg.fc1.weight.exp_avg` -> fc1.weight
        name = name[len(metric) + 1:-len(metric) - 1] if name.startswith(metric + ".") else name
    vpp_stage, step, micro_step = numbers
    return Row(rank, metric, name, vpp_stage, step, max(micro_step - 1, 0), _statistics(fields))


def all_rows(run_dir: str) -> List[Row]:
    rows = []
    for rank, folder in rank_folders(run_dir):
        for name in sorted(os.listdir(folder)):
            rows += read_rows(rank, os.path.join(folder, name))
    return rows


def scan(rows: List[Row], micro_step: bool) -> Scan:
    found = Scan()
    for row in rows:
        found.statistics.setdefault(row.metric, set()).update(row.values)
        if micro_step:
            found.micro_steps[row.step] = max(found.micro_steps.get(row.step, 0), row.micro_step + 1)
        found.steps.append(row.step)
        target = (row.name, row.vpp_stage, 0 if micro_step else row.micro_step)
        found.targets.setdefault(row.metric, {})[target] = None
        found.max_rank = max(found.max_rank, row.rank)
    return found


def first_micro_steps(found: Scan) -> Tuple[int, int, Dict[int, int]]:
    """(min_step, max_step, {step: the step-axis index of its first micro-step})."""
    offsets, total = {}, 0
    for step, count in sorted(found.micro_steps.items()):
        offsets[step], total = total, total + count
    return 0, total - 1, offsets


def ordered(names, order) -> List[str]:
    return [name for name in order if name in names]


def tags_of(target: str) -> set:
    """msprobe's tags of a target name: each non-numeric part a module tag, `<part>.<n>` a layer tag."""
    parts = target.split(".")[::-1]
    tags = set()
    for i, part in enumerate(parts):
        if not part.isdigit():
            tags.add((part, "module"))
        elif i < len(parts) - 1 and not parts[i + 1].isdigit():
            tags.add((f"{parts[i + 1]}.{part}", "layer"))
    return tags


def write_database(rows: List[Row], path: str, micro_step: bool = True) -> int:
    """The database of these rows at `path` (replaced); returns the number of trend rows."""
    found = scan(rows, micro_step)
    if micro_step:
        min_step, max_step, offsets = first_micro_steps(found)
    else:
        min_step, max_step, offsets = min(found.steps, default=0), max(found.steps, default=0), {}
    if os.path.exists(path):
        os.remove(path)
    con = sqlite3.connect(path)
    try:
        con.executescript(SCHEMA)
        metrics = ordered(found.targets, METRICS)
        for metric in metrics:
            con.executemany("INSERT OR IGNORE INTO monitoring_targets (target_name, vpp_stage, micro_step) "
                            "VALUES (?, ?, ?)", list(found.targets[metric]))
        con.executemany("INSERT OR IGNORE INTO monitoring_metrics (metric_name) VALUES (?)", [(m,) for m in metrics])
        _global_stats(con, min_step, max_step, found.max_rank, {m: found.statistics[m] for m in metrics})
        statistics = ordered(set().union(*found.statistics.values()), STATISTICS)
        con.execute("CREATE TABLE IF NOT EXISTS trend_data (rank INTEGER NOT NULL, step INTEGER NOT NULL, "
                    "target_id INTEGER NOT NULL, metric_id INTEGER NOT NULL, "
                    + "".join(f"{op} REAL DEFAULT NULL, " for op in statistics)
                    + "PRIMARY KEY (rank, step, target_id, metric_id), "
                    "FOREIGN KEY (target_id) REFERENCES monitoring_targets(target_id), "
                    "FOREIGN KEY (metric_id) REFERENCES monitoring_metrics(metric_id)) WITHOUT ROWID")
        metric_ids = dict(con.execute("SELECT metric_name, metric_id FROM monitoring_metrics"))
        target_ids = {(n, v, m): i for i, n, v, m in
                      con.execute("SELECT target_id, target_name, vpp_stage, micro_step FROM monitoring_targets")}
        _tags(con, found, metric_ids, target_ids)
        trend = [(row.rank, offsets.get(row.step, 0) + row.micro_step if micro_step else row.step,
                  target_ids[(row.name, row.vpp_stage, 0 if micro_step else row.micro_step)], metric_ids[row.metric],
                  *[row.values.get(op) for op in statistics]) for row in rows]
        before = con.total_changes
        con.executemany(f"INSERT OR IGNORE INTO trend_data VALUES ({', '.join('?' * (4 + len(statistics)))})", trend)
        con.commit()
        return con.total_changes - before
    finally:
        con.close()


def _global_stats(con, min_step: int, max_step: int, max_rank: int, statistics: Dict[str, set]) -> None:
    columns = ["min_step INTEGER DEFAULT 0", "max_step INTEGER DEFAULT 0", "max_rank INTEGER DEFAULT 0"]
    columns += [f"{metric} TEXT DEFAULT NULL" for metric in statistics]
    con.execute(f"CREATE TABLE IF NOT EXISTS global_stats ({', '.join(columns)})")
    values = [min_step, max_step, max_rank] + [",".join(ordered(ops, STATISTICS)) for ops in statistics.values()]
    con.execute(f"INSERT INTO global_stats VALUES ({', '.join('?' * len(values))})", values)


def _tags(con, found: Scan, metric_ids: Dict[str, int], target_ids: Dict[tuple, int]) -> None:
    for metric, targets in found.targets.items():
        metric_id = metric_ids[metric]
        target_tags = {target_ids[target]: tags_of(target[0]) for target in targets}
        every = set().union(*target_tags.values())
        con.executemany("INSERT OR IGNORE INTO monitoring_tags (tag_name, category, metric_id) VALUES (?, ?, ?)",
                        [(name, category, metric_id) for name, category in sorted(every)])
        tag_ids = {(n, c): i for i, n, c in con.execute(
            "SELECT tag_id, tag_name, category FROM monitoring_tags WHERE metric_id = ?", (metric_id,))}
        con.executemany("INSERT OR IGNORE INTO tag_target_mapping (target_id, tag_id) VALUES (?, ?)",
                        [(target_id, tag_ids[tag]) for target_id, tags in target_tags.items() for tag in tags])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="the monitor output folder (TrainerMon's run folders and/or "
                        "TrainerMonitorV2's rank_<r> folders below it)")
    parser.add_argument("-o", "--output", default=None, help=f"the database file (default: RUN_DIR/{DB_FILE})")
    parser.add_argument("--micro_step", type=str.lower, choices=["true", "false"], default="true",
                        help="count the step axis in micro-steps, as msprobe does by default (default: true)")


def run(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.run_dir):
        print(f"mindmon csv2db: {args.run_dir}: no such folder", file=sys.stderr)
        return 1
    rows = all_rows(args.run_dir)
    if not rows:
        print(f"mindmon csv2db: no msprobe monitor CSV rows under {args.run_dir} (folders *-rank<r>-* or rank_<r>)",
              file=sys.stderr)
        return 1
    path = args.output or os.path.join(args.run_dir, DB_FILE)
    inserted = write_database(rows, path, args.micro_step == "true")
    print(f"{inserted} rows of {len({(r.rank) for r in rows})} rank(s) -> {path}")
    return 0
