"""A plain loop with alerts told of every run event, for tests/features/alerts/test_alerts_lifecycle_runs.py:

    lifecycle_worker.py OUTPUT_DIR DATABASE_URL TABLE MODE

MODE `finish`: 4 steps and close; `raise`: raises at step 3 and nobody catches it.
"""
import sys
from pathlib import Path
sys.path.append(str(Path(__file__).resolve().parents[2]))  # run as a script: tests.support

K = 2
EVENTS = ["started", "finished", "crashed", "rank_lost", "hang", "slow_rank", "throughput_drop"]


def main(output_dir: str, url: str, table: str, mode: str) -> int:
    import numpy as np
    from mindspore import Tensor, nn

    from mindmon import AccumulatingTrainStep, build_group, parse_sections, split_batch
    from tests.support.scripts.plain_loop_job import Regression

    net = Regression()
    optimizer = nn.SGD(net.trainable_params(), learning_rate=0.01)
    inform = {"connection_str": url, "table": table, "events": EVENTS, "timeout": 2, "close_timeout": 20,
              "retry_interval": 0.2, "retry_max_interval": 0.5}
    config = {"monitor": {"output_dir": output_dir, "train_state": {"local_loss": True},
                          "alert": {"rules": [{"rule_name": "AnomalyNan", "args": {"threshold": 1e30}}],
                                    "dump": False, "inform": inform}}}
    group = build_group(parse_sections(config), parameter_names=[p.name for p in optimizer.parameters])
    train_step = AccumulatingTrainStep(net, optimizer, K, group=group)
    group.setup(max_steps=4)
    x = np.random.default_rng(0).normal(size=(4, 3)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5]])).astype(np.float32)
    rank = group.rank
    for step in range(1, 5):
        if step == 3 and mode == "raise":
            raise RuntimeError("the data loader failed\nshard 7 is unreadable")
        train_step(split_batch((Tensor(x), Tensor(y)), K))
        group.flush(step)
    group.close()
    print(f"lifecycle_worker rank {rank}: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
