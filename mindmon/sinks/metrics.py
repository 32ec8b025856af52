"""The sinks of `monitor.metrics_formats`: the per-rank files every record goes to."""
from typing import Dict, List, Optional

from mindmon.core.engine import Sink


def metrics_sinks(formats, output_dir: str, coordinates: Optional[Dict[str, int]] = None, layout=None) -> List[Sink]:
    """`jsonl`: rank_<r>/metrics.jsonl; `parquet`: rank_<r>/metrics.parquet (with the rank's parallel
    coordinates as columns; in the JSONL lines too under model parallelism)."""
    sinks: List[Sink] = []
    if "jsonl" in formats:
        from mindmon.sinks.jsonl import JsonlSink

        sinks.append(JsonlSink(output_dir, layout=layout))
    if "parquet" in formats:
        from mindmon.sinks.columnar import ColumnarSink

        sinks.append(ColumnarSink(output_dir, coordinates))
    return sinks


def parallel_coordinates(data_parallel, layout=None) -> Dict[str, int]:
    """What this rank knows of its place in the job: every coordinate under a parallel layout, else its
    data-parallel rank when there are several."""
    if layout is not None:
        return layout.coordinates()
    return {"dp": data_parallel.rank} if data_parallel is not None and data_parallel.active else {}
