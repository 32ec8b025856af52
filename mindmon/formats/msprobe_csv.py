"""msprobe's monitor CSV files, both directions: the writer the CSV sink uses and the reader for tools.

Layout (one run = one folder per rank under the output root):

    $MONITOR_OUTPUT_DIR (default ./monitor_output)/
        Nov29_18-46-25-rank0-1a2b3c4d/          local time, rank, 8 random hex digits
            grad_reduced_0-4.csv                <prefix>_<first step>-<last step>.csv
            param_origin_0-4.csv ...

One file holds `step_count_per_record` consecutive steps (files start at multiples of it). Header:

    vpp_stage,name,step[,micro_step],<ops in config order>,shape,dtype

one row per tensor and step: `vpp_stage` the model chunk (a record named `"1:layers.0.w"` is written
`1,layers.0.w`; a name without a chunk prefix is chunk 0's: mindmon.parallel.chunks), `name` the parameter, `step` 0-based (the optimizer step
index), `micro_step` only in files of per-micro-batch rows, statistics rounded to `ndigits` decimal
places (or significant digits), `shape` as `"(16, 8)"`, `dtype` as MindSpore prints it (`Float32`).
Records carry 1-based steps (the engine's convention): the CSV step is `record.step - 1`.

Example:
    names = header(("min", "norm"), micro_step=False)   # ['vpp_stage', 'name', 'step', 'min', 'norm', 'shape', 'dtype']
    records = read_csv("monitor_output/.../grad_reduced_0-0.csv")
"""
import ast
import csv
import io
import math
import os
import re
import uuid
from datetime import datetime
from itertools import chain, compress, islice
from operator import attrgetter
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from mindmon.parallel.chunks import chunk_name, split_chunk
from mindmon.kernels.rounded_text import rounded_lines
from mindmon.core.records import TensorStatsRecord
from mindmon.formats.step_file import append_whole

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


def format_row(record: TensorStatsRecord, columns: Sequence[str], ndigits: int, significant: bool = False
               ) -> List[str]:
    """One CSV row for `columns` (a header): statistics the record lacks are left empty, so every row
    has exactly as many fields as its header."""
    chunk, name = split_chunk(record.name)
    described = {"vpp_stage": str(chunk), "name": name, "step": str(record.step - 1),
                 MICRO_STEP: "" if record.micro_step is None else str(record.micro_step),
                 "shape": str(tuple(record.shape)), "dtype": record.dtype}
    statistics = dict(zip(record.ops, record.value))
    return [described[column] if column in described else
            format_value(statistics[column], ndigits, significant) if column in statistics else ""
            for column in columns]


def format_text(records: Sequence[TensorStatsRecord], columns: Sequence[str], ndigits: int,
                significant: bool = False) -> str:
    """The CSV text of `format_row` of each record, as `csv.writer` writes it (fields quoted where they hold a
    comma, quote or line break; lines end in CRLF)."""
    return format_texts([(records, columns)], ndigits, significant)[0]


def format_texts(files: Sequence[Tuple[Sequence[TensorStatsRecord], Sequence[str]]], ndigits: int,
                 significant: bool = False) -> List[str]:
    """`format_text` of each (records, columns) of `files`. At thousands of activation rows per step the
    record-by-record way cost more than the statistics, so records whose ops are their header's, in its
    order (all of a file's records unless ops changed while training), take a shorter way to the same text:
    the numbers of every file come from one `_number_texts`, each name, shape and dtype is quoted once per
    process, and a file whose records all take it is made by `map`s over its records' fields."""
    fitting = [_fitting(records, columns) for records, columns in files]   # per file and record: the short way
    short_values = []                            # the values of the records that take it, in order
    for (records, _), fits in zip(files, fitting):
        short_values += compress(map(_VALUE, records), fits)
    numbers = iter(_number_texts(short_values, ndigits, significant))
    return [_file_text(records, columns, fits, numbers, ndigits, significant)
            for (records, columns), fits in zip(files, fitting)]


_NAME, _STEP, _MICRO, _OPS, _VALUE, _SHAPE, _DTYPE = (
    attrgetter(field) for field in ("name", "step", "micro_step", "ops", "value", "shape", "dtype"))


def _fitting(records: Sequence[TensorStatsRecord], columns: Sequence[str]) -> List[bool]:
    """Per record: whether its ops are exactly its file's header's (the short way)."""
    micro, columns = MICRO_STEP in columns, list(columns)
    ops = list(map(_OPS, records))
    if ops and ops.count(ops[0]) == len(ops):   # one ops for the whole file: the usual case
        return [columns == header(tuple(ops[0]), micro)] * len(ops)
    fits = {}   # ops -> whether the header is exactly theirs
    for record_ops in map(tuple, ops):
        if record_ops not in fits:
            fits[record_ops] = columns == header(record_ops, micro)
    return [fits[record_ops] for record_ops in map(tuple, ops)]


def _file_text(records, columns, fits: List[bool], numbers, ndigits: int, significant: bool) -> str:
    if records and all(fits):
        return _short_file_text(records, MICRO_STEP in columns, list(islice(numbers, len(records))))
    micro = MICRO_STEP in columns
    lines = []
    for record, fit in zip(records, fits):
        if not fit:
            lines.append(_csv_line(format_row(record, columns, ndigits, significant)))
            continue
        micro_text = "" if not micro else "," if record.micro_step is None else f",{record.micro_step}"
        lines.append(f"{_stage_and_name(record.name)},{record.step - 1}{micro_text},{next(numbers)},"
                     f"{_shape_and_dtype(record.shape, record.dtype)}\r\n")
    return "".join(lines)


def _short_file_text(records: Sequence[TensorStatsRecord], micro: bool, numbers: List[str]) -> str:
    """The lines of records that all take the short way, field by field over all of them (remembered fields
    looked up by `map`; what is new made by `_stage_and_name` and `_shape_and_dtype`)."""
    names = list(map(_NAME, records))
    stage_and_names = list(map(_STAGE_AND_NAME.get, names))
    if None in stage_and_names:
        stage_and_names = list(map(_stage_and_name, names))
    try:
        shapes_and_dtypes = list(map(_SHAPE_AND_DTYPE.get, zip(map(_SHAPE, records), map(_DTYPE, records))))
    except TypeError:   # a shape given as a list: not a key
        shapes_and_dtypes = [None]
    if None in shapes_and_dtypes:
        shapes_and_dtypes = list(map(_shape_and_dtype, map(_SHAPE, records), map(_DTYPE, records)))
    steps = list(map(_STEP, records))
    step_texts = [str(steps[0] - 1)] * len(steps) if steps.count(steps[0]) == len(steps) else \
        [str(step - 1) for step in steps]
    if micro:
        step_texts = list(map("{},{}".format, step_texts, map(_micro_text, map(_MICRO, records))))
    return "\r\n".join(map(",".join, zip(stage_and_names, step_texts, numbers, shapes_and_dtypes))) + "\r\n"


def _micro_text(micro_step: Optional[int]) -> str:
    return "" if micro_step is None else str(micro_step)


def _number_texts(rows: Sequence[Sequence[float]], ndigits: int, significant: bool) -> List[str]:
    """Each row's statistics as `format_value` writes them (`repr(round(value, ndigits))`), joined by commas:
    by compiled code where the rows are of one length and `ndigits` is 1..15 (mindmon.kernels.rounded_text),
    else one by one."""
    if not rows:
        return []
    widths = set(map(len, rows))
    if not significant and len(widths) == 1:
        width = widths.pop()
        values = np.fromiter(chain.from_iterable(rows), np.float64, len(rows) * width)
        lines = rounded_lines(values.reshape(len(rows), width), ndigits)
        if lines is not None:
            return lines
    return [",".join(format_value(value, ndigits, significant) for value in row) for row in rows]


def _csv_field(text: str) -> str:
    """`text` as `csv.writer` writes it in a row, remembered (names, shapes and dtypes repeat every step)."""
    field = _FIELDS.get(text)
    if field is None:
        field = _csv_line([text, ""])[:-3]   # the line is '<field>,\r\n'
        if len(_FIELDS) < _FIELDS_KEPT:
            _FIELDS[text] = field
    return field


_FIELDS: Dict[str, str] = {}
_FIELDS_KEPT = 1 << 16


def _stage_and_name(name: str) -> str:
    """The `vpp_stage,name` fields of a record's name, remembered like `_csv_field`."""
    fields = _STAGE_AND_NAME.get(name)
    if fields is None:
        chunk, bare = split_chunk(name)
        fields = f"{chunk},{_csv_field(bare)}"
        if len(_STAGE_AND_NAME) < _FIELDS_KEPT:
            _STAGE_AND_NAME[name] = fields
    return fields


_STAGE_AND_NAME: Dict[str, str] = {}


def _shape_and_dtype(shape, dtype: str) -> str:
    """The `shape,dtype` fields of a record, remembered like `_csv_field` (a step's thousands of rows share a
    few dozen shapes; making `str(tuple(shape))` for each was a fifth of the CSV text's cost)."""
    key = (shape, dtype) if isinstance(shape, tuple) else (tuple(shape), dtype)
    fields = _SHAPE_AND_DTYPE.get(key)
    if fields is None:
        fields = f"{_csv_field(str(tuple(shape)))},{_csv_field(dtype)}"
        if len(_SHAPE_AND_DTYPE) < _FIELDS_KEPT:
            _SHAPE_AND_DTYPE[key] = fields
    return fields


_SHAPE_AND_DTYPE: Dict[Tuple[Tuple[int, ...], str], str] = {}


def _csv_line(row: Sequence[str]) -> str:
    buffer = io.StringIO()
    csv.writer(buffer).writerow(row)
    return buffer.getvalue()


def write_text(path: str, columns: Sequence[str], text: str) -> None:
    """Appends `format_text`'s text, writing the header first when the file is new, in one piece: a full
    disk leaves the file as it was (no half row; a file it would have made is not left)."""
    if not os.path.exists(path):
        text = _csv_line(columns) + text
    append_whole(path, text.encode("utf-8"))


def read_header(path: str) -> List[str]:
    with open(path, newline="", encoding="utf-8") as file:
        return next(csv.reader(file), [])


def _chunk_named(cell: Dict[str, str]) -> str:
    """The record's name: a row of chunk c > 0 gets its `<c>:` prefix back (chunk 0's stays plain)."""
    chunk = int(cell.get("vpp_stage") or 0)
    return chunk_name(chunk, cell["name"]) if chunk else cell["name"]


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
            int(cell["step"]) + 1, int(micro) if micro else None, rank, match.group("prefix"), _chunk_named(cell),
            [float(cell[op]) if cell[op] else float("nan") for op in ops],
            ops=ops, shape=tuple(ast.literal_eval(cell["shape"])), dtype=cell["dtype"]))
    return records
