"""The report's cross-rank view, every number from DuckDB (mindmon.analysis.sql) whatever the run's size:

- heat maps ranks x steps of each rank's step loss (`device_loss`, else `loss`, else the mean of its
  `local_loss`) and gradient norm (sqrt of the sum of its squared `device_norm`, else `grad_norm`);
  a run longer than HEAT_COLUMNS steps is shown in buckets of steps (the bucket's largest value);
  a NaN/inf cell is red;
- the ranks that stand out: per rank, the steps where its value is not finite or above FACTOR times
  the median over the ranks at that step, and its worst ratio to that median;
- the first anomaly in time: the first non-finite value of any scalar record (step, micro-step,
  step-level values after the micro-steps, rank), and the first step a rank's loss or gradient norm
  stands out.
"""
import html
from typing import List, Optional, Tuple

import numpy as np

from mindmon.core.records import DEVICE_LOSS, DEVICE_NORM, GRAD_NORM, LOCAL_LOSS, LOSS

HEAT_COLUMNS = 600
FACTOR = 5.0
TOP_RANKS = 10


def loss_sql(engine) -> Optional[str]:
    """(rank, step, value) of each rank's step loss, or None when the run has none."""
    for kind in (DEVICE_LOSS, LOSS):
        if engine.first("SELECT count(*) FROM (SELECT 1 FROM records WHERE kind = ? LIMIT 1)", [kind])[0]:
            return f"SELECT rank, step, value FROM records WHERE kind = '{kind}'"
    if engine.first("SELECT count(*) FROM (SELECT 1 FROM records WHERE kind = ? LIMIT 1)", [LOCAL_LOSS])[0]:
        return f"SELECT rank, step, avg(value) AS value FROM records WHERE kind = '{LOCAL_LOSS}' GROUP BY rank, step"
    return None


def grad_norm_sql(engine) -> Optional[str]:
    if engine.first("SELECT count(*) FROM (SELECT 1 FROM records WHERE kind = ? LIMIT 1)", [DEVICE_NORM])[0]:
        return (f"SELECT rank, step, sqrt(sum(value * value)) AS value FROM records WHERE kind = '{DEVICE_NORM}' "
                f"GROUP BY rank, step")
    if engine.first("SELECT count(*) FROM (SELECT 1 FROM records WHERE kind = ? LIMIT 1)", [GRAD_NORM])[0]:
        return f"SELECT rank, step, value FROM records WHERE kind = '{GRAD_NORM}'"
    return None


def heat_matrix(engine, values_sql: str) -> Tuple[List[int], Tuple[int, int, int], np.ndarray]:
    """(ranks, (first step, last step, steps per column), matrix[rank, column]) of (rank, step, value) rows."""
    first, last = engine.first(f"SELECT min(step), max(step) FROM ({values_sql})")
    width = max(1, -(-(last - first + 1) // HEAT_COLUMNS))
    rows = engine.execute(f"SELECT rank, (step - {first}) // {width} AS col, "
                      f"CASE WHEN bool_or(NOT isfinite(value)) THEN 'nan'::DOUBLE ELSE max(value) END "
                      f"FROM ({values_sql}) GROUP BY ALL").fetchnumpy()
    ranks = sorted(set(rows["rank"].tolist()))
    matrix = np.full((len(ranks), (last - first) // width + 1), np.inf)   # inf: no value (shown blank)
    where = {r: i for i, r in enumerate(ranks)}
    cells = list(rows.values())
    matrix[[where[r] for r in cells[0].tolist()], cells[1].astype(int)] = cells[2]
    return ranks, (first, last, width), matrix


def standing_out(engine, values_sql: str, factor: float = FACTOR) -> list:
    """(rank, steps standing out, worst ratio to the step's median, its step) of the TOP_RANKS ranks."""
    return engine.execute(f"""
        WITH v AS ({values_sql}),
             m AS (SELECT step, median(value) FILTER (WHERE isfinite(value)) AS med FROM v GROUP BY step)
        SELECT rank, count(*) FILTER (WHERE NOT isfinite(value) OR (med > 0 AND value > {factor} * med)) AS steps,
               max(value / med) FILTER (WHERE med > 0 AND isfinite(value)) AS worst,
               arg_max(step, value / med) FILTER (WHERE med > 0 AND isfinite(value)) AS worst_step
        FROM v JOIN m USING (step) GROUP BY rank
        HAVING steps > 0 ORDER BY steps DESC, worst DESC, rank LIMIT {TOP_RANKS}""").fetchall()


def first_nonfinite(engine) -> Optional[tuple]:
    return engine.first("SELECT step, micro_step, rank, kind, name, value FROM records "
                      "WHERE value IS NOT NULL AND NOT isfinite(value) "
                      "ORDER BY step, micro_step NULLS LAST, rank LIMIT 1")


def first_spike(engine, values_sql: str, factor: float = FACTOR) -> Optional[tuple]:
    return engine.first(f"""
        WITH v AS ({values_sql}),
             m AS (SELECT step, median(value) FILTER (WHERE isfinite(value)) AS med FROM v GROUP BY step)
        SELECT step, rank, value, med FROM v JOIN m USING (step)
        WHERE med > 0 AND isfinite(value) AND value > {factor} * med ORDER BY step, rank LIMIT 1""")


def heat_figure(title: str, ranks, span, matrix, log: bool, png, figure) -> str:
    first, last, width = span
    fig, axes = figure(width=11, height=max(3.0, min(12.0, 0.02 * len(ranks) + 2.5)))
    ax = axes[0][0]
    shown = np.where(np.isinf(matrix), np.nan, matrix)
    with np.errstate(divide="ignore", invalid="ignore"):
        shown = np.log10(shown) if log else shown
    image = ax.imshow(np.ma.masked_invalid(shown), aspect="auto", cmap="viridis", interpolation="nearest",
                      extent=(first - 0.5, first + matrix.shape[1] * width - 0.5, len(ranks) - 0.5, -0.5))
    bad = np.isnan(matrix)   # a non-finite value: red
    if bad.any():
        ax.imshow(np.where(bad, 1.0, np.nan), aspect="auto", cmap="autumn", interpolation="nearest",
                  extent=image.get_extent())
    step_note = f" ({width} steps per column, their largest value)" if width > 1 else ""
    ax.set(title=f"{title}, ranks x steps{' (log10)' if log else ''}{step_note}", xlabel="step", ylabel="rank")
    if len(ranks) <= 32:
        ax.set_yticks(range(len(ranks)), [str(r) for r in ranks], fontsize=7)
    fig.colorbar(image, ax=ax, label=("log10 " if log else "") + title.lower())
    return png(fig)


def _table(rows: list, what: str) -> str:
    if not rows:
        return f"<p>No rank's {what} stands out (not finite, or above {FACTOR:g} x the median over the ranks).</p>"
    body = "".join(f"<tr><td>{rank}</td><td>{steps}</td><td>{'-' if worst is None else f'{worst:.4g}'}</td>"
                   f"<td>{'-' if at is None else at}</td></tr>" for rank, steps, worst, at in rows)
    return (f"<table><tr><th>rank</th><th>steps standing out ({what})</th><th>worst value / median</th>"
            f"<th>at step</th></tr>{body}</table>")


def _first_anomaly(engine, losses: Optional[str]) -> str:
    parts = []
    found = first_nonfinite(engine)
    if found is not None:
        step, micro, rank, kind, name, value = found
        parts.append(f"first value not finite: step {step}, micro-step {'-' if micro is None else micro}, "
                     f"rank {rank}: {kind} {name} = {value}")
    spike = first_spike(engine, losses) if losses else None
    if spike is not None:
        parts.append(f"first loss above {FACTOR:g} x the median over the ranks: step {spike[0]}, rank {spike[1]} "
                     f"({spike[2]:.4g} against {spike[3]:.4g})")
    return "<p>" + html.escape("; ".join(parts) or "no value is non-finite and no rank's loss stands out") + "</p>"


def across_ranks_section(engine, progress, png, figure) -> str:
    """The page's cross-rank section (see the module docstring)."""
    ranks = engine.ranks()
    parts = [f"<h2>Across ranks</h2><p>{len(ranks)} ranks ({ranks[0]}..{ranks[-1]}); per-rank sections: "
             f"<code>mindmon report RUN_DIR --rank R</code></p>"]
    losses, norms = loss_sql(engine), grad_norm_sql(engine)
    parts.append(_first_anomaly(engine, losses))
    for title, values, log, what in (("Loss", losses, False, "loss"), ("Gradient norm", norms, True, "gradient norm")):
        if values is None:
            continue
        parts.append(f'<h3>{title}</h3><img alt="{what} across ranks" src="data:image/png;base64,'
                     f'{heat_figure(title, *heat_matrix(engine, values), log, png, figure)}">')
        parts.append(_table(standing_out(engine, values), what))
        if progress is not None:
            print(f"mindmon report: across ranks: {what}", file=progress, flush=True)
    return "\n".join(parts)
