"""`<output_dir>/rank_<r>/metrics.jsonl`: every record, one JSON object per line.

    {"step": 3, "micro_step": 1, "rank": 0, "kind": "local_loss", "name": "loss", "value": 2.5}
    {"step": 3, "micro_step": 1, "rank": 0, "kind": "tokens_per_expert", "name": "decoder.layers.1",
     "value": [5, 3, 4, 4], "iter": 9}
    {"step": 3, "micro_step": null, "rank": 0, "kind": "grad_reduced", "name": "fc1.weight",
     "value": [-0.53, 0.75, 1.34], "ops": ["min", "max", "norm"], "shape": [8, 4], "dtype": "Float32"}

Non-finite numbers are not JSON: a NaN or infinite value is written as `null`, and the line says
what it was in `nonfinite` ("nan", "inf", "-inf"; for a list, a mapping from element index to that
text). Standard JSON readers accept every line; pandas reads the nulls as NaN; `decode` gives the
original floats back.

Example:
    for rank, path in metrics_files("./output"):     # ./output/monitor/rank_0/metrics.jsonl, ...
        records = read_records(path)
"""
import glob
import json
import math
import os
import sys
from itertools import repeat
from operator import attrgetter
from typing import List, Sequence, Tuple

from mindmon.core.records import Record, TensorStatsRecord
from mindmon.formats.run_folder import rank_dir, rank_in_path

METRICS_FILE = "metrics.jsonl"


def metrics_path(output_dir: str, rank: int) -> str:
    return os.path.join(rank_dir(output_dir, rank), METRICS_FILE)


def _nonfinite_text(value: float) -> str:
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _encode_value(value):
    """(JSON-safe value, the `nonfinite` field or None)."""
    if isinstance(value, list):
        marks = {str(i): _nonfinite_text(v) for i, v in enumerate(value)
                 if isinstance(v, float) and not math.isfinite(v)}
        return ([None if str(i) in marks else v for i, v in enumerate(value)], marks) if marks else (value, None)
    if isinstance(value, float) and not math.isfinite(value):
        return None, _nonfinite_text(value)
    return value, None


_QUOTED: dict = {}   # name -> its JSON string; names repeat every step


def _quoted(text: str) -> str:
    quoted = _QUOTED.get(text)
    if quoted is None:
        quoted = _QUOTED[text] = json.dumps(text)
    return quoted


def encode(record: Record) -> str:
    """One line, as `json.dumps` of the fields writes it; the common case (a finite float of a plain
    Record) is built directly, a thousand times a step."""
    value = record.value
    if type(record) is Record and type(value) is float and math.isfinite(value) and record.iteration is None:
        return f'{_head(_HEAD_FIELDS(record))}{_quoted(record.name)}, "value": {value!r}}}'
    return _encode_general(record)


def encode_many(records: Sequence[Record]) -> List[str]:
    """`encode` of each record. When every record is a plain Record of a finite float (the thousand a step
    `train_state` makes), the lines are made field by field over all of them: the part before the name is
    the same for every record of one (step, micro-step, rank, kind) and made once for it."""
    count = len(records)
    values = list(map(_VALUE, records))
    if not (list(map(type, records)).count(Record) == count and list(map(type, values)).count(float) == count
            and list(map(_ITERATION, records)).count(None) == count and all(map(math.isfinite, values))):
        return list(map(encode, records))
    heads = list(map(_HEADS.get, map(_HEAD_FIELDS, records)))
    if None in heads:
        heads = list(map(_head, map(_HEAD_FIELDS, records)))
    names = list(map(_QUOTED.get, map(_NAME, records)))
    if None in names:
        names = list(map(_quoted, map(_NAME, records)))
    return list(map("".join, zip(heads, names, repeat(', "value": '), map(repr, values), repeat("}"))))


_VALUE, _NAME, _ITERATION = attrgetter("value"), attrgetter("name"), attrgetter("iteration")
_HEAD_FIELDS = attrgetter("step", "micro_step", "rank", "kind")
_HEADS: dict = {}   # (step, micro_step, rank, kind) -> the line up to the name; emptied when it grows
_HEADS_KEPT = 1 << 12


def _head(fields: tuple) -> str:
    step, micro_step, rank, kind = fields
    head = _HEADS.get(fields)
    if head is None:
        micro = "null" if micro_step is None else int(micro_step)
        head = f'{{"step": {int(step)}, "micro_step": {micro}, "rank": {int(rank)}, "kind": {_quoted(kind)}, "name": '
        if len(_HEADS) >= _HEADS_KEPT:   # heads of past steps
            _HEADS.clear()
        _HEADS[fields] = head
    return head


def _encode_general(record: Record) -> str:
    value, nonfinite = _encode_value(record.value)
    out = {"step": record.step, "micro_step": record.micro_step, "rank": record.rank,
           "kind": record.kind, "name": record.name, "value": value}
    if nonfinite is not None:
        out["nonfinite"] = nonfinite
    if record.iteration is not None:
        out["iter"] = record.iteration
    if isinstance(record, TensorStatsRecord):
        out.update(ops=list(record.ops), shape=list(record.shape), dtype=record.dtype)
    return json.dumps(out, allow_nan=False)


def decode(line: str) -> Record:
    """The record of one line; ValueError/KeyError/TypeError when it is not one."""
    row = json.loads(line)
    value, nonfinite = row["value"], row.get("nonfinite")
    if isinstance(nonfinite, str):
        value = float(nonfinite)
    elif isinstance(nonfinite, dict):
        value = [float(nonfinite[str(i)]) if str(i) in nonfinite else v for i, v in enumerate(value)]
    extra = {"iteration": row["iter"]} if "iter" in row else {}
    fields = (row["step"], row["micro_step"], row["rank"], row["kind"], row["name"], value)
    if "ops" in row:
        return TensorStatsRecord(*fields, **extra, ops=tuple(row["ops"]), shape=tuple(row["shape"]),
                                 dtype=row["dtype"])
    return Record(*fields, **extra)


def metrics_files(run_dir: str) -> List[Tuple[int, str]]:
    """(rank, path) of every `rank_<r>/metrics.jsonl` at or below `run_dir` (a metrics file itself
    is accepted too), sorted by rank. Raises FileNotFoundError naming what was looked for."""
    if os.path.isfile(run_dir):
        rank = rank_in_path(os.path.dirname(os.path.abspath(run_dir)))
        return [(rank or 0, run_dir)]
    found = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "**", METRICS_FILE), recursive=True)):
        rank = rank_in_path(os.path.dirname(path))
        if rank is not None and os.path.basename(os.path.dirname(path)) == f"rank_{rank}":
            found.setdefault(rank, path)
    if not found:
        raise FileNotFoundError(f"no rank_<r>/{METRICS_FILE} at or below {run_dir!r}; pass the run's output "
                                f"directory (monitor.output_dir, or the demo's --output)")
    return sorted(found.items())


def read_records(path: str) -> List[Record]:
    """The file's records. A run in progress may have a last line half written: it is left out,
    as is any line that is not a record (counted once on stderr)."""
    records, bad = [], 0
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            try:
                records.append(decode(line))
            except (ValueError, KeyError, TypeError):
                bad += 1
    if bad:
        print(f"mindmon: {path}: {bad} line(s) that are not records were skipped", file=sys.stderr)
    return records
