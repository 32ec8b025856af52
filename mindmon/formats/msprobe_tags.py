"""msprobe's tag spelling, both directions: the TensorBoard tags and the anomaly dump's `tag_name` of the
msprobe and kj600 front doors (mindmon's YAML route keeps `<kind>/<name>/<statistic>`).

msprobe names every collected tensor by a tag name and writes each statistic as a scalar
`<tag name>_<statistic>`, against the 0-based step:

    <vpp_stage>:<module or parameter>[:<micro_step>]/rank<r>/<point>       e.g. 0:fc1.weight/rank0/post_grad
    0:fc1.weight/rank0/post_grad_norm                                        its `norm` in TensorBoard

`vpp_stage` is 0 for a single model, the chunk for a virtual pipeline's (mindmon.parallel.chunks: its names
already begin with it, `1:fc1.weight`); the micro-step is part of the name for per-micro-step values
(activations, `grad_unreduced` with `monitor_mbs_grad`). mindmon's points map to msprobe's as follows:

    param_origin -> param_origin      grad_unreduced -> acc_grad     exp_avg    -> exp_avg      actv      -> actv
    param_updated -> param_updated    grad_reduced   -> post_grad    exp_avg_sq -> exp_avg_sq   actv_grad -> actv_grad
    mg_direction -> mg_direction      adam_update(_histogram) -> adam_update    adam_ratio(_histogram) -> adam_ratio

The L2 features are tensors of their own in msprobe, named after the cell with the feature's suffix, at
the point of the tensor they are computed from (mindmon's rows are already `<cell>.attention` / `<cell>.linear`):

    attention_hook -> qkt   0:core.attention:1/rank0/qkt_entropy, .../qkt_softmax_max (per micro-step)
    linear_hook    -> sr    0:wq.linear/rank0/sr_sr, 0:wq.linear/rank0/sr_kernel_norm  (once per step)

The collectives are named by the function (no chunk: a call belongs to no cell), the tensors of a call by
their role, the function's call index within the step and the tensor's index within the call:

    cc_pre  AllReduce.train.py[28].3.input      -> AllReduce/rank0/pre_3_0     (its norm: ..._norm)
    cc_post comm_func.all_reduce.t.py[9].0.output_1 -> all_reduce/rank0/post_0_1

msprobe's own CSV (TrainerMon's `cc_pre_*.csv`, `cc_post_*.csv`) names a collective's tensors by the
function and role alone, `AllReduce.input` / `all_reduce.output` (`msprobe_csv_name`); a row per tensor per
call, in call order. monitor_v2's `cc` file names them by the tag name, `all_reduce/rank0/post_0_0`.

A histogram's heat map image takes the bare tag name (`0:fc1.weight/rank0/adam_update`), as msprobe's
heat maps do. Kinds msprobe has no name for (losses, mindmon's own monitors) have no tag name here.

Example:
    tag_name("grad_reduced", "fc1.weight", None, 0)      # '0:fc1.weight/rank0/post_grad'
    scalar_tag(tag_name("actv", "fc1.output", 1, 0), "norm")   # '0:fc1.output:1/rank0/actv_norm'
    tag_name("cc_post", "AllReduce.train.py[28].3.output", None, 1)   # 'AllReduce/rank1/post_3_0'
    read_tag("0:fc1.output:1/rank0/actv_norm")           # MsprobeTag(0, 'fc1.output', 1, 0, 'actv', 'norm')
    read_tag("AllReduce/rank1/post_3_0_norm")            # MsprobeTag(None, 'AllReduce', None, 1, 'post', 'norm', 3, 0)
    format_tag(read_tag(tag)) == tag                     # for every tag tag_name and scalar_tag make
"""
import re
from typing import NamedTuple, Optional

VPP_STAGE = 0
POINTS = {   # mindmon kind -> msprobe point
    "param_origin": "param_origin", "param_updated": "param_updated", "grad_unreduced": "acc_grad",
    "grad_reduced": "post_grad", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "actv": "actv",
    "actv_grad": "actv_grad", "mg_direction": "mg_direction", "adam_update": "adam_update",
    "adam_ratio": "adam_ratio", "adam_update_histogram": "adam_update", "adam_ratio_histogram": "adam_ratio",
    "attention_hook": "qkt", "linear_hook": "sr",
}
CC_PREFIXES = {"cc_pre": "pre", "cc_post": "post"}   # mindmon's collective kinds -> msprobe's tensor prefix
KINDS = {point: kind for kind, point in POINTS.items() if not kind.endswith("_histogram")}   # the way back
_CHUNKED = re.compile(r"^\d+:")
_TAG = re.compile(r"^(?P<vpp>\d+):(?P<name>.*?)(?::(?P<micro>\d+))?/rank(?P<rank>\d+)/(?P<rest>[^/]+)$")


_CC_TAG = re.compile(r"^(?P<function>\w+)/rank(?P<rank>\d+)/(?P<prefix>pre|post)_(?P<call>\d+)_(?P<index>\d+)"
                     r"(?:_(?P<statistic>\w+))?$")
CC_KINDS = {prefix: kind for kind, prefix in CC_PREFIXES.items()}


class MsprobeTag(NamedTuple):
    vpp_stage: Optional[int]   # None for a collective (a call belongs to no chunk)
    name: str                  # the tensor's name; a collective's function
    micro_step: Optional[int]
    rank: int
    point: str                 # msprobe's point; `pre` / `post` for a collective
    statistic: Optional[str]   # None for a bare tag name
    call: Optional[int] = None     # a collective's call index
    tensor: Optional[int] = None   # a collective's tensor index within the call

    @property
    def kind(self) -> str:
        """mindmon's kind of the point."""
        return CC_KINDS[self.point] if self.call is not None else KINDS[self.point]


class CollectiveRow(NamedTuple):
    """The parts of mindmon's name of a collective's tensor (mindmon/features/collectives/hooks.py)."""
    function: str   # the primitive's class or the comm_func function, without `comm_func.`
    call: int
    role: str       # input / output
    tensor: int


_CC_ROW_PARTS = re.compile(r"^(?:comm_func\.)?(?P<function>\w+)\..*\.(?P<call>\d+)\.(?P<role>input|output)"
                           r"(?:_(?P<index>\d+))?$")


def collective_row(name: str) -> Optional[CollectiveRow]:
    """A collective row's parts; None when `name` is not one."""
    match = _CC_ROW_PARTS.match(name)
    if match is None:
        return None
    return CollectiveRow(match.group("function"), int(match.group("call")), match.group("role"),
                         int(match.group("index") or 0))


def msprobe_csv_name(name: str) -> str:
    """msprobe's CSV name of a collective row: `<function>.<input|output>` (the name itself if not one)."""
    row = collective_row(name)
    return name if row is None else f"{row.function}.{row.role}"


def tag_name(kind: str, name: str, micro_step: Optional[int], rank: int) -> Optional[str]:
    """msprobe's tag name of a tensor at a point; None when the kind has no msprobe point."""
    if kind in CC_PREFIXES:
        return _collective_tag_name(kind, name, rank)
    point = POINTS.get(kind)
    if point is None:
        return None
    micro = "" if micro_step is None else f":{micro_step}"
    chunk = "" if _CHUNKED.match(name) else f"{VPP_STAGE}:"   # a virtual pipeline's names carry their chunk
    return f"{chunk}{name}{micro}/rank{rank}/{point}"


def _collective_tag_name(kind: str, name: str, rank: int) -> Optional[str]:
    row = collective_row(name)
    if row is None:
        return None
    return f"{row.function}/rank{rank}/{CC_PREFIXES[kind]}_{row.call}_{row.tensor}"


def scalar_tag(name_of_tag: str, statistic: str) -> str:
    return f"{name_of_tag}_{statistic}"


def read_tag(tag: str) -> Optional[MsprobeTag]:
    """A tag (bare or with its statistic) back into its parts; None when it is not msprobe's spelling (a
    tag of mindmon's own, `<kind>/<name>`)."""
    match = _TAG.match(tag)
    if match is None:
        return _read_collective_tag(tag)
    rest, statistic = match.group("rest"), None
    if rest not in KINDS:
        point = next((p for p in sorted(KINDS, key=len, reverse=True) if rest.startswith(p + "_")), None)
        if point is None:
            return None
        rest, statistic = point, rest[len(point) + 1:]
    micro = match.group("micro")
    return MsprobeTag(int(match.group("vpp")), match.group("name"), None if micro is None else int(micro),
                      int(match.group("rank")), rest, statistic)


def _read_collective_tag(tag: str) -> Optional[MsprobeTag]:
    match = _CC_TAG.match(tag)
    if match is None:
        return None
    return MsprobeTag(None, match.group("function"), None, int(match.group("rank")), match.group("prefix"),
                      match.group("statistic"), int(match.group("call")), int(match.group("index")))


def format_tag(tag: MsprobeTag) -> str:
    """The tag `read_tag` read: its parts back into msprobe's spelling."""
    if tag.call is not None:
        text = f"{tag.name}/rank{tag.rank}/{tag.point}_{tag.call}_{tag.tensor}"
    else:
        micro = "" if tag.micro_step is None else f":{tag.micro_step}"
        text = f"{tag.vpp_stage}:{tag.name}{micro}/rank{tag.rank}/{tag.point}"
    return text if tag.statistic is None else scalar_tag(text, tag.statistic)
