"""The parallel layout of one rank: its data-, tensor-, pipeline-, expert- and context-parallel groups, its
index in each, and how each parameter is placed (split over the tensor-, context- or expert-parallel ranks,
or replicated). Every number mindmon reports under model parallelism is derived from it (docs/model-parallel.md).

Example (inside an msrun worker, after `mindspore.communication.init("mccl")`):
    layout = megatron_layout(tp=2, pp=1)            # creates the groups, Megatron's rank order
    layout = layout.with_parameters(net.trainable_params())   # reads `tensor_model_parallel` / `partition_dim`
    layout.check(net.trainable_params())            # one clean ConfigError if it does not add up
    layout.coordinates()                            # {"dp": 1, "tp": 0, "pp": 0, "ep": 0, "cp": 0}
"""
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Sequence, Tuple

from ..config import ConfigError
from mindmon.parallel.data_parallel import DataParallel

AXES = ("dp", "tp", "pp", "ep", "cp")
# The axes a parameter can be split over; `pp` never is (a stage holds its own parameters) and `dp` holds
# copies.
SHARD_AXES = ("tp", "cp", "ep")
# The attribute names Megatron (and msprobe's tp_group dedup) read from a parameter.
MEGATRON_SHARDED = "tensor_model_parallel"
MEGATRON_DIM = "partition_dim"
MEGATRON_EXPERT = "allreduce"   # Megatron marks expert parameters with allreduce=False


@dataclass(frozen=True)
class Placement:
    """How one parameter is stored: `axes` it is split over (empty: every rank of those axes holds all of
    it), and the dimension of the split over `tp` (None when not split over it)."""

    axes: Tuple[str, ...] = ()
    dim: Optional[int] = None


REPLICATED = Placement()


@dataclass
class ParallelLayout:
    """One rank's place in the job. `groups` maps each axis to a communication group (a `DataParallel`:
    name, size, index); an axis that is absent has one rank. `placements` maps parameter names to their
    `Placement` (absent: replicated). `vpp_chunks` is the number of model chunks a rank of a virtual
    pipeline holds; `world_size` the ranks of the job, for the check that the group sizes multiply to it.
    """

    groups: Dict[str, DataParallel] = field(default_factory=dict)
    placements: Dict[str, Placement] = field(default_factory=dict)
    vpp_chunks: int = 1
    world_size: Optional[int] = None
    rank: int = 0   # in the world: the rank_<r>/ folder of this process's files
    # `Parameter.name` of the optimizer's parameters, in its order (with_parameters): the monitors' values
    # come in that order, under the model's names, which may differ.
    parameter_order: Optional[Tuple[str, ...]] = None

    def size(self, axis: str) -> int:
        group = self.groups.get(axis)
        return group.size if group is not None else 1

    def index(self, axis: str) -> int:
        group = self.groups.get(axis)
        return group.rank if group is not None else 0

    def coordinates(self) -> Dict[str, int]:
        """This rank's index on every axis (written next to every JSONL record and in `layout.json`)."""
        return {axis: self.index(axis) for axis in AXES}

    def sizes(self) -> Dict[str, int]:
        return {axis: self.size(axis) for axis in AXES}

    @property
    def data_parallel(self) -> DataParallel:
        return self.groups.get("dp") or DataParallel.single()

    @property
    def model_parallel(self) -> bool:
        """True when some axis other than data parallel has more than one rank."""
        return any(self.size(axis) > 1 for axis in AXES if axis != "dp")

    @property
    def last_stage(self) -> bool:
        return self.index("pp") == self.size("pp") - 1

    @property
    def writes_full_parameters(self) -> bool:
        """The rank that writes a full parameter's norm: the first of its tensor- and context-parallel
        groups (the others hold other shards, or copies, of the same parameter)."""
        return self.index("tp") == 0 and self.index("cp") == 0

    def placement(self, name: str) -> Placement:
        return self.placements.get(name, REPLICATED)

    def norm_weight(self, name: str, axes: Sequence[str]) -> float:
        """1 or 0: does this rank's squared norm of `name` count when the squared norms are summed over
        `axes`? A shard counts on every rank of the axes it is split over; a copy only on the axis' first
        rank, so that the sum holds every element of the parameter exactly once."""
        placement = self.placement(name)
        return float(all(axis in placement.axes or self.index(axis) == 0 for axis in axes))

    def norm_weights(self, axes: Sequence[str], names: Sequence[str]):
        """`norm_weight` of every parameter, in the optimizer's order once `with_parameters` has read it
        (else in the order of `names`)."""
        import numpy as np

        order = self.parameter_order if self.parameter_order is not None else names
        return np.array([self.norm_weight(name, axes) for name in order], np.float64)

    def with_parameters(self, parameters: Sequence) -> "ParallelLayout":
        """Adds the placements read from Megatron's attributes where a parameter carries them (this layout,
        changed in place, so every monitor holding it sees them): a parameter with
        `tensor_model_parallel=True` is split over `tp` along `partition_dim`; one with `allreduce=False`
        (an expert's) is split over `ep`. Placements already declared win. `AccumulatingTrainStep` calls
        it with the optimizer's parameters."""
        read = {}
        for parameter in parameters:
            axes = []
            if getattr(parameter, MEGATRON_SHARDED, False):
                axes.append("tp")
            if getattr(parameter, MEGATRON_EXPERT, True) is False:
                axes.append("ep")
            if axes:
                read[parameter.name] = Placement(tuple(axes), getattr(parameter, MEGATRON_DIM, None)
                                                 if "tp" in axes else None)
        self.placements = {**read, **self.placements}
        self.parameter_order = tuple(p.name for p in parameters)
        return self

    def check(self, parameters: Sequence, path: str = "layout") -> None:
        """Before step 1: the group sizes multiply to the world, every placement names a parameter of this
        rank on an axis of the layout, and a parameter split over `tp` has the same shard shape on every
        rank of the group (one collective per split axis). Raises one ConfigError naming what is wrong."""
        from .checks import check_layout

        check_layout(self, parameters, path)


def check_collecting_ranks(layout, ranks) -> None:
    """Model-parallel sums need every rank in their collectives: `monitor.ranks` cannot leave one out."""
    if ranks is not None and layout.model_parallel:
        raise ConfigError(f"monitor.ranks: got {list(ranks)!r} with a model-parallel layout "
                          f"({layout.sizes()}); allowed: unset (every rank collects: a full parameter's norm "
                          f"needs every shard)")


def parse_placements(declared: Optional[Mapping], path: str) -> Dict[str, Placement]:
    """`{"attn.qkv.weight": 0}` (split over tp along dim 0), `{"w": {"axes": ["tp", "cp"], "dim": 1}}`,
    `{"experts.0.w": {"axes": ["ep"]}}` or a `Placement`; anything else is a ConfigError."""
    placements = {}
    for name, spec in (declared or {}).items():
        key = f"{path}[{name!r}]"
        if isinstance(spec, Placement):
            placements[name] = spec
        elif isinstance(spec, int) and not isinstance(spec, bool):
            placements[name] = Placement(("tp",), spec)
        elif isinstance(spec, Mapping) and set(spec) <= {"axes", "dim"}:
            axes = tuple(spec.get("axes", ("tp",)))
            if not axes or any(axis not in SHARD_AXES for axis in axes):
                raise ConfigError(f"{key}.axes: got {list(axes)!r}; allowed: a non-empty list of {list(SHARD_AXES)}")
            placements[name] = Placement(axes, spec.get("dim"))
        else:
            raise ConfigError(f"{key}: got {spec!r}; allowed: the dimension (int) split over tp, a mapping "
                              f"{{'axes': [...], 'dim': int}} or a mindmon.parallel.Placement")
    return placements


def parallel_layout(dp: Optional[str] = None, tp: Optional[str] = None, pp: Optional[str] = None,
                    ep: Optional[str] = None, cp: Optional[str] = None, sharded: Optional[Mapping] = None,
                    vpp_chunks: int = 1, path: str = "layout") -> ParallelLayout:
    """The layout from the names of groups the training script created (`create_group`); an axis left None
    has one rank, except `dp` when no axis is named at all (then the world is data parallel). `sharded`:
    see `parse_placements`. A group that does not exist is a ConfigError naming the axis."""
    from mindspore.communication import GlobalComm, get_group_size, get_rank

    named = {axis: name for axis, name in zip(AXES, (dp, tp, pp, ep, cp)) if name is not None}
    groups = {axis: _group(f"{path}.{axis}", name) for axis, name in named.items()}
    if not named and GlobalComm.INITED:
        groups["dp"] = DataParallel()
    if isinstance(vpp_chunks, bool) or not isinstance(vpp_chunks, int) or vpp_chunks < 1:
        raise ConfigError(f"{path}.vpp_chunks: got {vpp_chunks!r}; allowed: a positive int (model chunks per rank)")
    world, rank = (int(get_group_size()), int(get_rank())) if GlobalComm.INITED else (1, 0)
    return ParallelLayout(groups, parse_placements(sharded, f"{path}.sharded"), vpp_chunks, world, rank)


def _group(path: str, name: str) -> DataParallel:
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{path}: got {name!r}; allowed: the name of a communication group (str) or None")
    try:
        return DataParallel(name)
    except ConfigError:
        raise ConfigError(f"{path}: got {name!r}, a communication group that does not exist (or does not hold "
                          f"this rank); allowed: the name of a group created with "
                          f"mindspore.communication.create_group, or None for one rank") from None


def megatron_coordinates(rank: int, world: int, tp: int, pp: int, cp: int = 1, ep: int = 1) -> Dict[str, int]:
    """A rank's indices in Megatron's order (tensor parallel fastest, then context, data, pipeline); the
    expert-parallel group is carved out of the data-parallel one (consecutive data-parallel indices)."""
    dp = world // (tp * cp * pp)
    coordinates = {"tp": rank % tp, "cp": rank // tp % cp, "dp": rank // (tp * cp) % dp, "pp": rank // (tp * cp * dp)}
    coordinates["ep"] = coordinates["dp"] % ep
    return coordinates


def megatron_ranks(axis: str, rank: int, world: int, tp: int, pp: int, cp: int = 1, ep: int = 1) -> Tuple[int, ...]:
    """The ranks of `rank`'s group on `axis` (every rank whose other indices equal its own)."""
    mine = megatron_coordinates(rank, world, tp, pp, cp, ep)

    def same_group(other: int) -> bool:
        theirs = megatron_coordinates(other, world, tp, pp, cp, ep)
        if axis == "ep":   # within the data-parallel group, the block of `ep` consecutive indices
            return (all(theirs[a] == mine[a] for a in ("tp", "cp", "pp"))
                    and theirs["dp"] // ep == mine["dp"] // ep)
        return all(theirs[a] == mine[a] for a in ("tp", "cp", "dp", "pp") if a != axis)

    return tuple(r for r in range(world) if same_group(r))


def megatron_layout(tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, sharded: Optional[Mapping] = None,
                    vpp_chunks: int = 1, path: str = "layout") -> ParallelLayout:
    """Creates this rank's groups (`mindmon-<axis>-<ranks>`) in Megatron's rank order over the world and
    returns the layout; the data-parallel size is what the world leaves. Sizes that do not divide the
    world are a ConfigError."""
    from mindspore.communication import create_group, get_group_size, get_rank

    world, rank = int(get_group_size()), int(get_rank())
    sizes = {"tp": tp, "pp": pp, "cp": cp, "ep": ep}
    for axis, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"{path}.{axis}: got {size!r}; allowed: a positive int")
    if world % (tp * pp * cp) or (world // (tp * pp * cp)) % ep:
        raise ConfigError(f"{path}: tp={tp} x pp={pp} x cp={cp} does not divide the world of {world} ranks into "
                          f"data-parallel groups divisible by ep={ep}; allowed: sizes whose product divides "
                          f"the world size")
    names = {}
    for axis in AXES:
        ranks = megatron_ranks(axis, rank, world, tp, pp, cp, ep)
        if len(ranks) > 1:
            names[axis] = "mindmon-" + axis + "-" + "-".join(map(str, ranks))
            create_group(names[axis], list(ranks))
    return parallel_layout(names.get("dp"), names.get("tp"), names.get("pp"), names.get("ep"), names.get("cp"),
                           sharded, vpp_chunks, path)
