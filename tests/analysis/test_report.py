"""`mindmon report`: the page is one self-contained HTML file with PNG figures, and the numbers it
plots (group norms, tokens-per-expert imbalance) equal a numpy computation from the JSONL."""
import base64
import io
import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from tests.support.jsonl import read_jsonl


def images(page):
    """The page's inlined PNGs, decoded, by alt text."""
    found = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)">', page)
    return {alt: Image.open(io.BytesIO(base64.b64decode(data))) for alt, data in found}


def run_report(run_dir, output):
    result = subprocess.run([sys.executable, "-m", "mindmon.cli", "report", str(run_dir), "-o", str(output)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result


def test_demo_report_has_every_figure(view_demo, tmp_path):
    result = run_report(view_demo, tmp_path / "report.html")
    page = (tmp_path / "report.html").read_text()
    assert "src=\"http" not in page and "<link" not in page and "<script" not in page   # nothing to fetch
    figures = images(page)
    assert set(figures) == {"loss", "gradient norms", "tokens per expert", "max attention logit"}
    for name, image in figures.items():
        pixels = np.asarray(image.convert("L"), dtype=float)
        assert image.format == "PNG" and image.width > 400 and pixels.std() > 10, name   # not blank
        assert f"rank 0: {name}" in result.stderr   # progress, one line per figure
    for layer in ("decoder.layers.1", "decoder.layers.2", "mtp.layers.0"):   # the imbalance table
        assert f"<td>{layer}</td>" in page


def test_group_norms_are_the_norms_of_the_parameters_in_the_group(view_demo):
    from mindmon.analysis.report import group_norms, parameter_group
    from mindmon.formats.jsonl import read_records

    assert parameter_group("decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight") == "decoder.layers.1.mlp"
    assert parameter_group("mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight") == \
        "mtp.layers.0.transformer_layer.self_attention"
    assert parameter_group("embedding.word_embeddings.weight") == "embedding.word_embeddings"
    path = view_demo / "monitor" / "rank_0" / "metrics.jsonl"
    groups, steps, norms = group_norms(read_records(str(path)))
    rows = [r for r in read_jsonl(path) if r["kind"] == "device_norm"]
    attention = [r for r in rows if r["name"].startswith("decoder.layers.0.self_attention.") and r["step"] == 2]
    assert len(attention) == 2   # linear_qkv and linear_proj
    want = np.sqrt(sum(r["value"] ** 2 for r in attention))
    assert norms[groups.index("decoder.layers.0.self_attention"), steps.index(2)] == pytest.approx(want, rel=1e-12)
    # Every parameter is in exactly one group: the groups' squares add up to the global norm squared.
    total = np.sqrt(sum(r["value"] ** 2 for r in rows if r["step"] == 3))
    assert np.sqrt((norms[:, steps.index(3)] ** 2).sum()) == pytest.approx(total, rel=1e-12)


def write_records(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_moe_imbalance_and_a_run_in_progress(tmp_path):
    """Records written here (two ranks, one MoE layer each): the table's numbers are numpy's, and
    a half-written last line (a run still going) is skipped."""
    rng = np.random.default_rng(0)
    tokens = {0: rng.integers(0, 30, size=(6, 4)), 1: np.tile([40, 0, 0, 24], (6, 1))}   # rank 1: two idle experts
    for rank, counts in tokens.items():
        rows = [{"step": m // 2 + 1, "micro_step": m % 2, "rank": rank, "kind": "tokens_per_expert",
                 "name": "decoder.layers.1", "value": counts[m].tolist(), "iter": m} for m in range(6)]
        rows += [{"step": s, "micro_step": None, "rank": rank, "kind": "loss", "name": "loss", "value": 3.0 / s}
                 for s in (1, 2, 3)]
        write_records(tmp_path / "monitor" / f"rank_{rank}" / "metrics.jsonl", rows)
    with open(tmp_path / "monitor" / "rank_1" / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 4, "micro_step": 0, "rank": 1, "ki')   # the writer is mid-line
    result = run_report(tmp_path, tmp_path / "page.html")
    assert "1 line(s) that are not records were skipped" in result.stderr
    page = (tmp_path / "page.html").read_text()
    sections = page.split("<h2>Rank ")[1:]
    assert [s[0] for s in sections] == ["0", "1"]
    for rank, section in zip((0, 1), sections):
        counts = tokens[rank]
        total = counts.sum(axis=0)
        cells = re.findall(r"<td>([^<]+)</td>", section.split("<table>")[1])
        want = [6, total.max() / total.mean(), total.std() / total.mean(),
                (counts.max(axis=1) / counts.mean(axis=1)).max(), (counts == 0).sum()]
        assert cells[0] == "decoder.layers.1"
        np.testing.assert_allclose([float(c) for c in cells[1:]], want, rtol=5e-4)   # printed with 4 digits
        assert set(images(section)) == {"loss", "tokens per expert"}


def test_report_without_records_is_a_clear_error(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mindmon.cli", "report", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "rank_<r>/metrics.jsonl" in result.stderr


def test_report_on_a_parsed_log(view_demo, tmp_path):
    """A run known only from its log: parse-log then report gives the same figures."""
    shutil.copy(view_demo / "log" / "rank_0" / "info.log", tmp_path / "info.log")
    subprocess.run([sys.executable, "-m", "mindmon.cli", "parse-log", str(tmp_path / "info.log"), "-o",
                    str(tmp_path / "parsed")], check=True, capture_output=True, timeout=300)
    run_report(tmp_path / "parsed", tmp_path / "parsed.html")
    assert set(images((tmp_path / "parsed.html").read_text())) == {
        "loss", "gradient norms", "tokens per expert", "max attention logit"}


def test_update_and_ratio_heat_maps_from_the_histogram_records(tmp_path):
    """ur_distribution's histogram records (the JSONL's counts of the bias-corrected Adam update and
    ratio): the page draws one heat map per (kind, tensor), whose columns are the steps' counts in order,
    below -1 / the 30 bins / above 1 / NaN, as numpy's histogram of the same vectors gives them."""
    from mindmon.analysis.report import heatmap_columns
    from mindmon.formats.histogram import histogram
    from mindmon.formats.jsonl import read_records

    rng = np.random.default_rng(3)
    vectors = {(kind, step): rng.standard_normal(50) * scale
               for kind, scale in (("adam_update_histogram", 0.5), ("adam_ratio_histogram", 2.0)) for step in (3, 1, 2)}
    vectors[("adam_ratio_histogram", 2)][:4] = np.nan
    rows = [{"step": step, "micro_step": None, "rank": 0, "kind": kind, "name": "fc1.weight",
             "value": histogram(vector)} for (kind, step), vector in vectors.items()]
    rows += [{"step": s, "micro_step": None, "rank": 0, "kind": "loss", "name": "loss", "value": 1.0 / s} for s in (1, 2, 3)]
    path = tmp_path / "monitor" / "rank_0" / "metrics.jsonl"
    write_records(path, rows)
    columns = heatmap_columns(read_records(str(path)))
    for kind in ("adam_update_histogram", "adam_ratio_histogram"):
        matrix, steps = columns[(kind, "fc1.weight")]
        assert steps == [1, 2, 3] and matrix.shape == (33, 3)
        for column, step in enumerate(steps):
            flat = vectors[(kind, step)]
            inside, _ = np.histogram(flat[np.isfinite(flat)], bins=30, range=(-1.0, 1.0))
            want = [np.sum(flat < -1), *inside, np.sum(flat > 1), np.sum(np.isnan(flat))]
            np.testing.assert_array_equal(matrix[:, column], want)
            assert matrix[:, column].sum() == flat.size
    result = run_report(tmp_path, tmp_path / "page.html")
    assert result.returncode == 0, result.stderr
    section = (tmp_path / "page.html").read_text().split("<h2>Rank ")[1]
    assert "Adam update and ratio heat maps" in section
    assert {"adam_update_histogram fc1.weight", "adam_ratio_histogram fc1.weight"} <= set(images(section))
