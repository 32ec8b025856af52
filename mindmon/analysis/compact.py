"""`mindmon compact RUN_DIR`: every rank's records in `rank_<r>/metrics.parquet` (mindmon.formats.columnar),
from the Arrow stream a killed or running-then-stopped run left, or from the rank's `metrics.jsonl`.

A rank that already has its Parquet file and no stream is left as it is. The JSONL is read by DuckDB
(mindmon.analysis.sql) in file order and written in row groups, so memory does not grow with the file.

Example:
    compact_run("./output/monitor")    # ['./output/monitor/rank_0/metrics.parquet', ...]
"""
import os
import sys
from typing import List

from mindmon.formats import columnar
from mindmon.formats.jsonl import metrics_files
from mindmon.analysis import sql


def compact_rank(folder: str, jsonl_path: str, engine_config: dict) -> str:
    """The Parquet file of one rank folder (see the module docstring)."""
    made = columnar.compact(folder)
    if made is not None:
        return made
    target = os.path.join(folder, columnar.PARQUET_FILE)
    if os.path.exists(target) or jsonl_path is None:
        return target
    con = sql.duckdb().connect(config=engine_config)
    try:
        reader = con.sql(sql.jsonl_sql([jsonl_path])).to_arrow_reader(columnar.ROW_GROUP_ROWS)
        return columnar.write_parquet(target, reader)
    finally:
        con.close()


def compact_run(run_dir: str, memory_limit: str = sql.DEFAULT_MEMORY_LIMIT, progress=sys.stderr) -> List[str]:
    """Every rank of the run compacted; returns the Parquet paths, by rank."""
    folders = {rank: os.path.dirname(path) for rank, path in columnar.columnar_files(run_dir)}
    jsonl = {}
    try:
        jsonl = dict(metrics_files(run_dir))
    except FileNotFoundError:
        if not folders:
            raise
    folders.update({rank: os.path.dirname(path) for rank, path in jsonl.items() if rank not in folders})
    config = {"memory_limit": memory_limit, "preserve_insertion_order": True}
    written = []
    for done, rank in enumerate(sorted(folders), start=1):
        written.append(compact_rank(folders[rank], jsonl.get(rank), config))
        if progress is not None:
            print(f"mindmon compact: rank {rank} ({done}/{len(folders)}): {written[-1]}", file=progress, flush=True)
    return written
