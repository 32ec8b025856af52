"""An msrun worker for tests/parallel/test_hang.py: the demo model trained data-parallel by mindmon's own loop
(AccumulatingTrainStep and group.flush), one rank of which stops moving, or moves slowly. The group is
the plain loop's (build_group): its peer watchdog, `monitor.speed.hang_after`, the JSONL and the alerts
as every run has them.

    hang_worker.py OUTPUT_DIR STEPS MODE ODD_RANK FROM_STEP HANG_AFTER DATABASE_URL

MODE `block`: rank ODD_RANK blocks for good in its forward of step FROM_STEP (`block_forever`: the process
and its watchdog's thread stay alive). MODE `slow`: from step FROM_STEP on, rank ODD_RANK spends SLOW
seconds before each step (`load_slowly`: the data phase) and SLOW seconds between its train step and its
flush (`write_slowly`: the monitor phase); both pauses are sleeps only, so their length does not depend
on the machine's load. HANG_AFTER: seconds, or `default`. DATABASE_URL: where alerts go, or `none`.

Prints `step <n> <seconds>` after each step, `blocking at <time.time()>` before blocking, `trained` at the end.
"""
import sys
import threading
import time
from pathlib import Path
sys.path.append(str(Path(__file__).resolve().parents[2]))  # run as a script: tests.support

K, LOCAL_BATCH = 2, 2
SLOW = 5.0   # seconds, twice a step: each under the slow test's hang_after, their sum over it


def config(output_dir: str, hang_after, database_url: str) -> dict:
    monitor = {"output_dir": output_dir, "train_state": {"local_loss": True, "device_loss": True}}
    if hang_after is not None:   # absent: the watchdog derives it from the step times
        monitor["speed"] = {"hang_after": hang_after}
    if database_url != "none":   # a rule that never fires here (no NaN): only the hang reaches the table
        monitor["alert"] = {"rules": [{"rule_name": "AnomalyNan"}],
                            "inform": {"recipient": "database", "connection_str": database_url,
                                       "table": "hang_alerts"}}
    return {"monitor": monitor}


def block_forever() -> None:
    print(f"blocking at {time.time()!r}", flush=True)
    threading.Event().wait()


def load_slowly() -> None:
    time.sleep(SLOW)


def write_slowly() -> None:
    time.sleep(SLOW)


def main(output_dir: str, steps: int, mode: str, odd_rank: int, from_step: int, hang_after, database_url: str):
    import logging

    import mindspore as ms
    from mindspore import Tensor, nn
    from mindspore.communication import get_rank, init

    from tests.support.demo_trainer import SMALL_MODEL, make_model
    from mindmon import AccumulatingTrainStep, build_group, parse_sections, split_batch
    from mindmon.demo.data import make_sequences

    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    init("mccl")
    rank = get_rank()
    ms.set_seed(0)
    model = make_model()
    model.set_train(True)
    optimizer = nn.SGD(model.trainable_params(), learning_rate=0.05)
    group = build_group(parse_sections(config(output_dir, hang_after, database_url)), model=model,
                        parameter_names=[p.name for p in optimizer.parameters])
    now = {"step": 0, "forwards": 0}
    odd = rank == odd_rank

    def loss(ids, labels):
        now["forwards"] += 1
        if odd and mode == "block" and now["step"] >= from_step and now["forwards"] == 1:
            block_forever()
        return model(ids, labels)[0]

    train_step = AccumulatingTrainStep(loss, optimizer, K, group=group)
    group.setup(max_steps=steps, micro_steps_per_step=K)
    sequences = make_sequences(steps * K * LOCAL_BATCH, SMALL_MODEL["seq_length"], SMALL_MODEL["vocab_size"],
                               seed=rank)
    for step in range(1, steps + 1):
        started = time.perf_counter()
        now["step"], now["forwards"] = step, 0
        if odd and mode == "slow" and step >= from_step:
            load_slowly()
        batch = sequences[(step - 1) * K * LOCAL_BATCH:step * K * LOCAL_BATCH]
        train_step(split_batch((Tensor(batch[:, :-1]), Tensor(batch[:, 1:])), K))
        if odd and mode == "slow" and step >= from_step:
            write_slowly()
        group.flush(step)
        print(f"step {step} {time.perf_counter() - started:.6f}", flush=True)
    group.close()
    print("trained", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]),
         None if sys.argv[6] == "default" else float(sys.argv[6]), sys.argv[7])
