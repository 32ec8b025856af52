"""The `mindmon` command.

    mindmon demo [--steps N] [--output DIR] [--config FILE] [--workers N]   train the embedded demo
    mindmon merge RUN_DIR [-o FILE.csv] [--factor F]           one table across ranks, outlier ranks flagged
    mindmon compact RUN_DIR                                    every rank's records in rank_<r>/metrics.parquet
    mindmon query RUN_DIR "SQL" [-o OUT]                       SQL over the run's records (the view `records`)
    mindmon check-config FILE.yaml                            validate and print the resolved sections
    mindmon report RUN_DIR [-o PAGE.html] [--rank R]           HTML page with PNG figures: across ranks, per rank
    mindmon parse-log LOGFILE -o DIR [--rank R]               a MindFormers training log -> DIR/rank_<r>/metrics.jsonl
    mindmon to-tensorboard RUN_DIR [-o DIR]                   JSONL -> DIR/rank_<r>/ event files
    mindmon profile-summary DIR [--top N] [--by type|name]    top operators by total time in a profiler trace
    mindmon anomalies -d DIR [-o OUT] [-k 8] [-s STEPS]       the first anomalies in time, across ranks
    mindmon alerts resend RUN_DIR [--config FILE]             deliver what a run left in its alert spool files
    mindmon csv2db RUN_DIR [-o DB] [--micro_step true|false]  msprobe CSV files -> msprobe's trend SQLite database

`python -m mindmon` is the same command. The live path (training) is in mindmon.core.group, .factory,
.step, .monitors, .sinks, .callbacks, .probes, .integrations; these commands use mindmon.analysis.
"""
import argparse
import contextlib
import os
import sys



def _check_config(args) -> int:
    from mindmon.config import ConfigError, describe_error, dump_sections, load_yaml
    from mindmon.features import parse_sections

    try:
        config = parse_sections(load_yaml(args.file))
        _check_callback_types(config)
        print(dump_sections(config), end="")
    except (ConfigError, OSError) as error:
        print(f"mindmon: {describe_error(args.file, error)}", file=sys.stderr)
        return 1
    return 0


def _check_callback_types(config) -> None:
    """With MindFormers installed, its registry names the callback types it knows."""
    if all(entry["type"] == "MaxLogitsMonitor" for entry in config.callbacks):
        return
    import tempfile

    os.environ.setdefault("LOG_MF_PATH", tempfile.mkdtemp(prefix="mindmon-check-config-"))  # its import logs
    try:
        from mindmon.integrations.mindformers import check_callback_types
    except ImportError:
        return
    quiet = open(os.devnull, "w")   # left open: MindFormers' console handlers keep the stream they were made with
    try:
        with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):   # its import logs warnings
            check_callback_types(config)
    except ImportError:
        print("mindmon: MindFormers is not installed here: callback types are not checked", file=sys.stderr)


def _demo(args) -> int:
    """Train the demo; a bad configuration is one line `mindmon: <file>: <message>` and exit 1.
    An OSError counts as the configuration's only while the files are read: later ones (a full
    disk) are not the config file's fault."""
    from mindmon.config import ConfigError
    from mindmon.demo.train import checked_config

    output = os.path.abspath(args.output)
    config_file = args.config and os.path.abspath(args.config)
    try:
        checked_config(config_file, args.steps, output)   # before msrun or MindSpore start
    except (ConfigError, OSError) as error:
        return _demo_config_error(args, error)
    try:
        return _demo_multi(args, output, config_file) if args.workers > 1 else _demo_single(args, output, config_file)
    except ConfigError as error:  # found when the Trainer is built (a group, a layer id the model lacks)
        return _demo_config_error(args, error)


def _demo_config_error(args, error) -> int:
    from mindmon.config import describe_error
    from mindmon.demo.train import default_config

    print(f"mindmon: {describe_error(args.config or default_config(), error)}", file=sys.stderr)
    return 1


def _demo_multi(args, output: str, config_file) -> int:
    from mindmon.demo.launch import launch

    from mindmon.demo.launch import lost_ranks

    code = launch(args.workers, output, args.steps, config_file)
    where = (f"per-rank outputs in {output}/monitor/rank_<r>, logs in {output}/log/rank_<r>" if code == 0
             else "see the worker logs")
    print(f"mindmon demo: {args.workers} workers exited with {code}; {where} and {output}/msrun/worker_<r>.log")
    if code:
        for note in lost_ranks(os.path.join(output, "msrun"), args.workers):
            print(f"mindmon demo: {note}", file=sys.stderr)
    return code


def _demo_single(args, output: str, config_file) -> int:
    # MindFormers picks its log directory when it is first imported.
    os.environ.setdefault("LOG_MF_PATH", os.path.join(output, "log"))
    from mindmon.demo.train import metrics_file, run

    config = run(config_file, steps=args.steps, output=output)
    print(f"mindmon demo: trained {config['training']['steps']} steps")
    metrics = metrics_file(config, int(os.environ.get("RANK_ID", "0")))
    print(f"  metrics (JSONL): {metrics}" if os.path.exists(metrics) else
          "  metrics (JSONL): none written on this rank (no monitor.train_state/moe_monitor/tensorboard, "
          "or monitor.ranks leaves it out)")
    print(f"  training log:    {os.environ['LOG_MF_PATH']}")
    return 0


def _analysis(command: str, run):
    """run() of an analysis command; a missing file, a bad option, a missing extra or an error of the
    engine (a bad query) is one line on stderr and exit code 1."""
    from mindmon.extras import MissingExtraError

    try:
        return run()
    except (FileNotFoundError, ValueError, MissingExtraError) as error:
        print(f"mindmon {command}: {str(error).replace('mindmon: ', '', 1)}", file=sys.stderr)
    except Exception as error:   # duckdb.Error: its classes exist only once the extra is imported
        if type(error).__module__.split(".")[0] not in ("duckdb", "_duckdb", "pyarrow"):
            raise
        print(f"mindmon {command}: {str(error).splitlines()[0]}", file=sys.stderr)
    return None


def _merge(args) -> int:
    from mindmon.analysis.merge import OUTLIER_RANK, merge

    if args.engine == "dask":
        from mindmon.analysis.dask_merge import merge_on_dask

        result = _analysis("merge", lambda: merge_on_dask(args.run_dir, args.output, args.factor, args.scheduler))
    else:
        result = _analysis("merge", lambda: merge(args.run_dir, args.output, args.factor, args.memory_limit,
                                                  args.source))
    if result is None:
        return 1
    path, flagged = result
    print(f"mindmon merge: wrote {path}; {len(flagged)} row(s) with a rank that stands out")
    for row in flagged[:10]:
        print(f"  step {row[2]} micro_step {row[3] if row[3] != '' else '-'} {row[0]} {row[1]}: rank {row[OUTLIER_RANK]} "
              f"(min {row[5]:.6g}, max {row[6]:.6g})")
    return 0


def _compact(args) -> int:
    from mindmon.analysis.compact import compact_run

    written = _analysis("compact", lambda: compact_run(args.run_dir, args.memory_limit))
    if written is None:
        return 1
    print(f"mindmon compact: {len(written)} rank(s) in rank_<r>/metrics.parquet under {args.run_dir}")
    return 0


def _query(args) -> int:
    from mindmon.analysis.query import run_query

    done = _analysis("query", lambda: run_query(args.run_dir, args.sql, args.output, args.memory_limit, args.source,
                                                args.threads))
    if done is None:
        return 1
    if args.output:
        print(f"mindmon query: wrote {done}", file=sys.stderr)
    return 0


def _engine_arguments(parser, threads: bool = False) -> None:
    from mindmon.analysis.sql import DEFAULT_MEMORY_LIMIT, SOURCES

    parser.add_argument("--memory-limit", default=DEFAULT_MEMORY_LIMIT,
                        help=f"DuckDB's memory_limit; what does not fit spills to a temporary folder "
                             f"(default: {DEFAULT_MEMORY_LIMIT})")
    parser.add_argument("--source", choices=SOURCES, default="auto",
                        help="read the columnar files, the JSONL, or (auto) the columnar where a rank has them")
    if threads:
        parser.add_argument("--threads", type=int, default=None, help="DuckDB threads (default: every core)")


def _add_engine_commands(commands) -> None:
    compact = commands.add_parser("compact", help="write every rank's records to rank_<r>/metrics.parquet (from "
                                  "its metrics.jsonl, or the Arrow stream a killed run left)")
    compact.add_argument("run_dir", help="the run's output (monitor.output_dir, the demo's --output)")
    compact.add_argument("--memory-limit", default="1GB", help="DuckDB's memory_limit (default: 1GB)")
    compact.set_defaults(handler=_compact)
    query = commands.add_parser("query", help="run SQL over the run's records, the view `records` (docs/outputs.md)")
    query.add_argument("run_dir", help="the run's output (monitor.output_dir, the demo's --output)")
    query.add_argument("sql", help='e.g. "SELECT rank, max(value) FROM records WHERE kind = \'local_loss\' GROUP BY rank"')
    query.add_argument("-o", "--output", default=None,
                       help="CSV, .parquet or .json file to write (default: CSV on standard output)")
    _engine_arguments(query, threads=True)
    query.set_defaults(handler=_query)


def _profile_summary(args) -> int:
    from mindmon.analysis.profile_summary import NoProfileData, format_trace, summarize

    try:
        traces = summarize(args.dir, by=args.by)
    except NoProfileData as error:
        print(f"mindmon: {error}", file=sys.stderr)
        return 1
    print("\n\n".join(format_trace(trace, top=args.top, by=args.by) for trace in traces))
    return 0


def _report(args) -> int:
    from mindmon.analysis.report import write_report

    output = args.output or os.path.join(args.run_dir if os.path.isdir(args.run_dir) else ".", "report.html")
    written = _analysis("report", lambda: write_report(args.run_dir, output, ranks=args.rank,
                                                       memory_limit=args.memory_limit, source=args.source))
    if written is None:
        return 1
    print(f"mindmon report: wrote {written}")
    return 0


def _parse_log(args) -> int:
    from mindmon.analysis.parse_log import parse_log

    try:
        counts = parse_log(args.logfile, args.output, rank=args.rank)
    except OSError as error:
        print(f"mindmon: {error}", file=sys.stderr)
        return 1
    print(f"mindmon parse-log: {counts.lines} lines -> {counts.records} records in {args.output}; "
          f"skipped {counts.other} lines without monitor data and {counts.malformed} unreadable monitor-like lines")
    for line in counts.first_malformed:
        print(f"  unreadable: {line}", file=sys.stderr)
    return 0


def _to_tensorboard(args) -> int:
    from mindmon.analysis.to_tensorboard import convert

    output = args.output or os.path.join(args.run_dir if os.path.isdir(args.run_dir) else ".", "tensorboard")
    written = _analysis("to-tensorboard", lambda: convert(args.run_dir, output, memory_limit=args.memory_limit,
                                                         source=args.source))
    if written is None:
        return 1
    print(f"mindmon to-tensorboard: wrote {', '.join(written)}; view with: tensorboard --logdir {output}")
    return 0


def _add_anomalies(commands) -> None:
    from mindmon.features.alerts import analyse

    anomalies = commands.add_parser("anomalies", help="order the anomalies dumped by the alert rules "
                                    "(anomaly_detected/rank<r>/anomaly.json) first in time, across ranks, and "
                                    "write the top k to anomaly_analyse.json")
    analyse.add_arguments(anomalies)
    anomalies.set_defaults(handler=analyse.run)


def _add_alerts(commands) -> None:
    from mindmon.features.alerts import resend

    alerts = commands.add_parser("alerts", help="alert delivery: `resend` what a run left in its spool files")
    actions = alerts.add_subparsers(dest="alerts_command", required=True)
    again = actions.add_parser("resend", help="deliver the anomalies a run could not deliver "
                               "(anomaly_detected/rank<r>/spool/*.jsonl), oldest first; delivered ones leave the spool")
    resend.add_arguments(again)
    again.set_defaults(handler=resend.run)


def _add_csv2tensorboard(commands) -> None:
    from mindmon.msprobe import csv2tb

    convert = commands.add_parser("csv2tensorboard", help="TensorBoard event files from msprobe monitor CSV files "
                                  "(csv2tensorboard_by_step)")
    csv2tb.add_arguments(convert)
    convert.set_defaults(handler=csv2tb.run)


def _add_csv2db(commands) -> None:
    from mindmon.msprobe import csv2db

    convert = commands.add_parser("csv2db", help="a run's msprobe monitor CSV files (TrainerMon and TrainerMonitorV2) "
                                  "in one SQLite database of msprobe's trend schema")
    csv2db.add_arguments(convert)
    convert.set_defaults(handler=csv2db.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mindmon", description="Training monitors for MindSpore/MindFormers.")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_run_commands(commands)
    _add_engine_commands(commands)
    _add_offline_commands(commands)
    _add_anomalies(commands)
    _add_alerts(commands)
    _add_csv2tensorboard(commands)
    _add_csv2db(commands)
    return parser


def _add_run_commands(commands) -> None:
    """demo, merge, check-config."""
    demo = commands.add_parser("demo", help="train the embedded MoE GPT demo through the stock MindFormers Trainer")
    demo.add_argument("--steps", type=int, default=None, help="training steps (default: the YAML's, 20)")
    demo.add_argument("--output", default="./output", help="where logs and metrics go (default: ./output)")
    demo.add_argument("--workers", type=int, default=1,
                      help="data-parallel processes, started with msrun (default: 1, this process)")
    demo.add_argument("--config", default=None, help="YAML laid over the shipped configs/demo.yaml: its sections replace the demo's, two levels deep (e.g. a file with only monitor: or profiler:)")
    demo.set_defaults(handler=_demo)
    merge = commands.add_parser("merge", help="one CSV across ranks: min, max, mean and the rank of the max per "
                                "metric and step; flags a rank whose local loss or norm stands out")
    merge.add_argument("run_dir", help="the run's output (monitor.output_dir, the demo's --output)")
    merge.add_argument("-o", "--output", default=None, help="CSV to write (default: RUN_DIR/merged.csv)")
    merge.add_argument("--factor", type=float, default=5.0,
                       help="flag a local_loss/micro_norm above FACTOR x the median of the other ranks (default: 5)")
    _engine_arguments(merge)
    merge.add_argument("--engine", choices=("duckdb", "dask"), default="duckdb",
                       help="duckdb (embedded, this machine) or dask (a Dask cluster, over the Parquet files)")
    merge.add_argument("--scheduler", default=None,
                       help="with --engine dask: the scheduler's address (default: a LocalCluster of 2 workers here)")
    merge.set_defaults(handler=_merge)
    check = commands.add_parser("check-config", help="validate the monitor/profiler/callbacks sections of a YAML")
    check.add_argument("file")
    check.set_defaults(handler=_check_config)


def _add_offline_commands(commands) -> None:
    """profile-summary, report, parse-log, to-tensorboard."""
    summary = commands.add_parser("profile-summary", help="print the operators that took the most time in the "
                                  "profiler output under DIR (output_path, rank_<r> or one *_ascend_ms trace folder)")
    summary.add_argument("dir")
    summary.add_argument("--top", type=int, default=10, help="how many operators to print per trace (default: 10)")
    summary.add_argument("--by", choices=("type", "name"), default="type",
                         help="group by operator type (MatMul) or by full operator name (default: type)")
    summary.set_defaults(handler=_profile_summary)
    report = commands.add_parser("report", help="self-contained HTML page with PNG figures from a run's "
                                 "rank_<r>/metrics.jsonl (works while the run is going)")
    report.add_argument("run_dir", help="the run's output (monitor.output_dir, the demo's --output) or one metrics.jsonl")
    report.add_argument("-o", "--output", default=None, help="page to write (default: RUN_DIR/report.html)")
    report.add_argument("--rank", type=int, action="append", default=None,
                        help="a rank to draw in detail (repeatable; default: every rank of a run of at most 8)")
    _engine_arguments(report)
    report.set_defaults(handler=_report)
    parse = commands.add_parser("parse-log", help="read a MindFormers training log (LossCallback, monitor and "
                                "max-logit lines) into mindmon's JSONL records")
    parse.add_argument("logfile")
    parse.add_argument("-o", "--output", required=True, help="writes OUTPUT/rank_<r>/metrics.jsonl")
    parse.add_argument("--rank", type=int, default=None,
                       help="rank of the log (default: from rank_<r>/worker_<r> in its path, else 0)")
    parse.set_defaults(handler=_parse_log)
    convert = commands.add_parser("to-tensorboard", help="TensorBoard event files from a run's JSONL")
    convert.add_argument("run_dir", help="the run's output (monitor.output_dir, the demo's --output) or one metrics.jsonl")
    convert.add_argument("-o", "--output", default=None, help="event directory (default: RUN_DIR/tensorboard)")
    _engine_arguments(convert)
    convert.set_defaults(handler=_to_tensorboard)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
