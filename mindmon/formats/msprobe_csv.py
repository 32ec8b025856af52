"""msprobe's monitor CSV files, both directions: the writer the CSV sink uses and the reader for tools.

Layout (one run = one folder per rank under the output root):

    $MONITOR_OUTPUT_DIR (default ./monitor_output)/
        Nov29_18-46-25-rank0-1a2b3c4d/          local time, rank, 8 random hex digits
            grad_reduced_0-4.csv                <prefix>_<first step>-<last step>.csv
            param_origin_0-4.csv ...

One file holds `step_count_per_record` consecutive steps (files start at multiples of it). Header:

    vpp_stage,name,step[,micro_step],<ops in config order>,shape,dtype

one row per tensor and step: `vpp_stage` 0, `name` the parameter, `step` 0-based (the optimizer step
index), `micro_step` only in files of per-micro-batch rows, statistics rounded to `ndigits` decimal
places (or significant digits), `shape` as `"(16, 8)"`, `dtype` as MindSpore prints it (`Float32`).
Records carry 1-based steps (the engine's convention): the CSV step is `record.step - 1`.

Example:
    names = header(("min", "norm"), micro_step=False)   # ['vpp_stage', 'name', 'step', 'min', 'norm', 'shape', 'dtype']
    records = read_csv("monitor_output/.../grad_reduced_0-0.csv")
"""
import ast
import csv
import math
import os
import re
import uuid
from datetime import datetime
from typing import List, Optional, Sequence, Tuple

from ..records import TensorStatsRecord

OUTPUT_DIR_ENV = "MONITOR_OUTPUT_DIR"
DEFAULT_OUTPUT_ROOT = "./monitor_output"
RUN_FOLDER_TIME_FORMAT = "%b%d_%H-%M-%S"
LEADING = ("vpp_stage", "name", "step")
MICRO_STEP = "micro_step"
TRAILING = ("shape", "dtype")
_FILE_NAME = re.compile(r"^(?P<prefix>.+)_(?P<start>\d+)-(?P<end>\d+)\.csv$")


def output_root() -> str:
    return os.environ.get(OUTPUT_DIR_ENV) or DEFAULT_OUTPUT_ROOT


def run_folder_name(rank: int, now: Optional[datetime] = None) -> str:
    """`<MonDD_HH-MM-SS>-rank<r>-<id>` in local time."""
    stamp = (now or datetime.now()).strftime(RUN_FOLDER_TIME_FORMAT)
    return f"{stamp}-rank{rank}-{uuid.uuid4().hex[:8]}"


def find_run_folder(root: str, rank: int, first: str, last: str) -> Optional[str]:
    """The newest existing folder of `rank` whose timestamp lies in [first, last] (append_output)."""
    low, high = (datetime.strptime(s, RUN_FOLDER_TIME_FORMAT) for s in (first, last))
    found = []
    for entry in os.listdir(root) if os.path.isdir(root) else ():
        match = re.match(rf"^(\w{{3}}\d\d_\d\d-\d\d-\d\d)-rank{rank}-\w+$", entry)
        if match and low <= datetime.strptime(match.group(1), RUN_FOLDER_TIME_FORMAT) <= high:
            found.append((datetime.strptime(match.group(1), RUN_FOLDER_TIME_FORMAT), entry))
    return os.path.join(root, max(found)[1]) if found else None


def step_range(step0: int, steps_per_file: int) -> Tuple[int, int]:
    first = step0 // steps_per_file * steps_per_file
    return first, first + steps_per_file - 1


def file_name(prefix: str, first: int, last: int) -> str:
    return f"{prefix}_{first}-{last}.csv"


def header(ops: Sequence[str], micro_step: bool) -> List[str]:
    return list(LEADING) + ([MICRO_STEP] if micro_step else []) + list(ops) + list(TRAILING)


def format_value(value: float, ndigits: int, significant: bool = False) -> str:
    """`round(value, ndigits)` as Python prints it (`0.123457`, `1e-10`, `nan`, `inf`), or, with
    `significant`, `ndigits` significant digits, so small values are not rounded away."""
    if not math.isfinite(value):
        return repr(float(value))
    if significant:
        return repr(float(f"{value:.{max(ndigits, 1)}g}"))
    return repr(round(float(value), ndigits))


def rounded_texts(values: Sequence[float], ndigits: int) -> List[str]:
    """`repr(round(value, ndigits))` of each value (`format_value`'s text), at half its cost where that
    text is provably `'%.{ndigits}f' % value` without trailing zeros: `ndigits` >= 1 and
    1e-4 <= |value| < 10 ** (15 - ndigits), or 0. Why the two agree there: `round` and `%f` make the
    same correctly rounded decimal d (CPython's dtoa, mode 3); d has at most 15 significant digits, and
    two different decimals of at most 15 digits never round to the same double, so no shorter digit string
    stands for `round`'s double than d stripped, which `repr` prints positionally from 1e-4 up (a value
    of at least 1e-4 cannot round below it: 1e-4 is itself a multiple of 10 ** -ndigits, or it rounds to 0)."""
    if ndigits < 1:
        return [repr(round(float(value), ndigits)) for value in values]
    pattern, high = f"%.{ndigits}f", 10.0 ** (15 - ndigits)
    texts = []
    for value in values:
        if _REPR_POSITIONAL <= abs(value) < high or value == 0:
            text = (pattern % value).rstrip("0")
            texts.append(text + "0" if text[-1] == "." else text)
        else:   # NaN and inf pass through round() unchanged
            texts.append(repr(round(float(value), ndigits)))
    return texts


# repr prints floats below this in exponent form ('1e-05')
_REPR_POSITIONAL = 1e-4


def format_row(record: TensorStatsRecord, columns: Sequence[str], ndigits: int, significant: bool = False
               ) -> List[str]:
    """One CSV row for `columns` (a header): statistics the record lacks are left empty, so every row
    has exactly as many fields as its header."""
    described = {"vpp_stage": "0", "name": record.name, "step": str(record.step - 1),
                 MICRO_STEP: "" if record.micro_step is None else str(record.micro_step),
                 "shape": str(tuple(record.shape)), "dtype": record.dtype}
    statistics = dict(zip(record.ops, record.value))
    return [described[column] if column in described else
            format_value(statistics[column], ndigits, significant) if column in statistics else ""
            for column in columns]


def format_rows(records: Sequence[TensorStatsRecord], columns: Sequence[str], ndigits: int,
                significant: bool = False) -> List[List[str]]:
    """`format_row` of each record. A record whose ops are the header's, in its order (all of a file's
    records unless ops changed while training), takes a shorter way to the same text: at thousands of
    activation rows per step, looking up each field by name cost more than formatting the numbers."""
    columns = list(columns)
    micro = MICRO_STEP in columns
    fits = {}                                    # ops -> whether the header is exactly theirs
    shapes = {}                                  # shape -> its text
    rows = []
    for record in records:
        ops = tuple(record.ops)
        if ops not in fits:
            fits[ops] = columns == header(ops, micro)
        if not fits[ops]:
            rows.append(format_row(record, columns, ndigits, significant))
            continue
        shape = tuple(record.shape)
        if shape not in shapes:
            shapes[shape] = str(shape)
        row = ["0", record.name, str(record.step - 1)]
        if micro:
            row.append("" if record.micro_step is None else str(record.micro_step))
        if significant:
            row += [format_value(value, ndigits, True) for value in record.value]
        else:
            row += rounded_texts(record.value, ndigits)
        row += (shapes[shape], record.dtype)
        rows.append(row)
    return rows


def write_rows(path: str, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Appends rows, writing the header first when the file is new."""
    new = not os.path.exists(path)
    with open(path, "a", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        if new:
            writer.writerow(columns)
        writer.writerows(rows)


def read_header(path: str) -> List[str]:
    with open(path, newline="", encoding="utf-8") as file:
        return next(csv.reader(file), [])


def read_csv(path: str, rank: int = 0) -> List[TensorStatsRecord]:
    """The records of one CSV file (kind = the file's prefix, 1-based steps, statistics as floats;
    an empty field is NaN)."""
    match = _FILE_NAME.match(os.path.basename(path))
    if not match:
        raise ValueError(f"{path}: not a <prefix>_<start>-<end>.csv file")
    with open(path, newline="", encoding="utf-8") as file:
        rows = list(csv.reader(file))
    columns = rows[0]
    ops = tuple(c for c in columns if c not in LEADING + TRAILING + (MICRO_STEP,))
    records = []
    for row in rows[1:]:
        cell = dict(zip(columns, row))
        micro = cell.get(MICRO_STEP)
        records.append(TensorStatsRecord(
            int(cell["step"]) + 1, int(micro) if micro else None, rank, match.group("prefix"), cell["name"],
            [float(cell[op]) if cell[op] else float("nan") for op in ops],
            ops=ops, shape=tuple(ast.literal_eval(cell["shape"])), dtype=cell["dtype"]))
    return records
