"""msprobe's `csv2tensorboard_by_step`: TensorBoard event files from the monitor's CSV files, and the
`mindmon csv2tensorboard` command.

    csv2tensorboard_by_step("./monitor_output", "Dec03_21-34-40", "Dec03_21-34-42", process_num=2,
                            data_type_list=["actv", "grad_reduced"], output_dirpath="./tb")

Converts every run folder `<MonDD_HH-MM-SS>-rank<r>-<id>` under `monitor_path` whose timestamp lies in
[time_start, time_end] (both included) as msprobe's own tool lays it out: one event directory per rank and
data type, `<output_dirpath>/rank<r>/<data type>/events.out.tfevents.*` (default output:
`./<MonDD_HH-MM-SS>_csv2tensorboard_by_step`, the current time; an existing directory of the same rank and
type is replaced), tags `vp<vpp_stage>:<name>/<op>` (`vp0:fc1.weight/norm`), per-micro-step rows as
`vp<vpp_stage>:<name>:micro<m>/<op>`, every point against the CSV's own 0-based step. `process_num` folders
are converted at once, each in its own process.
"""
import glob
import os
import re
import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime
from itertools import groupby
from typing import Dict, List, Optional, Sequence, Tuple

from mindmon.parallel.chunks import split_chunk
from mindmon.formats.msprobe_csv import RUN_FOLDER_TIME_FORMAT, read_csv

DATA_TYPES = ("actv", "actv_grad", "exp_avg", "exp_avg_sq", "grad_unreduced", "grad_reduced", "param_origin",
              "param_updated")
_FOLDER = re.compile(r"^(?P<stamp>\w{3}\d\d_\d\d-\d\d-\d\d)-rank(?P<rank>\d+)-\w+$")
_CSV = re.compile(r"^(?P<prefix>.+)_\d+-\d+\.csv$")


def run_folders(monitor_path: str, time_start: str, time_end: str) -> List[Tuple[int, str]]:
    """(rank, folder) of the run folders whose timestamp is in [time_start, time_end]."""
    low, high = (_stamp(value, name) for value, name in ((time_start, "time_start"), (time_end, "time_end")))
    found = []
    for entry in sorted(os.listdir(monitor_path)):
        match = _FOLDER.match(entry)
        if match and low <= datetime.strptime(match.group("stamp"), RUN_FOLDER_TIME_FORMAT) <= high:
            found.append((int(match.group("rank")), os.path.join(monitor_path, entry)))
    return found


def _stamp(value: str, name: str) -> datetime:
    try:
        return datetime.strptime(value, RUN_FOLDER_TIME_FORMAT)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: got {value!r}; allowed: a run-folder timestamp like 'Dec03_21-34-40'") from None


def msprobe_tag(record) -> str:
    """msprobe's csv2tensorboard spelling of a row: `vp<vpp_stage>:<name>[:micro<m>]`."""
    chunk, name = split_chunk(record.name)
    return f"vp{chunk}:{name}" + ("" if record.micro_step is None else f":micro{record.micro_step}")


def convert_folder(rank: int, folder: str, data_types: Sequence[str], output_dirpath: str) -> List[str]:
    """One run folder's CSV files of `data_types` into `<output_dirpath>/rank<rank>/<data type>/`; returns
    the directories written."""
    from mindmon.sinks.event_file import EventFile

    by_type: Dict[str, list] = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.csv"))):
        match = _CSV.match(os.path.basename(path))
        if match and match.group("prefix") in data_types:
            by_type.setdefault(match.group("prefix"), []).extend(read_csv(path, rank))
    written = []
    for data_type, records in by_type.items():
        log_dir = os.path.join(output_dirpath, f"rank{rank}", data_type)
        shutil.rmtree(log_dir, ignore_errors=True)
        os.makedirs(log_dir)
        events = EventFile(log_dir)
        records.sort(key=lambda r: r.step)
        for _, step_records in groupby(records, key=lambda r: r.step):
            for record in step_records:
                tag = msprobe_tag(record)
                for op, value in zip(record.ops, record.value):
                    events.add_scalar(f"{tag}/{op}", value, record.step - 1)   # records count from 1
            events.flush()
        events.close()
        written.append(log_dir)
    return written


def csv2tensorboard_by_step(monitor_path: str, time_start: str, time_end: str, process_num: int = 1,
                            data_type_list: Optional[Sequence[str]] = None, output_dirpath: Optional[str] = None
                            ) -> List[str]:
    """Converts the run folders in the time range; returns the event directories written."""
    data_types = tuple(data_type_list) if data_type_list else DATA_TYPES
    unknown = [t for t in data_types if t not in DATA_TYPES]
    if unknown:
        raise ValueError(f"data_type_list: got {unknown[0]!r}; allowed: {list(DATA_TYPES)}")
    if not isinstance(process_num, int) or isinstance(process_num, bool) or process_num < 1:
        raise ValueError(f"process_num: got {process_num!r}; allowed: an int >= 1")
    monitor_path = os.path.expanduser(monitor_path)
    if not os.path.isdir(monitor_path):
        raise FileNotFoundError(f"monitor_path: {monitor_path!r} is not a directory")
    output = output_dirpath or f"{datetime.now().strftime(RUN_FOLDER_TIME_FORMAT)}_csv2tensorboard_by_step"
    folders = run_folders(monitor_path, time_start, time_end)
    if process_num == 1 or len(folders) < 2:
        return [d for rank, folder in folders for d in convert_folder(rank, folder, data_types, output)]
    with ProcessPoolExecutor(min(process_num, len(folders))) as pool:
        futures = [pool.submit(convert_folder, rank, folder, data_types, output) for rank, folder in folders]
        return [d for future in futures for d in future.result()]


def add_arguments(parser) -> None:
    parser.add_argument("monitor_path", help="the monitor's output root ($MONITOR_OUTPUT_DIR, ./monitor_output)")
    parser.add_argument("time_start", help="first run-folder timestamp to convert, like Dec03_21-34-40")
    parser.add_argument("time_end", help="last run-folder timestamp to convert (included)")
    parser.add_argument("--process-num", type=int, default=1, help="folders converted at once (default: 1)")
    parser.add_argument("--data-type", action="append", choices=DATA_TYPES, default=None,
                        help="a CSV prefix to convert; repeat for several (default: all)")
    parser.add_argument("-o", "--output", default=None,
                        help="event directory (default: ./<now>_csv2tensorboard_by_step)")


def run(args) -> int:
    try:
        written = csv2tensorboard_by_step(args.monitor_path, args.time_start, args.time_end, args.process_num,
                                          args.data_type, args.output)
    except (ValueError, FileNotFoundError) as error:
        print(f"mindmon csv2tensorboard: {error}", file=sys.stderr)
        return 1
    if not written:
        print(f"mindmon csv2tensorboard: no run folder under {args.monitor_path} between {args.time_start} and "
              f"{args.time_end}", file=sys.stderr)
        return 1
    print(f"mindmon csv2tensorboard: wrote {', '.join(written)}")
    return 0
