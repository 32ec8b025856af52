"""`mindmon report RUN_DIR`: one self-contained HTML page (PNG figures inlined) from a run's JSONL.

Figures, per rank, for what the run recorded: loss per micro-batch and per step (with the loss
components, the steps whose update was skipped, grad norm and learning rate), a gradient-norm heat
map (parameter groups x steps), a tokens-per-expert heat map per MoE layer with an imbalance table, and the max attention logit per layer and per head.
A run with monitor.speed's records gets a speed section before the per-rank ones (mindmon.analysis.speed_report).
Works on a run still in progress (it plots the steps written so far).

Example:
    write_report("./output", "./output/report.html")
"""
import base64
import html
import io
import re
import sys
from collections import defaultdict
from datetime import datetime
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from mindmon.core.records import (DEVICE_LOSS, DEVICE_NORM, GRAD_NORM, LEARNING_RATE, LOCAL_LOSS, LOCAL_NORM, LOSS,
                      LOSS_COMPONENT_STEP, MAX_ATTENTION_LOGIT, MAX_NORM, MOE_MAX_OVER_MEAN, TOKENS_PER_EXPERT,
                      UPDATE_SKIPPED, Record)
from mindmon.formats.columnar import records_of
from mindmon.formats.histogram import HISTOGRAM_KINDS
from mindmon.analysis.sql import DEFAULT_MEMORY_LIMIT, Engine, skipped_lines_sql
from mindmon.analysis.to_tensorboard import rank_shape

RANK_SECTIONS = 8   # a larger run gets the cross-rank view, and per-rank sections on request (--rank)

_LAYER_INDEX = re.compile(r"\.\d+\.")


def parameter_group(name: str) -> str:
    """The module a parameter belongs to, two levels below its layer index
    (`decoder.layers.0.self_attention.linear_qkv.weight` -> `decoder.layers.0.self_attention`),
    or its module path without the last part when it has no layer index."""
    parts = name.split(".")
    match = _LAYER_INDEX.search(name)
    if match is None:
        return ".".join(parts[:-1]) or name
    index = name[:match.start()].count(".") + 1   # position of the layer number in `parts`
    depth = 3 if parts[index + 1] == "transformer_layer" else 2   # MTP wraps its layer in one more module
    return ".".join(parts[:index + depth])


def _figure(rows: int = 1, cols: int = 1, width: float = 10, height: float = 3.6):
    from mindmon.extras import require

    matplotlib = require("report", "matplotlib")

    matplotlib.use("Agg")   # no display: files only
    import matplotlib.pyplot as plt

    return plt.subplots(rows, cols, figsize=(width, height * rows), squeeze=False)


def _png(fig) -> str:
    import matplotlib.pyplot as plt

    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes:   # steps and micro-steps are whole numbers (colorbars keep their own ticks)
        if ax.get_xlabel() in ("step", "global micro-step"):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")   # keep long parameter names whole
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _of(records: List[Record], kind: str) -> List[Record]:
    return [r for r in records if r.kind == kind]


def _mark_nonfinite(ax, xs: List[float], ys: List[float], color: str) -> None:
    """NaN/inf points would be silent gaps in a line: mark each with an x at the top of the axes."""
    bad = [x for x, y in zip(xs, ys) if not np.isfinite(y)]
    if bad:
        from matplotlib.transforms import blended_transform_factory

        ax.plot(bad, [0.97] * len(bad), "x", color=color, markersize=8, label="not finite (NaN/inf)",
                transform=blended_transform_factory(ax.transData, ax.transAxes), clip_on=False)


def _plot(ax, records: List[Record], xs: List[float], style: str, **kwargs) -> None:
    ys = [r.value for r in records]
    ax.plot(xs, ys, style, **kwargs)
    _mark_nonfinite(ax, xs, ys, kwargs.get("color", "tab:red"))


def nonfinite_summary(records: List[Record]) -> Dict[str, List[int]]:
    """{kind: steps} of the scalar records whose value is NaN or infinite."""
    found: Dict[str, List[int]] = defaultdict(list)
    for r in records:
        if not isinstance(r.value, list) and not np.isfinite(r.value) and r.step not in found[r.kind]:
            found[r.kind].append(r.step)
    return dict(found)


THRESHOLD_LABEL = "clipping threshold (max_norm)"
SKIPPED_LABEL = "update skipped"


def _loss_components(ax, records: List[Record]) -> None:
    """Each loss component's per-step value (its mean over the micro-batches), dashed, next to the loss."""
    parts = _of(records, LOSS_COMPONENT_STEP)
    for name in dict.fromkeys(r.name for r in parts):
        series = [r for r in parts if r.name == name]
        _plot(ax, series, [r.step for r in series], "--", linewidth=1, label=name)


def _mark_skipped(ax, records: List[Record]) -> None:
    """A vertical band at every step whose update was skipped (an overflow, a guard)."""
    skipped = [r.step for r in _of(records, UPDATE_SKIPPED) if r.value >= 0.5]
    for index, step in enumerate(skipped):
        ax.axvline(step, color="tab:orange", alpha=0.5, linewidth=2,
                   label=SKIPPED_LABEL if index == 0 else "_nolegend_")


def loss_figure(records: List[Record], micro_steps: int) -> Optional[str]:
    fig = loss_plot(records, micro_steps)
    return None if fig is None else _png(fig)


def _grad_norm_panel(ax, norm: List[Record], lr: List[Record], threshold: List[Record]) -> None:
    """Grad norm before clipping, the clipping threshold where the run clipped (a step above it
    was scaled down to it), and the learning rate on a second axis."""
    if norm:
        _plot(ax, norm, [r.step for r in norm], "-", color="tab:red", label="grad-norm")
        ax.set_ylabel("global grad norm (before clipping)")
    if threshold:
        ax.plot([r.step for r in threshold], [r.value for r in threshold], "--", color="black", linewidth=1,
                drawstyle="steps-mid", label=THRESHOLD_LABEL)
    if lr:
        twin = ax.twinx()
        twin.plot([r.step for r in lr], [r.value for r in lr], "--", color="tab:green", label="learning-rate")
        twin.set_ylabel("learning rate")
        twin.legend(loc="lower right")
    ax.set(title="Gradient norm and learning rate", xlabel="step")
    ax.legend(loc="upper left")


def loss_plot(records: List[Record], micro_steps: int):
    """The loss figure (a matplotlib Figure, None when there is nothing to draw): the loss, and
    below it the grad-norm panel when the run recorded grad_norm or learning_rate."""
    micro, step_loss = _of(records, LOCAL_LOSS), _of(records, DEVICE_LOSS) or _of(records, LOSS)
    norm, lr = _of(records, GRAD_NORM), _of(records, LEARNING_RATE)
    if not (micro or step_loss or norm or lr or _of(records, LOSS_COMPONENT_STEP)):
        return None
    fig, axes = _figure(2 if (norm or lr) else 1)
    ax = axes[0][0]
    if micro:   # micro-batch k of step s sits at s - 1 + (k + 1) / K, so a step's last one lands on s
        _plot(ax, micro, [r.step - 1 + (r.micro_step + 1) / micro_steps for r in micro], ".", color="tab:gray",
              markersize=4, label="per micro-batch (local_loss)")
    if step_loss:
        _plot(ax, step_loss, [r.step for r in step_loss], "-o", color="tab:blue", markersize=3,
              label=f"per step ({step_loss[0].kind})")
    _loss_components(ax, records)
    _mark_skipped(ax, records)
    ax.set(title="Loss", xlabel="step", ylabel="loss")
    ax.legend(loc="upper right")
    if norm or lr:
        _grad_norm_panel(axes[1][0], norm, lr, _of(records, MAX_NORM))
    return fig


def group_norms(records: List[Record]) -> Tuple[List[str], List[int], np.ndarray]:
    """(groups in model order, steps, norms[group, step]): the L2 norm of each parameter group's gradient per step,
    sqrt of the sum of its parameters' squared device_norm (or, without device_norm, of the
    per-step sum of local_norm increments, which adds up to the same A_{K-1})."""
    per_param: Dict[Tuple[str, int], float] = defaultdict(float)
    source = _of(records, DEVICE_NORM) or _of(records, LOCAL_NORM)
    for r in source:
        per_param[(r.name, r.step)] += r.value
    groups = list(dict.fromkeys(parameter_group(name) for name, _ in per_param))   # model order
    steps = sorted({step for _, step in per_param})
    squares = np.zeros((len(groups), len(steps)))
    row, col = {g: i for i, g in enumerate(groups)}, {s: j for j, s in enumerate(steps)}
    for (name, step), value in per_param.items():
        squares[row[parameter_group(name)], col[step]] += value * value
    return groups, steps, np.sqrt(squares)


def grad_norm_figure(records: List[Record]) -> Optional[str]:
    groups, steps, norms = group_norms(records)
    if not groups:
        return None
    fig, axes = _figure(width=11, height=max(3.0, 0.28 * len(groups) + 1.5))
    ax = axes[0][0]
    with np.errstate(divide="ignore"):
        image = ax.imshow(np.log10(norms), aspect="auto", cmap="viridis", interpolation="nearest",
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, len(groups) - 0.5, -0.5))
    ax.set_yticks(range(len(groups)), groups, fontsize=7)
    ax.set(title="Gradient norm per parameter group (log10)", xlabel="step")
    fig.colorbar(image, ax=ax, label="log10 |grad|")
    return _png(fig)


def tokens_by_layer(records: List[Record], micro_steps: int) -> Dict[str, Tuple[np.ndarray, np.ndarray]]:
    """{layer: (global micro-steps, tokens[micro-step, expert])}, in the order layers appear."""
    rows: Dict[str, list] = defaultdict(list)
    for r in _of(records, TOKENS_PER_EXPERT):
        iteration = r.iteration if r.iteration is not None else (r.step - 1) * micro_steps + r.micro_step
        rows[r.name].append((iteration, r.value))
    return {name: (np.array([i for i, _ in pairs]), np.array([v for _, v in pairs], dtype=float))
            for name, pairs in rows.items()}


def imbalance(tokens: np.ndarray) -> Dict[str, float]:
    """Load summary of one layer over the recorded micro-steps (the whole run and the worst one)."""
    total = tokens.sum(axis=0)
    per_micro = tokens.max(axis=1) / np.maximum(tokens.mean(axis=1), 1e-12)
    return {"micro-steps": len(tokens), "max/mean (run)": total.max() / max(total.mean(), 1e-12),
            "CV (run)": total.std() / max(total.mean(), 1e-12), "worst max/mean (micro-step)": per_micro.max(),
            "idle expert x micro-steps": int((tokens == 0).sum())}


def tokens_figure(layers: Dict[str, Tuple[np.ndarray, np.ndarray]], records: List[Record]) -> Optional[str]:
    if not layers:
        return None
    summary = _of(records, MOE_MAX_OVER_MEAN)   # the MoE monitor's per-step summary, when it ran
    fig, axes = _figure(len(layers) + bool(summary), 1, height=2.6)
    for ax, (name, (iterations, tokens)) in zip(axes[:, 0], layers.items()):
        image = ax.imshow(tokens.T, aspect="auto", cmap="magma", interpolation="nearest",
                          extent=(iterations.min() - 0.5, iterations.max() + 0.5, tokens.shape[1] - 0.5, -0.5))
        ax.set_yticks(range(tokens.shape[1]))
        ax.set(title=f"Tokens per expert: {name}", xlabel="global micro-step", ylabel="expert")
        fig.colorbar(image, ax=ax, label="tokens")
    if summary:
        ax = axes[-1][0]
        for name in layers:
            rows = [r for r in summary if r.name == name]
            ax.plot([r.step for r in rows], [r.value for r in rows], "-o", markersize=3, label=name)
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set(title="Busiest expert / mean, per step (1 = balanced)", xlabel="step", ylabel="max / mean")
        ax.legend(fontsize=7)
    return _png(fig)


def max_logit_figure(records: List[Record]) -> Optional[str]:
    per_layer: Dict[str, list] = defaultdict(list)
    for r in _of(records, MAX_ATTENTION_LOGIT):
        per_layer[r.name].append((r.step, r.value))
    if not per_layer:
        return None
    fig, axes = _figure(1 + len(per_layer), 1, height=2.8)
    overview = axes[0][0]
    for name, rows in per_layer.items():
        overview.plot([s for s, _ in rows], [max(v) for _, v in rows], "-o", markersize=3, label=name)
    overview.set(title="Max attention logit per layer (max over heads)", xlabel="step", ylabel="max logit")
    overview.legend(fontsize=7)
    for ax, (name, rows) in zip(axes[1:, 0], per_layer.items()):
        heads = np.array([v for _, v in rows], dtype=float)
        for head in range(heads.shape[1]):
            ax.plot([s for s, _ in rows], heads[:, head], "-", label=f"head {head}")
        ax.set(title=f"Per head: {name}", xlabel="step", ylabel="max logit")
        ax.legend(fontsize=7, ncol=min(heads.shape[1], 8))
    return _png(fig)


def heatmap_columns(records: List[Record]) -> Dict[Tuple[str, str], Tuple[np.ndarray, List[int]]]:
    """{(kind, tensor): (counts [33 rows: below -1, the 30 bins, above 1, NaN] x steps, the steps)} of the
    update/ratio histogram records (mindmon/formats/histogram.py), steps in order."""
    columns: Dict[Tuple[str, str], Dict[int, List[float]]] = defaultdict(dict)
    for record in records:
        if record.kind in HISTOGRAM_KINDS:
            columns[(record.kind, record.name)][record.step] = list(record.value)
    return {key: (np.array([by_step[s] for s in sorted(by_step)], dtype=np.float64).T, sorted(by_step))
            for key, by_step in columns.items()}


def heatmaps_html(records: List[Record]) -> str:
    """kj600's heat maps of the bias-corrected Adam update and ratio, one image per (kind, tensor)."""
    from mindmon.extras import require
    from mindmon.sinks.heatmap import draw

    require("report", "matplotlib")
    from matplotlib.image import imsave

    parts = []
    for (kind, name), (matrix, steps) in list(heatmap_columns(records).items())[:HEATMAPS_SHOWN]:
        buffer = io.BytesIO()
        imsave(buffer, draw(matrix, steps, f"{name}: {kind}"), format="png")
        png = base64.b64encode(buffer.getvalue()).decode("ascii")
        parts.append(f'<img alt="{html.escape(kind)} {html.escape(name)}" src="data:image/png;base64,{png}">')
    return "\n".join(parts)


def _table(rows: Dict[str, Dict[str, float]]) -> str:
    if not rows:
        return ""
    columns = list(next(iter(rows.values())))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join(f"<tr><td>{html.escape(name)}</td>" + "".join(
        f"<td>{v:.4g}</td>" for v in values.values()) + "</tr>" for name, values in rows.items())
    return f"<table><tr><th>MoE layer</th>{head}</tr>{body}</table>"


# The kinds the figures draw; local_norm (four times device_norm's rows) only when a rank has no device_norm.
FIGURE_KINDS = (LOCAL_LOSS, DEVICE_LOSS, LOSS, GRAD_NORM, LEARNING_RATE, MAX_NORM, DEVICE_NORM, TOKENS_PER_EXPERT,
                MOE_MAX_OVER_MEAN, MAX_ATTENTION_LOGIT, LOSS_COMPONENT_STEP, UPDATE_SKIPPED) + HISTOGRAM_KINDS
HEATMAPS_SHOWN = 12   # update/ratio heat maps drawn per rank (the first tensors in file order)


def figure_records(engine, rank: int) -> List[Record]:
    """The rank's records of FIGURE_KINDS (or local_norm in place of device_norm), in file order."""
    source = engine.rank_sql(rank)
    wanted = list(FIGURE_KINDS)
    if engine.first(f"SELECT count(*) FROM ({source}) WHERE kind = ?", [DEVICE_NORM])[0] == 0:
        wanted.append(LOCAL_NORM)
    return records_of(engine.relation(f"SELECT * FROM ({source}) WHERE list_contains(?, kind)", [wanted]).to_arrow_table())


def rank_summary(engine, rank: int) -> Tuple[int, Optional[int], Optional[int], Dict[str, List[int]]]:
    """(records, first step, last step, nonfinite_summary()) of one rank, asked of the engine."""
    source = engine.rank_sql(rank)
    for r, path in engine.sources:   # a run in progress: its last line may be half written (said, as the reader does)
        skipped = engine.first(skipped_lines_sql(path))[0] if r == rank and path.endswith(".jsonl") else 0
        if skipped:
            print(f"mindmon: {path}: {skipped} line(s) that are not records were skipped", file=sys.stderr)
    count, first, last = engine.first(f"SELECT count(*), min(step), max(step) FROM ({source})")
    bad = engine.execute(f"SELECT kind, step FROM ({source}) WHERE value IS NOT NULL AND NOT isfinite(value)").fetchall()
    found: Dict[str, List[int]] = defaultdict(list)
    for kind, step in bad:
        if step not in found[kind]:
            found[kind].append(step)
    return count, first, last, dict(found)


def rank_section(engine, rank: int, progress=None) -> str:
    records = figure_records(engine, rank)
    _, micro_steps = rank_shape(engine, rank)
    count, first, last, nonfinite = rank_summary(engine, rank)
    layers = tokens_by_layer(records, micro_steps)
    where = ", ".join(path for r, path in engine.sources if r == rank)
    parts = [f"<h2>Rank {rank}</h2><p>{html.escape(where)}: {count} records, "
             f"steps {'-' if first is None else first}..{'-' if last is None else last}, "
             f"{micro_steps} micro-step(s) per step</p>"]
    if nonfinite:
        listed = "; ".join(f"{kind} at step(s) {', '.join(map(str, steps))}" for kind, steps in nonfinite.items())
        parts.append(f'<p class="nonfinite">Not finite (NaN/inf, marked x in the figures): {html.escape(listed)}</p>')
    figures = (("loss", lambda: loss_figure(records, micro_steps)), ("gradient norms", lambda: grad_norm_figure(records)),
               ("tokens per expert", lambda: tokens_figure(layers, records)),
               ("max attention logit", lambda: max_logit_figure(records)))
    for title, build in figures:
        png = build()
        if png is None:
            continue
        parts.append(f'<h3>{title.capitalize()}</h3><img alt="{title}" src="data:image/png;base64,{png}">')
        if title == "tokens per expert":
            parts.append(_table({name: imbalance(tokens) for name, (_, tokens) in layers.items()}))
        if progress is not None:
            print(f"mindmon report: rank {rank}: {title}", file=progress, flush=True)
    maps = heatmaps_html(records)
    if maps:
        parts.append("<h3>Adam update and ratio heat maps (ur_distribution)</h3>" + maps)
    return "\n".join(parts)


_STYLE = ("body{font-family:sans-serif;margin:2em;max-width:1100px} img{max-width:100%} "
          "table{border-collapse:collapse} td,th{border:1px solid #bbb;padding:2px 8px;text-align:right}")


def write_report(run_dir: str, output: str, progress=sys.stderr, ranks: Optional[Sequence[int]] = None,
                 memory_limit: str = DEFAULT_MEMORY_LIMIT, source: str = "auto") -> str:
    """Writes the page to `output` and returns its path. With more than one rank the page opens with
    the cross-rank view (mindmon.analysis.across_ranks); one section per rank follows for `ranks`
    (default: every rank of a run of at most RANK_SECTIONS ranks, none of a larger one)."""
    from mindmon.analysis.across_ranks import across_ranks_section
    from mindmon.analysis.live_summaries import live_summaries_section
    from mindmon.analysis.speed_report import speed_section

    with Engine(run_dir, memory_limit, source=source) as engine:
        every = engine.ranks()
        missing = sorted(set(ranks or ()) - set(every))
        if missing:
            raise ValueError(f"--rank: got {missing}; allowed: the run's ranks, {every[0]}..{every[-1]}")
        chosen = list(ranks) if ranks else (every if len(every) <= RANK_SECTIONS else [])
        sections = [across_ranks_section(engine, progress, _png, _figure)] if len(every) > 1 else []
        sections += [s for s in [live_summaries_section(engine, progress, _png, _figure),
                                 speed_section(engine, progress, _png, _figure)] if s is not None]
        sections += [rank_section(engine, rank, progress) for rank in chosen]
    page = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>mindmon report</title>"
            f"<style>{_STYLE}</style></head><body><h1>mindmon report</h1>"
            f"<p>{html.escape(run_dir)} &mdash; generated {datetime.now():%Y-%m-%d %H:%M:%S}</p>"
            + "\n".join(sections) + "</body></html>")
    with open(output, "w", encoding="utf-8") as handle:
        handle.write(page)
    return output
