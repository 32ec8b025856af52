"""msprobe's CSV files for tensor statistics (layout in mindmon/formats/msprobe_csv.py).

Example:
    sink = MsprobeCsvSink(ndigits=6, step_count_per_record=5)
    sink.open(RunInfo(rank=0))          # names $MONITOR_OUTPUT_DIR/<MonDD_HH-MM-SS>-rank0-<id>/ (made at 1st write)
    sink.write(records)                 # TensorStatsRecords; other records are not for this sink
    sink.flush()
"""
import dataclasses
import logging
import os
from collections import defaultdict
from itertools import compress, groupby, repeat
from operator import attrgetter, itemgetter
from typing import Dict, List, Optional, Sequence, Tuple

from mindmon.core.engine import RunInfo, Sink
from mindmon.formats import msprobe_csv as fmt
from mindmon.formats.msprobe_tags import CC_PREFIXES, msprobe_csv_name
from mindmon.core.records import TensorStatsRecord

logger = logging.getLogger("mindmon")
_KIND_AND_STEP = attrgetter("kind", "step")


class MsprobeCsvSink(Sink):
    """Writes `<prefix>_<first>-<last>.csv` files, appending each step's rows as they come; every file is
    closed after each write, so what was written survives a crash. `msprobe_names`: the collectives' rows
    named as msprobe's TrainerMon names them (`AllReduce.input`, `all_reduce.output`: a row per tensor per
    call, in call order), where mindmon's own outputs name the call site and call index."""

    def __init__(self, root: Optional[str] = None, ndigits: int = 6, step_count_per_record: int = 1,
                 significant_digits: bool = False, append_output: Tuple[str, ...] = (), msprobe_names: bool = False):
        self.root = root
        self.msprobe_names = msprobe_names
        self.ndigits = ndigits
        self.step_count_per_record = step_count_per_record
        self.significant_digits = significant_digits
        self.append_output = tuple(append_output)
        self.folder: Optional[str] = None
        self._headers: Dict[str, List[str]] = {}   # path -> its header
        self._warned = set()

    @classmethod
    def for_config(cls, config, root: Optional[str] = None, msprobe_names: bool = False) -> "MsprobeCsvSink":
        """The CSV sink a TensorStatsConfig asks for, under `root` (None: msprobe's output root)."""
        return cls(root, config.ndigits, config.step_count_per_record, config.significant_digits,
                   config.append_output, msprobe_names)

    def reconfigure(self, config) -> None:
        """A new configuration (dynamic on/off) formats the rows it writes from now on."""
        self.ndigits, self.significant_digits = config.ndigits, config.significant_digits
        self.step_count_per_record = config.step_count_per_record

    def open(self, run: RunInfo) -> None:
        root = self.root or fmt.output_root()
        if self.append_output:
            self.folder = fmt.find_run_folder(root, run.rank, *self.append_output)
            if self.folder is None:
                logger.warning("mindmon: append_output %s: no run folder of rank %d in that range under %s; "
                               "writing a new one", list(self.append_output), run.rank, root)
        if self.folder is None:
            # Created at the first write: a run that stops before its first step leaves no empty folder.
            self.folder = os.path.join(root, fmt.run_folder_name(run.rank))

    def write(self, records: Sequence) -> None:
        if self.folder is None:
            self.open(RunInfo())
        by_file = defaultdict(list)
        ours = list(compress(records, map(isinstance, records, repeat(TensorStatsRecord))))
        if self.msprobe_names:
            ours = [dataclasses.replace(r, name=msprobe_csv_name(r.name)) if r.kind in CC_PREFIXES else r
                    for r in ours]
        # thousands of records, in runs of one (kind, step): grouped run by run, with no Python per record
        for (kind, step), run in groupby(zip(map(_KIND_AND_STEP, ours), ours), key=itemgetter(0)):
            first, last = fmt.step_range(step - 1, self.step_count_per_record)
            by_file[os.path.join(self.folder, fmt.file_name(kind, first, last))] += map(itemgetter(1), run)
        if by_file:
            os.makedirs(self.folder, exist_ok=True)
        files = [(file_records, self._header(path, file_records)) for path, file_records in by_file.items()]
        texts = fmt.format_texts(files, self.ndigits, self.significant_digits)
        for path, (_, columns), text in zip(by_file, files, texts):
            fmt.write_text(path, columns, text)

    def _header(self, path: str, records: Sequence[TensorStatsRecord]) -> List[str]:
        """The file's header: read back from an existing file, else from the first rows it gets. Rows that
        do not fit it (ops changed while training, per-micro-batch rows in a per-step file) are still
        written aligned, the missing fields empty, and the mismatch is logged once per file."""
        if path not in self._headers:
            if os.path.exists(path):
                self._headers[path] = fmt.read_header(path)
            else:
                micro = any(r.micro_step is not None for r in records)
                self._headers[path] = fmt.header(records[0].ops, micro)
        columns = self._headers[path]
        if path in self._warned:
            return columns
        in_header = {}   # ops -> all of them in the header (thousands of records share one ops tuple)
        for ops in {tuple(r.ops) for r in records}:
            in_header[ops] = set(ops) <= set(columns)
        misfit = [r for r in records if not in_header[tuple(r.ops)]
                  or (r.micro_step is not None and fmt.MICRO_STEP not in columns)]
        if misfit:
            self._warned.add(path)
            logger.warning("mindmon: %s: rows with ops %s do not fit its header %s; fields outside the "
                           "header are left out", path, list(misfit[0].ops), columns)
        return columns

    def close(self) -> None:
        self._headers.clear()
