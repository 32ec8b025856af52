"""One step's cross-rank payloads (mindmon.core.engine.CrossRankPayload) of every monitor of a group, packed into
the collectives the training step makes anyway, and handed back.

    exchange = group.cross_rank(K)              # the sizes every built monitor declares for K
    sent = exchange.before_data_parallel()      # [one flat float32 Tensor]: data_parallel and job parts
    exchange.after_data_parallel(summed)        # ... summed over the data-parallel group
    exchange.shards(), exchange.job()           # flat float64: summed over tp/cp, over every axis
    exchange.set_shards(...), exchange.set_job(...)
    exchange.deliver()                          # each live monitor's receive_cross_rank

A monitor is asked for its payload once a step, right before the first collective that carries a part of it:
the gradients' data-parallel all-reduce for `data_parallel` and `job` parts (when the data-parallel group has
several ranks), the model-parallel sums (after `GradientsReduced`) otherwise, so a payload of `shards` only may
hold the reduced gradient's norms. Parts laid out monitor after monitor, in the order the group was built, so
every rank's layout is the same; a monitor switched off, or a part missing or of the wrong size, is zeros.
"""
import time
from typing import Dict, List, Optional

import numpy as np

from mindmon.core.engine import CrossRankPayload, CrossRankSizes

PARTS = ("data_parallel", "shards", "job")


class CrossRankExchange:
    def __init__(self, group, num_micro_steps: int):
        self.group, self.num_micro_steps = group, num_micro_steps
        self.entries = []
        for monitor in group.built:   # a monitor switched off still declares: it sends zeros
            sizes = group.guard(monitor, monitor.cross_rank_sizes, num_micro_steps)
            if isinstance(sizes, CrossRankSizes) and sizes.total:
                self.entries.append((monitor, sizes))
        self._payloads: Dict[int, Optional[CrossRankPayload]] = {}
        # Each part, every monitor's values one after the other: this rank's, then the sums so far.
        self._values: Dict[str, Optional[np.ndarray]] = dict.fromkeys(PARTS)
        self._sent_data_parallel = None

    @property
    def empty(self) -> bool:
        return not self.entries

    def size(self, part: str) -> int:
        return sum(getattr(sizes, part) for _, sizes in self.entries)

    def _ask(self, parts) -> None:
        """The payload of each monitor with a part in `parts` not asked yet this step (time counted as mindmon's)."""
        started = time.perf_counter()
        for monitor, sizes in self.entries:
            if id(monitor) in self._payloads or not any(getattr(sizes, part) for part in parts):
                continue
            payload = self.group.guard(monitor, monitor.cross_rank, self.num_micro_steps) \
                if monitor in self.group.monitors else None
            self._payloads[id(monitor)] = payload if isinstance(payload, CrossRankPayload) else None
        self.group.count_own_time(time.perf_counter() - started)

    def _pieces(self, part: str) -> List:
        """Each monitor's `part` (zeros where missing or of the wrong size), flat, in the monitors' order."""
        pieces = []
        for monitor, sizes in self.entries:
            size = getattr(sizes, part)
            if not size:
                continue
            payload = self._payloads.get(id(monitor))
            value = getattr(payload, part) if payload is not None else None
            pieces.append(value if value is not None and _size(value) == size else np.zeros(size, np.float32))
        return pieces

    def before_data_parallel(self) -> list:
        """[one flat float32 Tensor of every data_parallel part, then every job part], or [] when none."""
        if not self.size("data_parallel") and not self.size("job"):
            return []
        self._ask(("data_parallel", "job"))
        self._sent_data_parallel = _flat_tensor(self._pieces("data_parallel") + self._pieces("job"))
        return [self._sent_data_parallel]

    def after_data_parallel(self, summed: list) -> None:
        if not summed:
            return
        flat = np.asarray(summed[0].asnumpy(), np.float64)   # where the step waits for the collective (CPU)
        cut = self.size("data_parallel")
        self._values["data_parallel"], self._values["job"] = flat[:cut], flat[cut:]

    def shards(self) -> np.ndarray:
        return self._part("shards")

    def job(self) -> np.ndarray:
        return self._part("job")

    def set_shards(self, summed: np.ndarray) -> None:
        self._values["shards"] = np.asarray(summed, np.float64).reshape(-1)

    def set_job(self, summed: np.ndarray) -> None:
        self._values["job"] = np.asarray(summed, np.float64).reshape(-1)

    def _part(self, part: str) -> np.ndarray:
        """The part's values so far: summed over the groups it has been through, else this rank's own."""
        if self._values[part] is None:
            self._ask((part,))
            pieces = [_host(p) for p in self._pieces(part)]
            self._values[part] = np.concatenate(pieces) if pieces else np.zeros(0)
        return self._values[part]

    def deliver(self) -> None:
        """Every live monitor's parts back. A part that went through no collective (its group has one rank)
        is this rank's own: the sum over a group of one."""
        if self.empty:
            return
        offsets = dict.fromkeys(PARTS, 0)
        values = {part: self._part(part) for part in PARTS}
        for monitor, sizes in self.entries:
            parts = {}
            for part in PARTS:
                size, start = getattr(sizes, part), offsets[part]
                parts[part] = values[part][start:start + size] if size else None
                offsets[part] = start + size
            if monitor in self.group.monitors:
                self.group.guard(monitor, monitor.receive_cross_rank, CrossRankPayload(**parts))


def _size(value) -> int:
    return int(np.prod(value.shape)) if hasattr(value, "shape") else int(np.size(value))


def _host(value) -> np.ndarray:
    value = value.asnumpy() if hasattr(value, "asnumpy") else value
    return np.asarray(value, np.float64).reshape(-1)


def _flat_tensor(pieces: list):
    """One flat float32 Tensor: laid out in numpy when every piece is on the host, else joined on the device."""
    from mindspore import Tensor

    if all(not hasattr(p, "asnumpy") for p in pieces):
        return Tensor(np.concatenate([np.asarray(p, np.float32).reshape(-1) for p in pieces]))
    from mindspore import mint
    import mindspore as ms

    return mint.cat([(p if hasattr(p, "asnumpy") else Tensor(np.asarray(p, np.float32))).reshape(-1).astype(ms.float32)
                     for p in pieces])
