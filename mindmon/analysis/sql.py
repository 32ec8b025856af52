"""The analysis engine: a run's records as one DuckDB view, `records`, over its files as they are
(`rank_<r>/metrics.parquet`, a `metrics.arrows` stream still being written, or `metrics.jsonl`),
with the columns of mindmon.formats.columnar.SCHEMA whatever the file. DuckDB runs embedded,
on every core, inside `memory_limit`, and spills what does not fit to a temporary folder.

A rank with a columnar file is read from it; a rank with only the JSONL is read from the JSONL
(`source="jsonl"` or `"columnar"` forces one). The rank is the folder's, `rank_<r>`.

A file the engine cannot read does not stop the others: a `metrics.parquet` cut short (a killed copy:
no footer) is named in one line and the rank read from its `metrics.jsonl` instead when it has one
(with `source="auto"`), else left out; a `metrics.jsonl` with no line that is a record (not JSON lines
at all) is named and left out. The lines go to `progress` and stay in `Engine.notices`.

Example:
    with Engine("./output/monitor") as engine:
        engine.execute("SELECT kind, count(*) FROM records GROUP BY kind").fetchall()
"""
import os
import shutil
import sys
import tempfile
from typing import Dict, List, Optional, Sequence, Tuple

from mindmon.extras import require
from mindmon.formats import columnar
from mindmon.formats.jsonl import metrics_files

EXTRA = "analysis"
DEFAULT_MEMORY_LIMIT = "1GB"
SOURCES = ("auto", "columnar", "jsonl")

# metrics.jsonl as read_json sees it; a key a line lacks is NULL (a half-written last line too).
JSONL_COLUMNS = ("{step: 'BIGINT', micro_step: 'INTEGER', rank: 'INTEGER', kind: 'VARCHAR', name: 'VARCHAR', "
                 "value: 'JSON', nonfinite: 'JSON', iter: 'BIGINT', ops: 'VARCHAR[]', shape: 'BIGINT[]', "
                 "dtype: 'VARCHAR', dp: 'INTEGER', tp: 'INTEGER', pp: 'INTEGER', ep: 'INTEGER', cp: 'INTEGER'}")
# The JSONL's `null` + `nonfinite` back to IEEE NaN/inf, lists apart from scalars (formats/jsonl.py).
JSONL_SELECT = """
SELECT step, micro_step,
       CAST(regexp_extract(filename, '[/\\\\]rank_(\\d+)[/\\\\][^/\\\\]+$', 1) AS INTEGER) AS rank,
       {coordinates}, kind, name,
       CASE WHEN json_type(value) = 'ARRAY' THEN NULL
            WHEN nonfinite IS NOT NULL THEN CAST(nonfinite ->> '$' AS DOUBLE)
            ELSE CAST(value AS DOUBLE) END AS value,
       CASE WHEN json_type(value) = 'ARRAY' THEN
            list_transform(CAST(value AS DOUBLE[]), lambda x, i:
                coalesce(x, CAST(json_extract_string(nonfinite, '$."' || (i - 1) || '"') AS DOUBLE)))
            END AS value_list,
       iter AS iteration, ops, shape, dtype
FROM {read} WHERE {valid}
"""
JSONL_READ = ("read_json({files}, columns = {columns}, format = 'newline_delimited', ignore_errors = true, "
              "filename = true)")
# A line that is not a record (the half-written last line of a run in progress) reads as NULLs.
JSONL_VALID = "step IS NOT NULL AND kind IS NOT NULL AND name IS NOT NULL AND (value IS NOT NULL OR nonfinite IS NOT NULL)"
COLUMNS = ", ".join(columnar.schema().names)


def duckdb():
    return require(EXTRA, "duckdb")


def _literal(paths: Sequence[str]) -> str:
    return "[" + ", ".join("'" + p.replace("'", "''") + "'" for p in paths) + "]"


def jsonl_sql(paths: Sequence[str]) -> str:
    """A SELECT of SCHEMA's columns over JSONL files (the rank from each file's `rank_<r>` folder)."""
    coordinates = ", ".join(columnar.COORDINATES)   # a line of a run without a layout has none: NULL
    read = JSONL_READ.format(files=_literal(paths), columns=JSONL_COLUMNS)
    return f"SELECT {COLUMNS} FROM ({JSONL_SELECT.format(coordinates=coordinates, read=read, valid=JSONL_VALID)})"


def skipped_lines_sql(path: str) -> str:
    """The count of a JSONL file's lines that are not records."""
    return f"SELECT count(*) FROM {JSONL_READ.format(files=_literal([path]), columns=JSONL_COLUMNS)} " \
           f"WHERE NOT ({JSONL_VALID})"


def jsonl_by_rank(run_dir: str) -> Dict[int, str]:
    """Every rank's `metrics.jsonl` at or below `run_dir`, by rank; empty when there is none."""
    try:
        return dict(metrics_files(run_dir))
    except FileNotFoundError:
        return {}


def run_sources(run_dir: str, source: str = "auto") -> List[Tuple[int, str]]:
    """(rank, path) of the files the engine reads, by rank; FileNotFoundError when there are none."""
    if source not in SOURCES:
        raise ValueError(f"--source: got {source!r}; allowed: one of {list(SOURCES)}")
    found: Dict[int, List[str]] = {}
    if source != "jsonl":
        for rank, path in columnar.columnar_files(run_dir):
            found.setdefault(rank, []).append(path)
    if source != "columnar":
        try:
            for rank, path in metrics_files(run_dir):
                found.setdefault(rank, [path])
        except FileNotFoundError:
            if not found:
                raise
    if not found:
        raise FileNotFoundError(f"no rank_<r>/{columnar.PARQUET_FILE} or {columnar.STREAM_FILE} at or below "
                                f"{run_dir!r}; write one with monitor.metrics_formats: [parquet] or "
                                f"`mindmon compact {run_dir}`")
    return [(rank, path) for rank in sorted(found) for path in found[rank]]


class Engine:
    """A DuckDB connection with the run's records as the view `records`, for use in a `with` block
    (the temporary spill folder goes at exit)."""

    def __init__(self, run_dir: str, memory_limit: str = DEFAULT_MEMORY_LIMIT, threads: Optional[int] = None,
                 source: str = "auto", progress=sys.stderr):
        found = run_sources(run_dir, source)
        self.spill = tempfile.mkdtemp(prefix="mindmon-duckdb-")
        self.con = duckdb().connect(config={"memory_limit": memory_limit, "temp_directory": self.spill,
                                            "threads": threads or os.cpu_count() or 1,
                                            "preserve_insertion_order": True})
        self.con.execute("SET enable_progress_bar = false")
        self._streams = 0
        self.notices: List[str] = []
        self._fallbacks: Optional[Dict[int, str]] = None if source == "auto" else {}
        try:
            self.sources = [pair for rank in sorted({r for r, _ in found})
                            for pair in self._readable(run_dir, rank, [p for r, p in found if r == rank], progress)]
            if not self.sources:
                raise FileNotFoundError(f"no readable records file at or below {run_dir!r} (each one is named above)")
            self.con.execute(f"CREATE TEMP VIEW records AS {self.records_sql(self.sources)}")
        except BaseException:
            self.close()
            raise

    def _readable(self, run_dir: str, rank: int, paths: List[str], progress) -> List[Tuple[int, str]]:
        """The rank's files the engine can read: its JSONL in place of a cut Parquet file (the JSONL holds
        every step, so a stream next to the Parquet file goes too); each file left out is said once."""
        for path in paths:
            problem = self.parquet_problem(path) if path.endswith(".parquet") else None
            if problem is None:
                continue
            if self._fallbacks is None:
                self._fallbacks = jsonl_by_rank(run_dir)
            instead = self._fallbacks.get(rank)
            self._say(progress, f"mindmon: rank {rank}: {path} cannot be read (cut short? {problem}); "
                                + (f"read {instead} instead" if instead else "its rows are left out"))
            paths = [instead] if instead else [p for p in paths if p != path]
            break
        kept = []
        for path in paths:
            if path.endswith(".jsonl") and not self.has_records(path):
                what = "is empty" if os.path.getsize(path) == 0 else "has no line that is a record (not JSON lines?)"
                self._say(progress, f"mindmon: rank {rank}: {path} {what}; rank {rank} is left out")
            else:
                kept.append((rank, path))
        return kept

    def _say(self, progress, line: str) -> None:
        self.notices.append(line)
        if progress is not None:
            print(line, file=progress, flush=True)

    def parquet_problem(self, path: str) -> Optional[str]:
        """Why DuckDB cannot open the Parquet file (a copy cut short has no footer), or None."""
        try:
            self.con.execute(f"SELECT 1 FROM read_parquet({_literal([path])}) LIMIT 0")
        except duckdb().Error as error:
            return str(error).splitlines()[0].replace(f" '{path}'", "")
        return None

    def has_records(self, path: str) -> bool:
        """A line of the JSONL file is a record (read until the first one: the whole file only when none is)."""
        read = JSONL_READ.format(files=_literal([path]), columns=JSONL_COLUMNS)
        try:
            return self.first(f"SELECT 1 FROM {read} WHERE {JSONL_VALID} LIMIT 1") is not None
        except duckdb().Error:
            return False

    def records_sql(self, sources: Sequence[Tuple[int, str]]) -> str:
        """A SELECT of SCHEMA's columns over these files, file after file, in each file's order."""
        parts, parquet, jsonl_paths = [], [], []
        for _, path in sources:
            if path.endswith(".parquet"):
                parquet.append(path)
            elif path.endswith(".arrows"):
                parts.append(f"SELECT {COLUMNS} FROM {self._register_stream(path)}")
            else:
                jsonl_paths.append(path)
        if parquet:
            parts.insert(0, f"SELECT {COLUMNS} FROM read_parquet({_literal(parquet)})")
        if jsonl_paths:
            parts.append(jsonl_sql(jsonl_paths))
        return " UNION ALL ".join(parts)

    def _register_stream(self, path: str) -> str:
        """A stream being written is no format DuckDB reads: its complete batches, as an Arrow table."""
        self._streams += 1
        name = f"stream_{self._streams}"
        self.con.register(name, columnar.read_table(path))
        return name

    def ranks(self) -> List[int]:
        return sorted({rank for rank, _ in self.sources})

    def rank_sql(self, rank: int) -> str:
        """The records of one rank, read from its files only."""
        return self.records_sql([(r, path) for r, path in self.sources if r == rank])

    def execute(self, query: str, params: Optional[list] = None):
        """The query run once: fetchone(), fetchall(), fetchnumpy() of its result."""
        return self.con.execute(query, params or [])

    def first(self, query: str, params: Optional[list] = None) -> Optional[tuple]:
        """The query's first row, or None (the result is read to its end: the connection is free again)."""
        rows = self.con.execute(query, params or []).fetchall()
        return rows[0] if rows else None

    def relation(self, query: str, params: Optional[list] = None):
        """The query as a DuckDB relation, for its Arrow table or reader (no extra copy)."""
        return self.con.sql(query, params=params)

    def close(self) -> None:
        self.con.close()
        shutil.rmtree(self.spill, ignore_errors=True)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
