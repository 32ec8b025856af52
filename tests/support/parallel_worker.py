"""An msrun worker for tests/parallel/test_model_parallel.py: trains the hand-sharded models of tests/support/parallel_model.py
under a mindmon layout and leaves, per rank, mindmon's outputs and its final parameter shards.

    parallel_worker.py tp OUT     TP=2 x DP=2 (Megatron's rank order: ranks 0, 1 are the tp group of replica 0)
    parallel_worker.py pp OUT     PP=2 x DP=2 (ranks 0, 1 run stage 0; 2, 3 stage 1)

After `tp`, an expert-parallel router (EP=2 within DP=4) writes to OUT-ep, and one Adam step of the
block (monitor_config's moment norms) to OUT-adam. In both, msprobe's TrainerMon
trains on the same layout into OUT-msprobe (tests/support/parallel_trainer_mon.py: virtual-pipeline chunks under pp).

Then it checks, on the same groups, that layouts which do not add up are refused, and prints each refusal.
"""
import sys

import numpy as np

from pathlib import Path
sys.path.append(str(Path(__file__).resolve().parents[2]))  # run as a script: tests.support
from tests.support import parallel_reference as ref

STEPS, K, ROWS, LR = 2, 2, 2, 0.5   # per step: dp x K micro-batches of ROWS sequences
MAX_NORM = {"tp": 3.0, "pp": 0.82}   # between the steps' global norms: one step is clipped, one is not
SEED = {"tp": 11, "pp": 13, "vpp": 17}


def data(mode: str):
    dp = 2
    if mode == "tp":
        return ref.batches(SEED[mode], STEPS, dp * K * ROWS, ref.H, ref.H)
    return ref.batches(SEED[mode], STEPS, dp * K * ROWS, ref.PIPE_IN, ref.PIPE_OUT)


def build(mode: str):
    from mindmon.parallel import megatron_layout
    from tests.support.parallel_model import PipelineStage, TensorParallelBlock

    if mode == "tp":
        layout = megatron_layout(tp=2)
        net = TensorParallelBlock(ref.tp_parameters(), layout.groups["tp"].group, layout.index("tp"), 2)
    else:
        layout = megatron_layout(pp=2)
        net = PipelineStage(ref.pipe_parameters(), layout.index("pp"), layout.groups["pp"].group)
    return layout, net


def train(mode: str, out: str) -> None:
    from mindspore import Tensor, nn

    from mindmon import AccumulatingTrainStep, build_group, parameter_names, parse_sections, split_batch

    layout, net = build(mode)
    net.set_train(True)
    optimizer = nn.SGD(net.trainable_params(), learning_rate=LR)
    config = parse_sections({
        "monitor": {"output_dir": out, "train_state": {"local_norm": True, "local_loss": True,
                                                       "device_norm": True, "device_loss": True},
                    **({"loss_components": {"enabled": True}} if mode == "pp" else {})},
        "monitor_config": {"monitor_on": True, "weight_state_format": "log"},
        "callbacks": [{"type": "MaxLogitsMonitor", "step_interval": 1}] if mode == "tp" else []})
    group = build_group(config, model=net, parameter_names=parameter_names(net, optimizer), layout=layout)
    train_step = AccumulatingTrainStep(net, optimizer, K, group, max_norm=MAX_NORM[mode], layout=layout)
    group.setup(max_steps=STEPS)
    replica = layout.index("dp")
    for step, (x, target) in enumerate(data(mode), start=1):
        rows = slice(replica * K * ROWS, (replica + 1) * K * ROWS)
        batch = (Tensor(x[rows].astype(np.float32)), Tensor(target[rows].astype(np.float32)))
        loss, grad_norm = train_step(split_batch(batch, K))
        group.flush(step, loss=loss, grad_norm=grad_norm)
    group.close()
    np.savez(f"{out}/params_rank{layout_rank()}.npz", **{p.name: p.asnumpy() for p in net.trainable_params()})


def train_adam(out: str) -> None:
    """One step of Adam on the TP block: monitor_config's Adam moment norms of the full parameters."""
    from mindspore import Tensor, nn

    from mindmon import AccumulatingTrainStep, build_group, parameter_names, parse_sections, split_batch

    layout, net = build("tp")
    net.set_train(True)
    optimizer = nn.Adam(net.trainable_params(), learning_rate=0.01)
    config = parse_sections({"monitor": {"output_dir": out},
                             "monitor_config": {"monitor_on": True, "optimizer_state_format": "log"}})
    group = build_group(config, model=net, parameter_names=parameter_names(net, optimizer), optimizer=optimizer,
                        layout=layout)
    train_step = AccumulatingTrainStep(net, optimizer, K, group, max_norm=0.0, layout=layout)
    group.setup(max_steps=1)
    x, target = data("tp")[0]
    rows = slice(layout.index("dp") * K * ROWS, (layout.index("dp") + 1) * K * ROWS)
    loss, grad_norm = train_step(split_batch((Tensor(x[rows].astype(np.float32)),
                                              Tensor(target[rows].astype(np.float32))), K))
    group.flush(1, loss=loss, grad_norm=grad_norm)
    group.close()


def train_experts(out: str) -> None:
    """EP=2 inside DP=4: tokens per expert of every expert, and the router's global norm counted once."""
    from mindspore import Tensor, nn

    from mindmon import AccumulatingTrainStep, build_group, parameter_names, parse_sections, split_batch
    from mindmon.parallel import megatron_layout
    from tests.support.parallel_model import ExpertParallelRouter, MoENet

    layout = megatron_layout(ep=2)
    net = MoENet(ExpertParallelRouter(ref.router_weight(), layout.groups["ep"].group, layout.index("ep")))
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.0)   # the routing stays that of the reference
    config = parse_sections({"monitor": {"output_dir": out, "moe_monitor": {"save_tokens_per_expert_interval": 1}}})
    group = build_group(config, model=net, parameter_names=parameter_names(net, optimizer), layout=layout)
    train_step = AccumulatingTrainStep(net, optimizer, K, group, max_norm=0.0, layout=layout)
    group.setup(max_steps=STEPS)
    for step in range(1, STEPS + 1):
        tokens = Tensor(ref.router_tokens(layout_rank(), step, K * ROWS).astype(np.float32))
        loss, grad_norm = train_step(split_batch((tokens,), K))
        group.flush(step, loss=loss, grad_norm=grad_norm)
    group.close()


def trainer_mon(mode: str, out: str) -> None:
    """msprobe's TrainerMon on the same layout: virtual-pipeline chunks under pp, tp_group dedup under tp."""
    from tests.support import parallel_trainer_mon

    if mode == "tp":
        parallel_trainer_mon.run("tp", out, data("tp"), K, ROWS, LR)
    else:
        parallel_trainer_mon.run("vpp", out, vpp_data(), K, ROWS, LR)


def vpp_data():
    return ref.batches(SEED["vpp"], STEPS, 2 * K * ROWS, ref.vpp_width(0), ref.vpp_width(ref.VPP_LAYERS))


def layout_rank() -> int:
    from mindspore.communication import get_rank

    return int(get_rank())


def refusals(mode: str) -> None:
    """Layouts that do not add up, each refused on every rank with one line."""
    from mindspore import Parameter, Tensor

    from mindmon.config import ConfigError
    from mindmon.parallel import megatron_layout, parallel_layout

    layout = megatron_layout(tp=2) if mode == "tp" else megatron_layout(pp=2)
    axis = "tp" if mode == "tp" else "pp"
    forgot_dp = parallel_layout(**{axis: layout.groups[axis].group})
    rows = 2 + layout.index(axis)   # a shard shape that differs between the ranks of the group
    odd = [Parameter(Tensor(np.zeros((rows, 3), np.float32)), name="odd.weight")]
    cases = [("world", forgot_dp, []),
             ("unknown", parallel_layout(dp=layout.groups["dp"].group, **{axis: layout.groups[axis].group},
                                         sharded={"no.such.weight": 0}), odd)]
    if mode == "tp":
        cases.append(("shape", parallel_layout(dp=layout.groups["dp"].group, tp=layout.groups["tp"].group,
                                               sharded={"odd.weight": 0}), odd))
    for label, candidate, parameters in cases:
        try:
            candidate.check(parameters)
        except ConfigError as error:
            print(f"refused {label}: {error}", flush=True)
        else:
            print(f"accepted {label}", flush=True)
    try:
        parallel_layout(tp="no-such-group")
    except ConfigError as error:
        print(f"refused group: {error}", flush=True)


def main() -> int:
    import mindspore as ms
    from mindspore.communication import init

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU", pynative_synchronize=True)
    init("mccl")
    mode, out = sys.argv[1], sys.argv[2]
    train(mode, out)
    trainer_mon(mode, out + "-msprobe")
    refusals(mode)
    if mode == "tp":
        train_experts(out + "-ep")
        train_adam(out + "-adam")
    print(f"parallel_worker rank {layout_rank()}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
