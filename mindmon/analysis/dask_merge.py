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
from mindmon.analysis.merge import COLUMNS, OUTLIER_RANK, PLACES, window_rows

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


def partition_rows(frame, factor: float, places=()):
    """The merged rows of the keys of one partition (all of each key's records are in it); `places`: the
    coordinates a model-parallel run's keys add (PLACES)."""
    pa, pd, np = require(EXTRA, "pyarrow"), require(EXTRA, "pandas"), require(EXTRA, "numpy")
    columns = COLUMNS + list(places)
    if frame.empty:
        return pd.DataFrame({c: pd.Series(dtype=object) for c in columns})
    key = KEY + list(places)
    frame = frame.sort_values(key + ["rank"], kind="stable")
    ids = frame.groupby(key, sort=False).ngroup().to_numpy()
    offsets = np.concatenate([[0], np.flatnonzero(np.diff(ids)) + 1, [len(ids)]]).astype(np.int32)
    first = frame.iloc[offsets[:-1]]
    values = frame["value"].to_numpy(dtype=np.float64, na_value=np.nan)   # NaN stays NaN
    table = pa.table({"kind": first["kind"].tolist(), "name": first["name"].tolist(), "step": first["step"].tolist(),
                      "micro_step": [None if m < 0 else int(m) for m in first["micro"]],
                      "ranks": pa.ListArray.from_arrays(offsets, frame["rank"].to_numpy(dtype=np.int64)),
                      "vals": pa.ListArray.from_arrays(offsets, values),
                      **{place: [int(v) for v in first[place]] for place in places}})
    rows, _ = window_rows(table, factor)
    return pd.DataFrame(rows, columns=columns, dtype=object)


def merged_rows(paths: List[str], factor: float, client) -> Tuple[List[List], List[str]]:
    """The rows, and the coordinates they key on besides (PLACES for a model-parallel run, else none)."""
    dd, pd = require(EXTRA, "dask.dataframe"), require(EXTRA, "pandas")
    # Arrow-backed columns: a list record's null `value` is apart from a NaN one.
    frame = dd.read_parquet(paths, columns=["kind", "name", "step", "micro_step", "rank", "value"] + PLACES,
                            dtype_backend="pyarrow")
    frame = frame[~frame["value"].isna()]
    frame = frame.assign(micro=frame["micro_step"].fillna(-1).astype("int64[pyarrow]"),
                         **{place: frame[place].fillna(0).astype("int64[pyarrow]") for place in PLACES}
                         ).drop(columns=["micro_step"])
    placed = bool(client.compute(((frame["pp"] > 0) | (frame["ep"] > 0)).any()).result())
    places = PLACES if placed else []
    frame = frame.shuffle(on=KEY + places)
    meta = pd.DataFrame({c: pd.Series(dtype=object) for c in COLUMNS + places})
    rows = client.compute(frame.map_partitions(partition_rows, factor, places, meta=meta)).result()
    return rows.values.tolist(), places


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
            rows, places = merged_rows(paths, factor, client)
    finally:
        if cluster is not None:
            cluster.close()
    rows.sort(key=lambda row: (row[2], -1 if row[3] == "" else row[3], row[0], row[1], *row[len(COLUMNS):]))
    with open(output, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS + places)
        writer.writerows(rows)
    return output, [row for row in rows if row[OUTLIER_RANK] != ""]
