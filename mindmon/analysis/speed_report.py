"""The report's speed section, from `monitor.speed`'s records (docs/speed.md), every number asked of
DuckDB (mindmon.analysis.sql) so that 1,024 ranks x tens of thousands of steps cost a few scans:

- step time and throughput per step: the mean over the ranks, and the min..max band with several ranks;
- the phases stacked per step (their mean over the ranks, which adds up to the mean step time);
- MFU and HFU per step (mean over the ranks) with the peak used, and the peak memory per step (max over
  the ranks);
- a heat map ranks x steps of each rank's own `step_time/step`; a run longer than HEAT_COLUMNS steps is
  drawn in buckets of steps, each cell the mean of the bucket's steps;
- per rank its step time (median, mean, max; the slowest RANK_ROWS by median in a larger run), the
  slow-rank records rank 0 wrote (step, rank, ratio to the median), and the hangs its watchdog declared
  (step, where the ranks were, seconds without progress).
"""
import html
from typing import Dict, List, Optional, Tuple

import numpy as np

from mindmon.features.speed.monitor import PHASES
from mindmon.core.records import HANG, MEMORY, MFU, SLOW_RANK, STEP_TIME, THROUGHPUT

HEAT_COLUMNS = 600   # the heat map's columns: about the picture's width in pixels
RANK_ROWS = 32       # ranks listed in the step-time table; a larger run lists its slowest
EVENT_ROWS = 100     # slow-rank and hang records listed, each (the first ones, by step)

SERIES_KINDS = (STEP_TIME, THROUGHPUT, MFU, MEMORY)
STEP_SQL = f"kind = '{STEP_TIME}' AND name = 'step' AND micro_step IS NULL"
MIB = 2.0 ** 20

Series = Dict[Tuple[str, str], Dict[str, np.ndarray]]


def _has(engine, kind: str) -> bool:
    return bool(engine.first("SELECT count(*) FROM (SELECT 1 FROM records WHERE kind = ? LIMIT 1)", [kind])[0])


def step_series(engine) -> Series:
    """{(kind, name): {"step", "low", "mean", "high", "ranks"}} of the step-level speed records: per step, the
    min, mean and max over the ranks that wrote it, and how many did (one scan of the run)."""
    rows = engine.execute(
        "SELECT kind, name, step, min(value) AS low, avg(value) AS mean, max(value) AS high, count(*) AS ranks "
        "FROM records WHERE list_contains(?, kind) AND micro_step IS NULL AND isfinite(value) "
        "GROUP BY kind, name, step ORDER BY kind, name, step", [list(SERIES_KINDS)]).fetchnumpy()
    kinds, names = np.asarray(rows["kind"], dtype=object), np.asarray(rows["name"], dtype=object)
    if not len(kinds):
        return {}
    starts = np.flatnonzero(np.r_[True, (kinds[1:] != kinds[:-1]) | (names[1:] != names[:-1])])   # rows come sorted
    series: Series = {}
    for start, end in zip(starts, np.r_[starts[1:], len(kinds)]):
        series[(kinds[start], names[start])] = {column: np.asarray(rows[column][start:end])
                                                for column in ("step", "low", "mean", "high", "ranks")}
    return series


def step_time_heat(engine, columns: int = HEAT_COLUMNS, span: Optional[Tuple[int, int]] = None
                   ) -> Optional[Tuple[List[int], Tuple[int, int, int], np.ndarray]]:
    """(ranks, (first step, last step, steps per column), matrix[rank, column]) of every rank's own
    `step_time/step`, each cell the mean of the column's steps (NaN: no record), or None without any.
    `span`: the first and last step when the caller knows them (one scan of the run fewer)."""
    first, last = span or engine.first(f"SELECT min(step), max(step) FROM records WHERE {STEP_SQL}")
    if first is None:
        return None
    width = max(1, -(-(last - first + 1) // columns))
    cells = engine.execute(f"SELECT rank, (step - {first}) // {width} AS col, avg(value) AS mean FROM records "
                           f"WHERE {STEP_SQL} GROUP BY rank, col").fetchnumpy()
    ranks = np.unique(cells["rank"])
    matrix = np.full((len(ranks), (last - first) // width + 1), np.nan)
    matrix[np.searchsorted(ranks, cells["rank"]), cells["col"].astype(int)] = cells["mean"]
    return ranks.tolist(), (first, last, width), matrix


def rank_step_times(engine) -> List[Tuple[int, int, float, float, float]]:
    """(rank, steps, median, mean, max) of each rank's `step_time/step`, by rank."""
    return engine.execute(f"SELECT rank, count(*), median(value), avg(value), max(value) FROM records "
                          f"WHERE {STEP_SQL} GROUP BY rank ORDER BY rank").fetchall()


Listed = Tuple[int, List[tuple]]   # how many records, and the first EVENT_ROWS of them


def events(engine, limit: int = EVENT_ROWS) -> Dict[str, Listed]:
    """{kind: (count, first rows)} of the slow-rank records, as (step, rank, ratio), and the hang records
    rank 0's watchdog wrote, as (step, where the ranks were, seconds no rank had progressed), each by step:
    one scan."""
    rows = engine.execute(f"""
        SELECT kind, step, who, name, value, count(*) OVER (PARTITION BY kind) AS total FROM (
            SELECT kind, step, name, value,
                   CASE WHEN kind = '{SLOW_RANK}' THEN TRY_CAST(split_part(name, ' ', 2) AS INTEGER)
                        ELSE rank END AS who
            FROM records WHERE kind IN ('{SLOW_RANK}', '{HANG}'))
        QUALIFY row_number() OVER (PARTITION BY kind ORDER BY step, who, name) <= {limit}
        ORDER BY kind, step, who, name""").fetchall()
    totals, listed = {SLOW_RANK: 0, HANG: 0}, {SLOW_RANK: [], HANG: []}
    for kind, step, who, name, value, total in rows:
        totals[kind] = total
        listed[kind].append((step, who, value) if kind == SLOW_RANK else (step, name, value))
    return {kind: (totals[kind], listed[kind]) for kind in totals}


def _band(ax, data: Dict[str, np.ndarray], label: str, color: str, scale: float = 1.0) -> None:
    """The mean over the ranks as a line, and their min..max as a band when more than one rank wrote it."""
    ax.plot(data["step"], data["mean"] * scale, "-", color=color, label=label)
    if data["ranks"].max() > 1:
        ax.fill_between(data["step"], data["low"] * scale, data["high"] * scale, color=color, alpha=0.25,
                        label=f"{label}: min..max over the ranks")


def time_figure(series: Series, png, figure) -> Optional[str]:
    step, rates = series.get((STEP_TIME, "step")), [n for n in ("samples_per_second", "tokens_per_second")
                                                    if (THROUGHPUT, n) in series]
    if step is None:
        return None
    fig, axes = figure(2 if rates else 1)
    _band(axes[0][0], step, "step time", "tab:blue")
    axes[0][0].set(title="Step time (mean over the ranks)", xlabel="step", ylabel="seconds")
    axes[0][0].legend(loc="upper right", fontsize=8)
    if rates:
        ax = axes[1][0]
        for index, (name, color) in enumerate(zip(rates, ("tab:green", "tab:purple"))):
            target = ax if index == 0 else ax.twinx()
            _band(target, series[(THROUGHPUT, name)], name.replace("_", " "), color)
            target.set_ylabel(name.replace("_per_second", "/s"))
            target.legend(loc="upper left" if index == 0 else "upper right", fontsize=8)
        ax.set(title="Throughput of one rank (mean over the ranks)", xlabel="step")
    return png(fig)


def phases_figure(series: Series, png, figure) -> Optional[str]:
    present = [p for p in PHASES if (STEP_TIME, p) in series]
    if not present:
        return None
    steps = series[(STEP_TIME, present[0])]["step"]
    fig, axes = figure()
    ax = axes[0][0]
    ax.stackplot(steps, *[_on(series[(STEP_TIME, p)], steps) for p in present], labels=present, alpha=0.85)
    if (STEP_TIME, "step") in series:
        ax.plot(steps, _on(series[(STEP_TIME, "step")], steps), "--", color="black", linewidth=1, label="step")
    ax.set(title="Where each step's time goes (mean over the ranks, stacked)", xlabel="step", ylabel="seconds")
    ax.legend(loc="upper right", fontsize=8, ncol=4)
    return png(fig)


def _on(data: Dict[str, np.ndarray], steps: np.ndarray) -> np.ndarray:
    """The series' means at `steps` (0 where a step has none: a stack cannot have gaps)."""
    out = np.zeros(len(steps))
    index = np.searchsorted(steps, data["step"])
    keep = (index < len(steps)) & (steps[np.minimum(index, len(steps) - 1)] == data["step"])
    out[index[keep]] = data["mean"][keep]
    return out


def mfu_figure(series: Series, png, figure) -> Optional[str]:
    shown = [n for n in ("mfu", "hfu") if (MFU, n) in series]
    if not shown:
        return None
    fig, axes = figure()
    ax = axes[0][0]
    for name, color in zip(shown, ("tab:blue", "tab:orange")):
        _band(ax, series[(MFU, name)], name.upper(), color, scale=100.0)
    peak = series.get((MFU, "peak_tflops"))
    used = "" if peak is None else (f", peak {peak['low'].min():.4g} TFLOPS" if peak["low"].min() == peak["high"].max()
                                    else f", peak {peak['low'].min():.4g}..{peak['high'].max():.4g} TFLOPS")
    ax.set(title=f"MFU and HFU (mean over the ranks{used})", xlabel="step", ylabel="% of peak")
    ax.legend(loc="upper right", fontsize=8)
    return png(fig)


def memory_figure(series: Series, png, figure) -> Optional[str]:
    shown = [n for n in ("peak_rss", "device_peak_allocated", "device_peak_reserved") if (MEMORY, n) in series]
    if not shown:
        return None
    fig, axes = figure()
    ax = axes[0][0]
    for name in shown:
        data = series[(MEMORY, name)]
        ax.plot(data["step"], data["high"] / MIB, "-", label=name)
    ax.set(title="Peak memory per step (max over the ranks)", xlabel="step", ylabel="MiB")
    ax.legend(loc="upper right", fontsize=8)
    return png(fig)


def heat_figure(heat, png, figure) -> str:
    ranks, (first, _, width), matrix = heat
    fig, axes = figure(width=11, height=max(3.0, min(12.0, 0.02 * len(ranks) + 2.5)))
    ax = axes[0][0]
    image = ax.imshow(np.ma.masked_invalid(matrix), aspect="auto", cmap="viridis", interpolation="nearest",
                      extent=(first - 0.5, first + matrix.shape[1] * width - 0.5, len(ranks) - 0.5, -0.5))
    note = f" ({width} steps per column, their mean)" if width > 1 else ""
    ax.set(title=f"Step time, ranks x steps{note}", xlabel="step", ylabel="rank")
    if len(ranks) <= 32:
        ax.set_yticks(range(len(ranks)), [str(r) for r in ranks], fontsize=7)
    fig.colorbar(image, ax=ax, label="seconds")
    return png(fig)


def _rows(head: List[str], rows: List[list]) -> str:
    cells = "".join("<tr>" + "".join(f"<td>{v:.4g}</td>" if isinstance(v, float) else f"<td>{html.escape(str(v))}</td>"
                                     for v in row) + "</tr>" for row in rows)
    return "<table><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + f"</tr>{cells}</table>"


def rank_table(engine) -> str:
    rows = rank_step_times(engine)
    if not rows:
        return ""
    typical = float(np.median([median for _, _, median, _, _ in rows]))
    shown = rows if len(rows) <= RANK_ROWS else sorted(rows, key=lambda r: (-r[2], r[0]))[:RANK_ROWS]
    note = "" if len(rows) <= RANK_ROWS else f"<p>The {RANK_ROWS} ranks of {len(rows)} with the largest median.</p>"
    return note + _rows(["rank", "steps", "median step time (s)", "mean (s)", "max (s)", "median / ranks' median"],
                        [[rank, steps, median, mean, high, median / typical if typical > 0 else float("nan")]
                         for rank, steps, median, mean, high in shown])


def _listed(listed: Listed, what: str, head: List[str]) -> str:
    total, rows = listed
    note = f"<p>{total} {what} record(s){f'; the first {len(rows)}' if total > len(rows) else ''}.</p>"
    return note + _rows(head, [list(row) for row in rows])


def slow_rank_table(listed: Listed) -> str:
    if not listed[0]:
        return "<p>No slow-rank record (none was over <code>slow_rank_factor</code> x the median).</p>"
    return _listed(listed, "slow-rank", ["step", "rank", "compute / median"])


def hang_table(listed: Listed) -> str:
    if not listed[0]:
        return "<p>No hang recorded.</p>"
    return _listed(listed, HANG, ["step", "where the ranks were", "seconds without progress"])


def speed_section(engine, progress, png, figure) -> Optional[str]:
    """The page's speed section, or None when the run wrote no `step_time` record."""
    if not _has(engine, STEP_TIME):
        return None
    series = step_series(engine)
    parts = ["<h2>Speed</h2><p>From <code>monitor.speed</code>'s records (docs/speed.md).</p>"]
    steps = series.get((STEP_TIME, "step"), {}).get("step")
    heat = None if steps is None else step_time_heat(engine, span=(int(steps[0]), int(steps[-1])))
    figures = (("step time and throughput", lambda: time_figure(series, png, figure)),
               ("phases per step", lambda: phases_figure(series, png, figure)),
               ("mfu and hfu", lambda: mfu_figure(series, png, figure)),
               ("peak memory", lambda: memory_figure(series, png, figure)),
               ("step time across ranks", lambda: None if heat is None else heat_figure(heat, png, figure)))
    for title, build in figures:
        image = build()
        if image is None:
            continue
        parts.append(f'<h3>{title.capitalize()}</h3><img alt="{title}" src="data:image/png;base64,{image}">')
        if progress is not None:
            print(f"mindmon report: speed: {title}", file=progress, flush=True)
    parts.append("<h3>Step time per rank</h3>" + rank_table(engine))
    found = events(engine)
    parts.append("<h3>Slow ranks</h3>" + slow_rank_table(found[SLOW_RANK]))
    parts.append("<h3>Hangs</h3>" + hang_table(found[HANG]))
    return "\n".join(parts)
