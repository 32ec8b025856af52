"""`mindmon merge RUN --engine dask`: the same merged.csv on a Dask cluster, for runs whose files
outgrow one machine. The workers read the Parquet files (local paths, or any fsspec URL: `s3://`,
`gs://`, `abfs://`), shuffle the records by key so that each key's values across ranks meet on one
worker, and compute the rows there with the same numpy code as the DuckDB merge
(mindmon.analysis.merge.window_rows): the table is the same, byte for byte.

Without a scheduler address it starts a LocalCluster on this machine (2 worker processes); with
one (`tcp://scheduler:8786`) it runs on that cluster, whose workers must reach the files.

Example:
    merge_on_dask("s3://bucket/run/monitor", "merged.csv", scheduler="tcp://10.0.0.5:8786")
"""
import csv
import os
from typing import List, Optional, Tuple

from mindmon.extras import require
from mindmon.formats.columnar import columnar_files
from mindmon.analysis.merge import COLUMNS, window_rows

EXTRA = "distributed"
KEY = ["kind", "name", "step", "micro"]   # micro: micro_step, -1 for a step-level value (a shuffle key has no null)


def parquet_paths(run_dir: str) -> List[str]:
    """The run's Parquet files: found below a local folder, or `<url>/**/rank_*/metrics.parquet` for a URL."""
    if "://" in run_dir:
        return [run_dir.rstrip("/") + "/**/rank_*/metrics.parquet"]
    paths = [path for _, path in columnar_files(run_dir) if path.endswith(".parquet")]
    if not paths:
        raise FileNotFoundError(f"no rank_<r>/metrics.parquet at or below {run_dir!r}; the Dask merge reads Parquet "
                                f"(write it with monitor.metrics_formats: [parquet] or `mindmon compact`)")
    return paths


def partition_rows(frame, factor: float):
    """The merged rows of the keys of one partition (all of each key's records are in it)."""
    pa, pd, np = require(EXTRA, "pyarrow"), require(EXTRA, "pandas"), require(EXTRA, "numpy")
    if frame.empty:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in COLUMNS})
    frame = frame.sort_values(KEY + ["rank"], kind="stable")
    ids = frame.groupby(KEY, sort=False).ngroup().to_numpy()
    offsets = np.concatenate([[0], np.flatnonzero(np.diff(ids)) + 1, [len(ids)]]).astype(np.int32)
    first = frame.iloc[offsets[:-1]]
    values = frame["value"].to_numpy(dtype=np.float64, na_value=np.nan)   # NaN stays NaN
    table = pa.table({"kind": first["kind"].tolist(), "name": first["name"].tolist(), "step": first["step"].tolist(),
                      "micro_step": [None if m < 0 else int(m) for m in first["micro"]],
                      "ranks": pa.ListArray.from_arrays(offsets, frame["rank"].to_numpy(dtype=np.int64)),
                      "vals": pa.ListArray.from_arrays(offsets, values)})
    rows, _ = window_rows(table, factor)
    return pd.DataFrame(rows, columns=COLUMNS, dtype=object)


def merged_rows(paths: List[str], factor: float, client) -> List[List]:
    dd, pd = require(EXTRA, "dask.dataframe"), require(EXTRA, "pandas")
    # Arrow-backed columns: a list record's null `value` is apart from a NaN one.
    frame = dd.read_parquet(paths, columns=["kind", "name", "step", "micro_step", "rank", "value"],
                            dtype_backend="pyarrow")
    frame = frame[~frame["value"].isna()]
    frame = frame.assign(micro=frame["micro_step"].fillna(-1).astype("int64[pyarrow]")).drop(columns=["micro_step"])
    frame = frame.shuffle(on=KEY)
    meta = pd.DataFrame({c: pd.Series(dtype=object) for c in COLUMNS})
    rows = client.compute(frame.map_partitions(partition_rows, factor, meta=meta)).result()
    return rows.values.tolist()


def merge_on_dask(run_dir: str, output: Optional[str] = None, factor: float = 5.0,
                  scheduler: Optional[str] = None) -> Tuple[str, List[List]]:
    """Writes the table merge() writes; returns its path and the flagged rows."""
    distributed = require(EXTRA, "distributed")
    if factor <= 1:
        raise ValueError(f"factor: got {factor}; allowed: a number > 1")
    paths = parquet_paths(run_dir)
    output = output or os.path.join(run_dir, "merged.csv")
    cluster = None if scheduler else distributed.LocalCluster(n_workers=2, threads_per_worker=1,
                                                              dashboard_address=None)
    try:
        with distributed.Client(scheduler or cluster) as client:
            rows = merged_rows(paths, factor, client)
    finally:
        if cluster is not None:
            cluster.close()
    rows.sort(key=lambda row: (row[2], -1 if row[3] == "" else row[3], row[0], row[1]))
    with open(output, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        writer.writerows(rows)
    return output, [row for row in rows if row[-1] != ""]
