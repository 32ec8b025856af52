"""Does a layout add up? Run once, before step 1; every failure is one ConfigError naming what is wrong.

The shard-shape check needs the other ranks' shapes: each rank's count and checksum of the names of its
split parameters, then their shapes, are gathered over each split axis (small integers, exact in
float32). Every rank of the group sees the same rows, so every rank refuses together and none is left
waiting in a collective.
"""
import zlib
from typing import Sequence

import numpy as np

from ..config import ConfigError

MAX_DIMS = 8


def check_layout(layout, parameters: Sequence, path: str) -> None:
    _check_world(layout, path)
    _check_vpp(layout, path)
    by_name = {p.name: p for p in parameters}
    for name, placement in sorted(layout.placements.items()):
        key = f"{path}.sharded[{name!r}]"
        if name not in by_name:
            examples = ", ".join(list(by_name)[:4])
            raise ConfigError(f"{key}: names no parameter of this rank; allowed: the names of the optimizer's "
                              f"parameters, such as {examples}")
        ndim = len(by_name[name].shape)
        if "tp" in placement.axes and (placement.dim is None or not 0 <= placement.dim < ndim):
            raise ConfigError(f"{key}: partition dim {placement.dim!r} for a parameter of shape "
                              f"{tuple(by_name[name].shape)}; allowed: 0 to {ndim - 1}")
    for axis in ("tp", "cp"):
        if layout.size(axis) > 1:
            _check_equal_shards(layout, axis, by_name, path)


def _check_world(layout, path: str) -> None:
    sizes = layout.sizes()
    product = sizes["dp"] * sizes["tp"] * sizes["pp"] * sizes["cp"]
    if layout.world_size is not None and product != layout.world_size:
        raise ConfigError(f"{path}: dp={sizes['dp']} x tp={sizes['tp']} x pp={sizes['pp']} x cp={sizes['cp']} = "
                          f"{product} ranks, but the job has {layout.world_size}; allowed: group sizes whose "
                          f"product is the world size")
    if sizes["dp"] % sizes["ep"]:
        raise ConfigError(f"{path}.ep: {sizes['ep']} ranks does not divide the data-parallel group of "
                          f"{sizes['dp']}; allowed: an expert-parallel size that divides the data-parallel size")


def _check_vpp(layout, path: str) -> None:
    if layout.vpp_chunks > 1 and layout.size("pp") == 1:
        raise ConfigError(f"{path}.vpp_chunks: got {layout.vpp_chunks} with one pipeline stage; allowed: 1, or a "
                          f"pipeline-parallel group of more than one rank")


def _signature(layout, axis: str, by_name) -> tuple:
    """(names split over `axis`, an (n, MAX_DIMS + 2) float array: per parameter its padded shape, then
    the count and a checksum of the names), so that differing names fail too."""
    names = sorted(n for n, p in layout.placements.items() if axis in p.axes and n in by_name)
    rows = np.zeros((len(names) + 1, MAX_DIMS), np.float64)
    for row, name in zip(rows, names):
        shape = tuple(by_name[name].shape)[:MAX_DIMS]
        row[:len(shape)] = shape
    rows[-1, 0] = len(names)
    rows[-1, 1] = zlib.crc32("\n".join(names).encode()) % (1 << 20)   # exact in float32
    return names, rows


def _check_equal_shards(layout, axis: str, by_name, path: str) -> None:
    names, rows = _signature(layout, axis, by_name)
    group = layout.groups[axis]
    # First the count and checksum (a fixed size on every rank), then the shapes (a size that now agrees).
    if not (group.gather(rows[-1]) == rows[-1].astype(np.float32)).all():
        raise ConfigError(f"{path}.{axis}: the parameters split over {axis} differ between its ranks (this rank "
                          f"has {len(names)}: {', '.join(names[:4])}); allowed: the same parameters, split the "
                          f"same way, on every rank of the {axis} group")
    if not names:
        return
    every = group.gather(rows[:-1]).reshape(group.size, *rows[:-1].shape)
    for position, name in enumerate(names):
        shapes = {tuple(int(d) for d in rank_rows[position] if d) for rank_rows in every}
        if len(shapes) > 1:
            raise ConfigError(f"{path}.sharded[{name!r}]: its shards differ in shape between the ranks of the "
                              f"{axis} group ({', '.join(map(str, sorted(shapes)))}); allowed: shards of one "
                              f"shape on every rank")
