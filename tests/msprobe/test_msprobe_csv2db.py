"""`mindmon csv2db`: TrainerMon's and TrainerMonitorV2's CSV files of real runs into msprobe's trend
database; every trend value against the CSV text, the micro-step axis by hand, the same database as
msprobe 26.2.0's own csv2db makes from TrainerMon's files, and msprobe's readers on mindmon's database
(msprobe in a separate virtual environment)."""
import csv
import glob
import json
import os
import shutil
import sqlite3
import subprocess

import pytest

from mindmon.cli import main
from tests.support.msprobe_reference import K, NAMES, STEPS, msprobe_loop
from mindmon.msprobe import TrainerMon
from tests.support import HERE, REPO

MSPROBE_PYTHON = os.environ.get("MSPROBE_V2_PYTHON", os.path.join(REPO, ".venv-msprobe", "bin", "python"))
needs_msprobe = pytest.mark.skipif(not os.path.exists(MSPROBE_PYTHON), reason=f"msprobe 26.2.0's venv "
                                   f"{MSPROBE_PYTHON} not built (python3 -m venv; pip install mindspore==2.9.0 "
                                   f"mindstudio-probe==26.2.0)")
V1 = {"param_distribution": True, "wg_distribution": True, "monitor_mbs_grad": True,
      "ops": ["min", "max", "norm", "mean"], "ndigits": 10, "step_count_per_record": 2}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One folder holding a TrainerMon run (rank 0) and a TrainerMonitorV2 run (rank_0)."""
    import pytest as _pytest

    root = tmp_path_factory.mktemp("csv2db")
    config = root / "v1.json"
    config.write_text(json.dumps(V1))
    patch = _pytest.MonkeyPatch()
    patch.setenv("MONITOR_OUTPUT_DIR", str(root / "run"))
    try:
        msprobe_loop(TrainerMon, str(config)).close()
    finally:
        patch.undo()
    from tests.msprobe.test_msprobe_v2 import run_golden, v2_config, write

    run_golden("mindmon", write(root, v2_config(root / "run" / "v2"), "v2.json"))
    return root / "run"


def csv_rows(run_dir):
    """[(metric, name, vpp_stage, step, micro_step, {op: text})] of every CSV row, v1 and V2 (V2 named as
    csv2db names them: metric from slug and scope, micro-steps from 0, moments by parameter)."""
    v2_metrics = {("weight_grad", "unreduced"): "grad_unreduced", ("weight_grad", "reduced"): "grad_reduced",
                  ("param", "param_origin"): "param_origin", ("param", "param_updated"): "param_updated",
                  ("optimizer", "exp_avg"): "exp_avg", ("optimizer", "exp_avg_sq"): "exp_avg_sq",
                  ("module", "forward"): "actv", ("module", "backward"): "actv_grad"}
    rows = []
    for path in sorted(glob.glob(str(run_dir / "*-rank0-*" / "*.csv"))):
        metric = os.path.basename(path).rsplit("_", 1)[0]
        for r in csv.DictReader(open(path)):
            rows.append((metric, r["name"], int(r["vpp_stage"]), int(r["step"]), int(r.get("micro_step") or 0),
                         {op: r[op] for op in ("min", "max", "norm", "mean") if op in r}))
    for path in sorted(glob.glob(str(run_dir / "v2" / "rank_0" / "*.csv"))):
        slug = os.path.basename(path).rsplit("_step", 1)[0]
        for r in csv.DictReader(open(path)):
            metric = v2_metrics[(slug, r["scope"])]
            name = r["module_name"]
            if metric.startswith("exp_avg"):
                name = name[len(metric) + 1:-len(metric) - 1]
            rows.append((metric, name, int(r["vpp_stage"]), int(r["step"]), int(r.get("micro_step") or 1) - 1,
                         {op: r[op] for op in ("min", "max", "norm", "mean", "nans", "zeros") if op in r}))
    return rows


def table(db, sql):
    con = sqlite3.connect(db)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def test_every_csv_value_is_in_the_database(run_dir):
    assert main(["csv2db", str(run_dir), "--micro_step", "false"]) == 0
    db = str(run_dir / "monitor_data.trend.db")
    rows = csv_rows(run_dir)
    columns = [c[1] for c in table(db, "PRAGMA table_info(trend_data)")]
    assert columns == ["rank", "step", "target_id", "metric_id", "norm", "min", "max", "zeros", "nans", "mean"]
    stored = {(m, n, v, s, k): dict(zip(columns[4:], values)) for m, n, v, k, s, *values in table(db, """
        SELECT metric_name, target_name, vpp_stage, micro_step, step, norm, min, max, zeros, nans, mean
        FROM trend_data JOIN monitoring_targets USING (target_id) JOIN monitoring_metrics USING (metric_id)""")}
    # TrainerMon's rows (vpp_stage 0) and TrainerMonitorV2's (-1, msprobe's default stage) are other targets
    assert set(stored) == {(m, n, v, s, k) for m, n, v, s, k, _ in rows} and len(stored) == len(rows)
    for metric, name, vpp, step, micro, values in rows:
        assert values and {op: stored[(metric, name, vpp, step, micro)][op] for op in values} == \
            {op: float(text) for op, text in values.items()}, (metric, name, vpp, step, micro)
    metrics = [m for (m,) in table(db, "SELECT metric_name FROM monitoring_metrics ORDER BY metric_id")]
    assert metrics == ["actv", "actv_grad", "exp_avg", "exp_avg_sq", "grad_unreduced", "grad_reduced",
                       "param_origin", "param_updated"]
    assert table(db, "SELECT min_step, max_step, max_rank, grad_unreduced FROM global_stats") == \
        [(0, STEPS - 1, 0, "norm,min,max,mean")]


def test_the_micro_step_axis(tmp_path):
    """--micro_step true: step s, micro-step k at (the micro-step counts of the steps before s) + k; a row
    without micro-steps at its step's first. Hand-made files: step 0 has 3 micro-steps, step 1 has 2."""
    folder = tmp_path / "Dec01_00-00-00-rank3-abcdef01"
    folder.mkdir()
    (folder / "grad_unreduced_0-1.csv").write_text(
        "vpp_stage,name,step,micro_step,min,max,shape,dtype\n"
        + "".join(f"0,layers.1.w,{s},{k},{s}{k},inf,\"(2,)\",Float32\n" for s, ks in ((0, 3), (1, 2)) for k in range(ks)))
    (folder / "param_origin_0-1.csv").write_text("vpp_stage,name,step,min,shape,dtype\n1,w,1,-2e10,\"(2,)\",Float32\n")
    assert main(["csv2db", str(tmp_path)]) == 0
    db = str(tmp_path / "monitor_data.trend.db")
    got = table(db, "SELECT rank, step, target_name, min, max FROM trend_data JOIN monitoring_targets "
                    "USING (target_id) ORDER BY metric_id, step")
    assert got == [(3, 0, "layers.1.w", 0.0, 1e9 + 1), (3, 1, "layers.1.w", 1.0, 1e9 + 1),
                   (3, 2, "layers.1.w", 2.0, 1e9 + 1), (3, 3, "layers.1.w", 10.0, 1e9 + 1),
                   (3, 4, "layers.1.w", 11.0, 1e9 + 1), (3, 3, "w", -1e9, None)]
    assert table(db, "SELECT min_step, max_step, max_rank FROM global_stats") == [(0, 4, 3)]
    tags = table(db, "SELECT tag_name, category FROM monitoring_tags JOIN tag_target_mapping USING (tag_id) "
                     "JOIN monitoring_targets USING (target_id) WHERE target_name = 'layers.1.w' ORDER BY tag_name")
    assert tags == [("layers", "module"), ("layers.1", "layer"), ("w", "module")]


def test_nothing_to_convert_is_one_line(tmp_path, capsys):
    assert main(["csv2db", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no msprobe monitor CSV rows" in err


def run_msprobe(*args):
    result = subprocess.run([MSPROBE_PYTHON, os.path.join(HERE, "msprobe_csv2db_reader.py"), *args],
                            capture_output=True, text=True, timeout=300, cwd=HERE)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@needs_msprobe
@pytest.mark.parametrize("micro_step", ["true", "false"])
def test_the_same_database_as_msprobes_csv2db(run_dir, tmp_path, micro_step):
    """msprobe's import_data and mindmon's csv2db on TrainerMon's folder: every table the same."""
    folder = glob.glob(str(run_dir / "*-rank0-*"))[0]
    alone = tmp_path / "run"
    shutil.copytree(folder, alone / os.path.basename(folder))
    theirs, ours = str(tmp_path / "msprobe.db"), str(tmp_path / "mindmon.db")
    run_msprobe("import", folder, theirs, micro_step)
    assert main(["csv2db", str(alone), "-o", ours, "--micro_step", micro_step]) == 0
    for sql in ("SELECT * FROM monitoring_metrics ORDER BY metric_id",
                "SELECT * FROM monitoring_targets ORDER BY target_id",
                "SELECT tag_name, category, metric_id FROM monitoring_tags ORDER BY tag_name, category, metric_id",
                "SELECT tag_name, category, target_id FROM tag_target_mapping JOIN monitoring_tags USING (tag_id) "
                "ORDER BY 1, 2, 3",
                "SELECT * FROM trend_data ORDER BY rank, step, target_id, metric_id",
                "SELECT min_step, max_step, max_rank FROM global_stats"):
        assert table(ours, sql) == table(theirs, sql), sql
    assert [c[1:3] for c in table(ours, "PRAGMA table_info(trend_data)")] == \
        [c[1:3] for c in table(theirs, "PRAGMA table_info(trend_data)")]
    for metric in ("grad_unreduced", "param_origin"):   # msprobe joins a set: its order is not fixed
        mine, its = (table(db, f"SELECT {metric} FROM global_stats")[0][0] for db in (ours, theirs))
        assert sorted(mine.split(",")) == sorted(its.split(","))
    # per step and parameter: param_origin, param_updated, grad_reduced, and grad_unreduced per micro-batch
    assert len(table(ours, "SELECT * FROM trend_data")) == STEPS * len(NAMES) * (3 + K)


@needs_msprobe
def test_msprobes_reader_reads_mindmons_database(run_dir):
    assert main(["csv2db", str(run_dir)]) == 0
    read = json.loads(run_msprobe("read", str(run_dir / "monitor_data.trend.db")))
    assert read["metrics"]["grad_unreduced"][1] == ["norm", "min", "max", "mean"]
    assert read["metrics"]["actv"][1] == ["min", "max", "nans", "mean"]
    assert read["metrics"]["param_origin"][1] == ["norm", "min", "max", "zeros", "mean"]
    targets = {tuple(t[:3]) for t in read["targets"]}
    assert {("fc1.weight", 0, 0), ("fc1.weight", -1, 0), ("fc2.input.0", -1, 0)} <= targets
    db = str(run_dir / "monitor_data.trend.db")
    assert sorted(map(tuple, read["trend"])) == sorted(table(db, "SELECT rank, step, target_id, metric_id, min, max "
                                                                 "FROM trend_data"))
