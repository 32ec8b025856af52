"""`mindmon report`'s speed section: from a real plain loop with monitor.speed on, and from per-rank JSONL
written by mindmon's own JsonlSink with values chosen here, the page holds the section's figures, and the
numbers it prints (step time per rank, the slow ranks) and the heat map's array equal numpy over the records."""
import io
import re
import time

import numpy as np
from mindspore import Tensor, nn

from tests.support.jsonl import read_jsonl
from mindmon import AccumulatingTrainStep, build_group, parse_sections, split_batch
from mindmon.analysis.report import write_report
from mindmon.analysis.speed_report import PHASES, RANK_ROWS, step_series, step_time_heat
from mindmon.analysis.sql import Engine
from mindmon.core.engine import RunInfo
from mindmon.core.records import Record
from mindmon.sinks.columnar import ColumnarSink
from mindmon.sinks.jsonl import JsonlSink
from tests.analysis.test_report import images

FIGURES = {"step time and throughput", "phases per step", "mfu and hfu", "peak memory", "step time across ranks"}


class TwoDense(nn.Cell):
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Dense(3, 4), nn.Dense(4, 1)

    def construct(self, x, y):
        diff = self.second(self.first(x)) - y
        return (diff * diff).mean()


def speed_page(run_dir):
    """The page's speed section, and the progress lines the report printed."""
    progress = io.StringIO()
    write_report(str(run_dir), str(run_dir / "page.html"), progress=progress)
    page = (run_dir / "page.html").read_text()
    assert page.count("<h2>Speed</h2>") == 1
    return page.split("<h2>Speed</h2>")[1].split("<h2>")[0], progress.getvalue()


def table_after(section, heading):
    """The rows of the first table after `heading`, as lists of cell texts."""
    table = section.split(f"<h3>{heading}</h3>")[1].split("</table>")[0]
    return [re.findall(r"<td>([^<]*)</td>", row) for row in table.split("<tr>")[2:]]


def assert_not_blank(figures):
    for name in FIGURES:
        pixels = np.asarray(figures[name].convert("L"), dtype=float)
        assert figures[name].width > 400 and pixels.std() > 10, name


def test_a_real_runs_speed_section(tmp_path, rng):
    """A plain loop, monitor.speed with FLOPs on, 6 steps of 2 micro-batches, one step slowed by a sleep."""
    net = TwoDense()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.01)
    group = build_group(parse_sections({"monitor": {"output_dir": str(tmp_path), "speed": {
        "enabled": True, "flops": True, "peak_tflops": 2e-6}}}), model=net,
        parameter_names=[p.name for p in optimizer.parameters])
    train_step = AccumulatingTrainStep(net, optimizer, num_micro_steps=2, group=group, max_norm=0.0)
    group.setup()
    x = rng.normal(size=(8, 3)).astype(np.float32)
    batch = (Tensor(x), Tensor(x[:, :1] * 2.0))
    for step in range(1, 7):
        train_step(split_batch(batch, 2))
        if step == 4:
            time.sleep(0.1)
        group.flush(step)
    group.close()

    rows = read_jsonl(tmp_path / "rank_0" / "metrics.jsonl")
    section, progress = speed_page(tmp_path)
    figures = images(section)
    assert FIGURES <= set(figures)
    assert_not_blank(figures)
    assert "mindmon report: speed: step time across ranks" in progress

    steps = {r["step"]: r["value"] for r in rows if r["kind"] == "step_time" and r["name"] == "step"}
    times = np.array([steps[s] for s in range(1, 7)])
    assert times[3] > 0.1   # the sleep sits in step 4's window
    [row] = table_after(section, "Step time per rank")
    assert row[:2] == ["0", "6"]
    np.testing.assert_allclose([float(c) for c in row[2:]],
                               [np.median(times), times.mean(), times.max(), 1.0], rtol=5e-4)
    assert "No slow-rank record" in section and "No hang recorded" in section

    with Engine(str(tmp_path), progress=None) as engine:
        ranks, (first, last, width), matrix = step_time_heat(engine)
        series = step_series(engine)
    assert (ranks, first, last, width) == ([0], 1, 6, 1)
    np.testing.assert_allclose(matrix, times[None, :], rtol=1e-12)
    phases = sum(series[("step_time", p)]["mean"] for p in PHASES)   # the stack tops out at the step time
    np.testing.assert_allclose(phases, times, rtol=1e-9)
    mfu = {r["step"]: r["value"] for r in rows if r["kind"] == "mfu" and r["name"] == "mfu"}
    np.testing.assert_allclose(series[("mfu", "mfu")]["mean"], [mfu[s] for s in range(1, 7)], rtol=1e-12)
    np.testing.assert_allclose(series[("mfu", "peak_tflops")]["mean"], 2e-6, rtol=1e-12)


RANKS, STEPS = 4, 40
MANY = 96   # ranks of the larger run: more than the step-time table lists
SLOW = [(9, 3, 1.61), (5, 2, 1.25), (9, 2, 1.4), (30, 1, 2.5)]   # (step, rank, ratio), not in order
HANGS = [(33, "rank 2 in reduce of step 33", 41.5), (12, "all ranks in forward_backward of step 12", 30.25)]


def write_ranks(run_dir, rng, ranks=RANKS, steps=STEPS, phases=True, sink_type=JsonlSink):
    """Each rank's records through mindmon's sink (JsonlSink unless told): phases drawn here (the step their
    sum), throughput, memory, per-micro-batch times; rank 0 also the slow ranks, hangs and a cross-rank
    summary. The last rank stops one step short (a run in progress). Returns times[rank, step - 1] (NaN where
    no record)."""
    times = np.full((ranks, steps), np.nan)
    for rank in range(ranks):
        sink, records = sink_type(str(run_dir)), []
        sink.open(RunInfo(rank=rank))
        for step in range(1, steps + (rank != ranks - 1)):
            split = rng.uniform(0.001, 0.2, size=len(PHASES)) * (1 + rank)
            times[rank, step - 1] = split.sum()
            records.append(Record(step, None, rank, "step_time", "step", float(split.sum())))
            if phases:
                records += Record.many(step, None, rank, "step_time", PHASES, split.tolist())
                records += [Record(step, k, rank, "step_time", "micro_batch", float(split[1] / 2)) for k in (0, 1)]
                records += [Record(step, None, rank, "throughput", "samples_per_second", float(8 / split.sum())),
                            Record(step, None, rank, "memory", "peak_rss", float(rng.integers(1, 9) * 2 ** 28))]
            if rank == 0:
                records += [Record(s, None, 0, "slow_rank", f"rank {r}", v) for s, r, v in SLOW if s == step]
                records += [Record(s, None, 0, "hang", where, v) for s, where, v in HANGS if s == step]
                records.append(Record(step, None, 0, "across_ranks", "step_time/step/max", 9.0))
        sink.write(records)   # the steps in one go: what is on disk is the same lines
        sink.flush()
        sink.close()
    return times


def numpy_heat(times, columns):
    """The heat map numpy's way: steps cut into columns of ceil(steps / columns), each cell its steps' mean."""
    width = -(-times.shape[1] // columns)
    padded = np.full((times.shape[0], width * -(-times.shape[1] // width)), np.nan)
    padded[:, :times.shape[1]] = times
    return width, np.nanmean(padded.reshape(times.shape[0], -1, width), axis=2)


def test_several_ranks_tables_and_heat_map_equal_numpy(tmp_path, rng):
    times = write_ranks(tmp_path, rng)
    section, _ = speed_page(tmp_path)
    assert FIGURES - {"mfu and hfu"} <= set(images(section)) and "mfu and hfu" not in images(section)

    medians = np.nanmedian(times, axis=1)
    want = [[rank, np.sum(~np.isnan(times[rank])), medians[rank], np.nanmean(times[rank]), np.nanmax(times[rank]),
             medians[rank] / np.median(medians)] for rank in range(RANKS)]
    got = table_after(section, "Step time per rank")
    assert [[int(c) for c in row[:2]] for row in got] == [[r, n] for r, n, *_ in want]
    np.testing.assert_allclose([[float(c) for c in row[2:]] for row in got], [w[2:] for w in want], rtol=5e-4)

    got = table_after(section, "Slow ranks")
    assert [(int(s), int(r)) for s, r, _ in got] == sorted((s, r) for s, r, _ in SLOW)
    np.testing.assert_allclose([float(v) for *_, v in got], [v for _, _, v in sorted(SLOW)], rtol=5e-4)
    assert "4 slow-rank record(s)." in section
    got = table_after(section, "Hangs")
    assert [(int(s), where, float(v)) for s, where, v in got] == sorted(HANGS)

    with Engine(str(tmp_path), progress=None) as engine:
        ranks, span, matrix = step_time_heat(engine)
        binned = step_time_heat(engine, columns=7)
        series = step_series(engine)
    assert ranks == list(range(RANKS)) and span == (1, STEPS, 1)
    np.testing.assert_allclose(matrix, times, rtol=1e-12)   # NaN where the last rank has no step 40
    width, want_binned = numpy_heat(times, 7)
    assert binned[1] == (1, STEPS, width) and binned[2].shape == want_binned.shape == (RANKS, 7)
    np.testing.assert_allclose(binned[2], want_binned, rtol=1e-12)
    step = series[("step_time", "step")]
    np.testing.assert_array_equal(step["step"], np.arange(1, STEPS + 1))
    np.testing.assert_allclose(step["mean"], np.nanmean(times, axis=0), rtol=1e-12)
    np.testing.assert_allclose(step["low"], np.nanmin(times, axis=0), rtol=1e-12)
    np.testing.assert_allclose(step["high"], np.nanmax(times, axis=0), rtol=1e-12)
    assert step["ranks"].tolist() == [RANKS] * (STEPS - 1) + [RANKS - 1]


def test_many_ranks_heat_map_is_binned_and_the_slowest_ranks_listed(tmp_path):
    """More ranks than the table lists, each a Parquet file (what a large run writes): the heat map's cells
    are binned means of every rank's records, the table lists the slowest ranks by median."""
    rng = np.random.default_rng(7)
    times = write_ranks(tmp_path, rng, ranks=MANY, steps=30, phases=False, sink_type=ColumnarSink)
    with Engine(str(tmp_path), progress=None) as engine:
        ranks, span, matrix = step_time_heat(engine, columns=8)
    width, want = numpy_heat(times, 8)
    assert ranks == list(range(MANY)) and span == (1, 30, width) and width == 4
    np.testing.assert_allclose(matrix, want, rtol=1e-12)
    section, _ = speed_page(tmp_path)
    got = table_after(section, "Step time per rank")
    medians = np.nanmedian(times, axis=1)
    slowest = np.argsort(-medians, kind="stable")[:RANK_ROWS]
    assert [int(row[0]) for row in got] == slowest.tolist()
    np.testing.assert_allclose([float(row[2]) for row in got], medians[slowest], rtol=5e-4)
    assert f"The {RANK_ROWS} ranks of {MANY} with the largest median." in section
