"""msprobe's CSV layout: written and read back by one module; rows always as long as their header."""
import csv
import io
import logging
import os
import uuid

import pytest

from mindmon.core.engine import RunInfo
from mindmon.formats import msprobe_csv as fmt
from mindmon.core.records import TensorStatsRecord
from mindmon.features.tensor_stats.sink import MsprobeCsvSink

pytestmark = pytest.mark.ms27   # also runs on MindSpore 2.7 (make test-ms27)


def record(step, name, values, ops=("min", "norm"), micro_step=None, kind="grad_reduced"):
    return TensorStatsRecord(step, micro_step, 0, kind, name, list(values), ops=ops, shape=(2, 3), dtype="Float32")


def table(path):
    with open(path, newline="") as file:
        return list(csv.reader(file))


def test_files_per_record_and_round_trip(tmp_path):
    sink = MsprobeCsvSink(str(tmp_path), ndigits=4, step_count_per_record=2)
    sink.open(RunInfo(rank=3))
    for step in (1, 2, 3):   # CSV steps 0, 1, 2
        sink.write([record(step, "fc1.weight", [-0.123456, 2.5 * step])])
        sink.flush()
    assert os.path.basename(sink.folder).split("-rank")[1].startswith("3-")
    assert sorted(os.listdir(sink.folder)) == ["grad_reduced_0-1.csv", "grad_reduced_2-3.csv"]
    rows = table(os.path.join(sink.folder, "grad_reduced_0-1.csv"))
    assert rows == [["vpp_stage", "name", "step", "min", "norm", "shape", "dtype"],
                    ["0", "fc1.weight", "0", "-0.1235", "2.5", "(2, 3)", "Float32"],
                    ["0", "fc1.weight", "1", "-0.1235", "5.0", "(2, 3)", "Float32"]]
    back = fmt.read_csv(os.path.join(sink.folder, "grad_reduced_2-3.csv"))
    assert back == [TensorStatsRecord(3, None, 0, "grad_reduced", "fc1.weight", [-0.1235, 7.5], ops=("min", "norm"),
                                      shape=(2, 3), dtype="Float32")]


def test_micro_step_column_and_alignment(tmp_path, caplog):
    sink = MsprobeCsvSink(str(tmp_path), ndigits=6)
    sink.open(RunInfo())
    sink.write([record(1, "w", [1, 2], micro_step=0, kind="grad_unreduced"),
                record(1, "w", [3, 4], micro_step=1, kind="grad_unreduced")])
    with caplog.at_level(logging.WARNING, logger="mindmon"):
        sink.write([record(1, "w", [5, 6, 7], ops=("max", "min", "norm"), micro_step=2, kind="grad_unreduced")])
    rows = table(os.path.join(sink.folder, "grad_unreduced_0-0.csv"))
    assert rows[0] == ["vpp_stage", "name", "step", "micro_step", "min", "norm", "shape", "dtype"]
    assert rows[1][:6] == ["0", "w", "0", "0", "1.0", "2.0"] and rows[3][:6] == ["0", "w", "0", "2", "6.0", "7.0"]
    assert all(len(row) == len(rows[0]) for row in rows)
    assert len(caplog.records) == 1 and "max" in caplog.records[0].getMessage()


def test_rounding_and_significant_digits():
    assert fmt.format_value(1.23456789e-10, 6) == "0.0"
    assert fmt.format_value(1.23456789e-10, 6, significant=True) == "1.23457e-10"
    assert fmt.format_value(float("nan"), 6) == "nan" and fmt.format_value(float("-inf"), 6) == "-inf"
    assert fmt.format_value(3.0, 6) == "3.0"


def test_append_output_continues_a_run_folder(tmp_path):
    first = MsprobeCsvSink(str(tmp_path))
    first.open(RunInfo(rank=0))
    first.write([record(1, "w", [1, 2])])
    stamp = os.path.basename(first.folder).split("-rank")[0]
    other_rank = MsprobeCsvSink(str(tmp_path))
    other_rank.open(RunInfo(rank=1))
    resumed = MsprobeCsvSink(str(tmp_path), append_output=(stamp, stamp))
    resumed.open(RunInfo(rank=0, start_step=1))
    assert resumed.folder == first.folder
    resumed.write([record(1, "w", [3, 4])])
    rows = table(os.path.join(first.folder, "grad_reduced_0-0.csv"))
    assert [row[3] for row in rows] == ["min", "1.0", "3.0"]   # one header, rows appended


def test_output_root_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(tmp_path / "out"))
    assert fmt.output_root() == str(tmp_path / "out")
    monkeypatch.delenv("MONITOR_OUTPUT_DIR")
    assert fmt.output_root() == "./monitor_output"


def test_read_csv_rejects_other_files(tmp_path):
    with pytest.raises(ValueError, match="not a <prefix>_<start>-<end>.csv"):
        fmt.read_csv(str(tmp_path / "metrics.csv"))


def _written_by_csv_module(rows):
    """What the csv module writes for rows of fields: the reference format_text must equal."""
    buffer = io.StringIO()
    csv.writer(buffer).writerows(rows)
    return buffer.getvalue()


@pytest.mark.parametrize("significant", [False, True])
def test_format_text_is_the_csv_module_writing_format_row(significant):
    """format_text (what the sink writes) is, byte for byte, the csv module writing format_row's fields of each
    record: for records whose ops are the header's (the short way) and for those that are not (ops changed,
    a micro-step in a per-step file), over values that stress the rounding (NaN, inf, -0.0, tiny, huge,
    ints, numpy scalars) and names the csv module must quote (comma, quote, line break)."""
    import numpy as np

    rng = np.random.default_rng(5)
    specials = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 1e-13, -4.9999999e-7, 123456789.123456789,
                2.5e17, 7, np.float32(0.1), np.float64(-3.75)]
    values = specials + (rng.normal(size=300) * 10.0 ** rng.integers(-9, 9, size=300)).tolist()
    # Names and shapes new to the process: quoted fields are remembered, and this must test their quoting.
    fresh = uuid.uuid4().hex
    names = ["cell.output", 'a "quoted", name', "line\nbreak", "carriage\rreturn", " spaced ", "", "层.输出"]
    ops = ("min", "max", "mean")
    records = [TensorStatsRecord(4, micro, 0, "actv", names[i % len(names)] + fresh + str(i), values[i:i + 3],
                                 ops=ops, shape=shape, dtype="Float32")
               for i in range(0, len(values) - 2, 3)
               for micro, shape in ((i % 4, (2, int(fresh[:6], 16))), (None, [5]), (1, ()))]
    records.append(TensorStatsRecord(4, 1, 0, "actv", "other", [2.5, 123456789.123456789], ops=("norm", "min"),
                                     shape=(1,), dtype="Float16"))   # the long way, in either mode
    for micro in (False, True):
        columns = fmt.header(ops, micro)
        for ndigits in (0, 1, 6, 12):
            expected = _written_by_csv_module([fmt.format_row(r, columns, ndigits, significant) for r in records])
            assert fmt.format_text(records, columns, ndigits, significant) == expected
    plain = TensorStatsRecord(4, 0, 0, "actv", "x", [123456789.123456789, 1e-13, 0.1], ops=ops, shape=(1,),
                              dtype="Float32")   # rounded to ndigits by default, as format_row
    assert fmt.format_text([plain], fmt.header(ops, True), 12) == "0,x,3,0,123456789.12345679,0.0,0.1,\"(1,)\",Float32\r\n"


def test_records_whose_ops_are_the_header_never_take_the_long_way(monkeypatch):
    """The short way is the point of format_text (thousands of activation rows per step): every record whose
    ops are its file's header takes it, with or without a micro-step, in either kind of file; only a
    record whose ops differ goes field by field."""
    ops = ("min", "max")
    records = [TensorStatsRecord(2, micro, 0, "actv", name, [1.0, 2.0], ops=ops, shape=(3,), dtype="Float32")
               for name, micro in (("a", 0), ("b", None), ("c", 3))]
    records.insert(1, TensorStatsRecord(2, 0, 0, "actv", "d", [1.0], ops=("norm",), shape=(3,), dtype="Float32"))
    long_way = []
    format_row = fmt.format_row
    monkeypatch.setattr(fmt, "format_row", lambda record, *args: (long_way.append(record.name),
                                                                    format_row(record, *args))[1])
    for micro in (True, False):
        long_way.clear()
        rows = list(csv.reader(io.StringIO(fmt.format_text(records, fmt.header(ops, micro), 6))))
        assert long_way == ["d"] and [row[1] for row in rows] == ["a", "d", "b", "c"]
        assert rows[0] == ["0", "a", "1"] + (["0"] if micro else []) + ["1.0", "2.0", "(3,)", "Float32"]


def _stress_values(ndigits):
    """Values around everything _number_texts' compiled writer depends on: decimal ties at ndigits places
    (near ones, and exact ones: odd multiples of a power of two whose ndigits-place rounding is a true tie,
    the smallest among them too),
    both ends of its range (1e-4, where repr changes form, and 10 ** (15 - ndigits)) and just outside them,
    zeros of both signs, rounding to zero and to the ends, non-finite and subnormal values, random values
    over 30 decades."""
    import numpy as np

    rng = np.random.default_rng(ndigits)
    step = 10.0 ** -ndigits
    high = 10.0 ** (15 - ndigits)
    ties = ((rng.integers(0, 10 ** 6, size=400) + 0.5) * step).tolist()
    exact_ties = (rng.integers(1, 10 ** 6, size=400) * 2 + 1) / 2.0 ** (ndigits + 1)   # x.5 at 10 ** -ndigits
    # and the smallest of them, whose remainder below the rounding point lies in the product's high word
    smallest_ties = np.arange(1, 64, 2) / 2.0 ** (ndigits + 1)
    ties += exact_ties.tolist() + smallest_ties.tolist()
    edges = [1e-4, 1.0001e-4, 0.99999e-4, 9.99e-5, 5e-5, high, high * (1 - 1e-12), high * (1 + 1e-12), high / 10,
             high * 9.999, 0.5 * step, 0.49999 * step, 1.5 * step, step, 1e-4 - 0.5 * step, 1e-4 + 0.5 * step,
             0.0, -0.0, 1.0, 2.0, 999.9999999999995, 5e-324, 2.2e-308, 1.7e308, float("nan"), float("inf")]
    random = (rng.normal(size=4000) * 10.0 ** rng.uniform(-15, 15, size=4000)).tolist()
    uniform = rng.uniform(-high, high, size=2000).tolist()
    values = ties + edges + random + uniform
    return values + [-value for value in values]


@pytest.mark.parametrize("ndigits", [0, 1, 3, 4, 5, 6, 8, 12, 14, 15, 16, 20])
def test_numbers_are_python_repr_of_round(ndigits):
    """_number_texts writes most values by compiled code; its text must be Python's own, checked value by
    value against repr(round(value, ndigits)) over values placed to break that way."""
    values = _stress_values(ndigits)
    assert fmt._number_texts([[value] for value in values], ndigits, False) == [
        repr(round(value, ndigits)) for value in values]


@pytest.mark.parametrize("ndigits", [1, 3, 6, 12, 14])
def test_rows_of_numbers_are_python_repr_of_round(ndigits):
    """Whole rows written by compiled code give, value by value, repr(round(value, ndigits)): rows of stress
    values (some wholly in the compiled writer's range, some with a value outside it, which Python writes)."""
    import numpy as np

    values = _stress_values(ndigits)
    values = values[:len(values) // 6 * 6]
    rows = np.array(values).reshape(-1, 6).tolist()
    in_range = [row for row in rows if all(1e-4 <= abs(v) < 10.0 ** (15 - ndigits) or v == 0 for v in row)]
    assert len(in_range) > 100   # the short way is tested, not only the long one
    for chosen in (rows, in_range):
        assert fmt._number_texts(chosen, ndigits, False) == [
            ",".join(repr(round(value, ndigits)) for value in row) for row in chosen]


@pytest.mark.parametrize("ndigits, huge", [(6, 2e9), (1, 2e14)])
def test_rows_of_ordinary_statistics_take_the_short_way(monkeypatch, ndigits, huge):
    """The point of _number_texts: values below 10 ** (15 - ndigits), NaN and infinities are not rounded with
    round() one by one; only the others are (here one value above it)."""
    import builtins

    rounded = []
    real_round = builtins.round
    monkeypatch.setattr(builtins, "round", lambda value, ndigits=None: (rounded.append(value),
                                                                        real_round(value, ndigits))[1])
    rows = [[0.5, -123.25, 1e-4, 0.0], [-0.0, 1e-5, huge, 7.0], [float("nan"), 3.0, float("-inf"), 1.0]]
    texts = fmt._number_texts(rows, ndigits, False)
    assert texts == [",".join(repr(real_round(v, ndigits)) for v in row) for row in rows]
    assert rounded == [huge]
