"""`mindmon merge` flags the rank that stands out, on hand-written per-rank files."""
import csv
import json

from mindmon.analysis.merge import merge


def _write(root, rank, rows):
    path = root / "monitor" / f"rank_{rank}" / "metrics.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps({"rank": rank, **row}) + "\n" for row in rows))


def _rows(loss, norm):
    return [{"step": 1, "micro_step": 0, "kind": "local_loss", "name": "loss", "value": loss},
            {"step": 1, "micro_step": 0, "kind": "micro_norm", "name": "w", "value": norm},
            {"step": 1, "micro_step": 0, "kind": "local_norm", "name": "w", "value": -norm},
            {"step": 1, "micro_step": None, "kind": "max_attention_logit", "name": "a", "value": [1.0, 2.0]}]


def test_flags_spike_and_nan(tmp_path):
    _write(tmp_path, 0, _rows(2.0, 1.0))
    _write(tmp_path, 1, _rows(2.1, float("nan")))
    _write(tmp_path, 2, _rows(21.0, 1.1))
    path, flagged = merge(str(tmp_path))
    with open(path, newline="") as handle:
        rows = {(r["kind"], r["name"]): r for r in csv.DictReader(handle)}
    assert set(rows) == {("local_loss", "loss"), ("micro_norm", "w"), ("local_norm", "w")}  # lists left out
    loss = rows[("local_loss", "loss")]
    assert (loss["outlier_rank"], loss["max_rank"], loss["ranks"]) == ("2", "2", "3")
    assert float(loss["mean"]) == (2.0 + 2.1 + 21.0) / 3
    assert rows[("micro_norm", "w")]["outlier_rank"] == "1"
    assert rows[("local_norm", "w")]["outlier_rank"] == ""  # increments are not judged
    assert len(flagged) == 2


def test_no_flag_within_factor(tmp_path):
    _write(tmp_path, 0, _rows(2.0, 1.0))
    _write(tmp_path, 1, _rows(9.0, 4.0))
    _, flagged = merge(str(tmp_path), factor=5.0)
    assert flagged == []
    _, flagged = merge(str(tmp_path), factor=3.0)
    assert [row[0] for row in flagged] == ["local_loss", "micro_norm"]
