"""The merge on a real Dask cluster (a LocalCluster of two worker processes, started here) writes the
table the DuckDB merge writes, byte for byte, from the same Parquet files."""
import filecmp


def test_the_dask_merge_equals_the_duckdb_merge(tmp_path):
    # Imported here: the MindSpore 2.7 environment (make test-ms27) collects this file without Dask.
    import distributed

    from mindmon.analysis.compact import compact_run
    from mindmon.analysis.dask_merge import merge_on_dask
    from mindmon.analysis.merge import merge
    from tests.analysis.test_analysis_engine import write_run

    run = write_run(tmp_path / "run")
    compact_run(str(run), progress=None)
    want, want_flagged = merge(str(run), str(tmp_path / "duckdb.csv"), source="columnar", progress=None)
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        got, flagged = merge_on_dask(str(run), str(tmp_path / "dask.csv"), scheduler=cluster.scheduler_address)
        assert len(cluster.scheduler.workers) == 2
    assert filecmp.cmp(want, got, shallow=False)
    assert repr(flagged) == repr(want_flagged) and len(flagged) >= 5
