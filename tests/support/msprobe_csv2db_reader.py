"""msprobe 26.2.0's own csv2db side, run in its separate virtual environment by tests/msprobe/test_msprobe_csv2db.py:

    python msprobe_csv2db_reader.py import RANK_FOLDER DB [true|false]   msprobe's import_data on one rank folder
    python msprobe_csv2db_reader.py read DB                              msprobe's readers of a database -> JSON
"""
import json
import sys


def import_folder(folder: str, db: str, micro_step: str = "true") -> None:
    from msprobe.core.monitor.csv2db import CSV2DBConfig, import_data

    assert import_data(CSV2DBConfig(target_output_dirs={0: folder}, db_file=db, micro_step=micro_step == "true"))


def read(db: str) -> None:
    from msprobe.core.monitor.db_utils import MonitorDB

    monitor_db = MonitorDB(db)
    metrics = monitor_db.get_metric_mapping()
    targets = monitor_db.get_target_mapping()
    trend = monitor_db.db_manager.select_data(table_name="trend_data", columns=["rank", "step", "target_id",
                                                                                "metric_id", "min", "max"])
    print(json.dumps({"metrics": {name: [mid, stats] for name, (mid, stats) in metrics.items()},
                      "targets": [[*key, tid] for key, tid in targets.items()],
                      "trend": [[r["rank"], r["step"], r["target_id"], r["metric_id"], r["min"], r["max"]]
                                for r in trend]}))


if __name__ == "__main__":
    import_folder(*sys.argv[2:]) if sys.argv[1] == "import" else read(sys.argv[2])
