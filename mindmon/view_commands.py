"""The `mindmon` subcommands that turn a run's records into something to look at:

    mindmon report RUN_DIR [-o PAGE.html]          HTML page with PNG figures, from the JSONL
    mindmon parse-log LOGFILE -o DIR [--rank R]    a MindFormers training log -> DIR/rank_<r>/metrics.jsonl
    mindmon to-tensorboard RUN_DIR [-o DIR]        JSONL -> DIR/rank_<r>/ event files

Example:
    add_commands(parser.add_subparsers(dest="command"))   # done by mindmon.cli
"""
import os
import sys


def _report(args) -> int:
    from .report import write_report

    output = args.output or os.path.join(args.run_dir if os.path.isdir(args.run_dir) else ".", "report.html")
    try:
        print(f"mindmon report: wrote {write_report(args.run_dir, output)}")
    except FileNotFoundError as error:
        print(f"mindmon: {error}", file=sys.stderr)
        return 1
    return 0


def _parse_log(args) -> int:
    from .parse_log import parse_log

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
    from .to_tensorboard import convert

    output = args.output or os.path.join(args.run_dir if os.path.isdir(args.run_dir) else ".", "tensorboard")
    try:
        written = convert(args.run_dir, output)
    except FileNotFoundError as error:
        print(f"mindmon: {error}", file=sys.stderr)
        return 1
    print(f"mindmon to-tensorboard: wrote {', '.join(written)}; view with: tensorboard --logdir {output}")
    return 0


def add_commands(commands) -> None:
    """Registers report, parse-log and to-tensorboard on an argparse subparsers object."""
    report = commands.add_parser("report", help="self-contained HTML page with PNG figures from a run's "
                                 "rank_<r>/metrics.jsonl (works while the run is going)")
    report.add_argument("run_dir", help="the run's output (monitor.output_dir, the demo's --output) or one metrics.jsonl")
    report.add_argument("-o", "--output", default=None, help="page to write (default: RUN_DIR/report.html)")
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
    convert.set_defaults(handler=_to_tensorboard)
