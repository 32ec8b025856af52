"""The report's view of the live cross-rank summaries, rank 0's `across_ranks` records (docs/outputs.md,
"Cross-rank summaries"), from DuckDB: the band of each rank's mean loss (min to max over the ranks, and
the mean) per step, and the ranks that most often held the largest value of a column."""
import html
from typing import List, Optional, Tuple

from mindmon.core.records import ACROSS_RANKS

TOP = 10
BAND = ("device_loss/min", "device_loss/mean", "device_loss/max")


def loss_band(engine) -> List[Tuple[int, str, float]]:
    """(step, statistic name, value) of the mean-loss summaries, by step."""
    return engine.execute(f"SELECT step, name, value FROM records WHERE kind = '{ACROSS_RANKS}' AND "
                          f"list_contains(?, name) ORDER BY step", [list(BAND)]).fetchall()


def most_often_max(engine) -> List[Tuple[int, str, int]]:
    """(rank, value kind, how many of its columns' step maxima it held), the TOP largest counts."""
    return engine.execute(
        f"SELECT CAST(value AS INTEGER) AS holder, split_part(name, '/', 1) AS what, count(*) AS times "
        f"FROM records WHERE kind = '{ACROSS_RANKS}' AND name LIKE '%/max_rank' AND isfinite(value) "
        f"GROUP BY holder, what ORDER BY times DESC, holder, what LIMIT {TOP}").fetchall()


def _band_figure(rows, png, figure) -> str:
    series = {name: ([], []) for name in BAND}
    for step, name, value in rows:
        series[name][0].append(step)
        series[name][1].append(value)
    fig, axes = figure()
    ax = axes[0][0]
    (low_x, low), (_, high) = series[BAND[0]], series[BAND[2]]
    ax.fill_between(low_x, low, high, alpha=0.3, label="min..max over the ranks")
    ax.plot(*series[BAND[1]], label="mean over the ranks")
    ax.set_xlabel("step")
    ax.set_ylabel("each rank's mean loss")
    ax.legend()
    return png(fig)


def live_summaries_section(engine, progress, png, figure) -> Optional[str]:
    """The page's section, or None when the run wrote no `across_ranks` record."""
    if not engine.first(f"SELECT count(*) FROM (SELECT 1 FROM records WHERE kind = '{ACROSS_RANKS}' LIMIT 1)")[0]:
        return None
    parts = ["<h2>Live cross-rank summaries</h2><p>What rank 0 wrote during the run "
             "(<code>monitor.across_ranks</code>).</p>"]
    band = loss_band(engine)
    if band:
        parts.append(f'<img alt="loss band across ranks" src="data:image/png;base64,{_band_figure(band, png, figure)}">')
    body = "".join(f"<tr><td>{rank}</td><td>{html.escape(what)}</td><td>{times}</td></tr>"
                   for rank, what, times in most_often_max(engine))
    parts.append(f"<table><tr><th>rank</th><th>value</th><th>steps x columns at the max</th></tr>{body}</table>")
    if progress is not None:
        print("mindmon report: live cross-rank summaries", file=progress, flush=True)
    return "\n".join(parts)
