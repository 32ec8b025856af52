"""`mindmon query RUN_DIR "SQL" [-o OUT]`: any SQL over the run's records (the view `records`,
mindmon.analysis.sql), written by DuckDB as it is computed: CSV on standard output, or to OUT as
CSV, Parquet (`.parquet`) or JSON lines (`.json`, `.jsonl`).

Example:
    mindmon query ./output "SELECT rank, max(value) FROM records WHERE kind = 'local_loss' GROUP BY rank"
"""
from typing import Optional

from mindmon.analysis.sql import DEFAULT_MEMORY_LIMIT, Engine

STDOUT = "/dev/stdout"


def copy_options(output: str) -> str:
    if output.endswith(".parquet"):
        return "FORMAT parquet, COMPRESSION zstd"
    if output.endswith((".json", ".jsonl")):
        return "FORMAT json"
    return "FORMAT csv, HEADER true"


def run_query(run_dir: str, query: str, output: Optional[str] = None, memory_limit: str = DEFAULT_MEMORY_LIMIT,
              source: str = "auto", threads: Optional[int] = None) -> str:
    """Writes the query's result to `output` (default: standard output); returns where it went."""
    output = output or STDOUT
    with Engine(run_dir, memory_limit, threads, source) as engine:
        target = output.replace("'", "''")
        engine.execute(f"COPY ({query.strip().rstrip(';')}) TO '{target}' ({copy_options(output)})")
    return output
