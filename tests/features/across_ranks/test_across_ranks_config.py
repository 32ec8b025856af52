"""monitor.across_ranks in one process: its section's errors name the key, and with one rank every summary
is that rank's own value (min = mean = max, both extremes at rank 0), checked against the run's JSONL."""
import numpy as np
import pytest

from tests.support.demo_trainer import SMALL_MODEL, make_model
from tests.support.jsonl import read_jsonl
from mindmon import AccumulatingTrainStep, build_group, parse_sections, split_batch
from mindmon.config import ConfigError
from mindmon.demo.data import make_sequences

K, STEPS = 2, 2


@pytest.mark.parametrize("section, message", [
    ({"enabled": "yes"}, "monitor.across_ranks.enabled: "),
    ({"enable": True}, "monitor.across_ranks.enable: unknown key 'enable' (did you mean 'enabled'?)"),
    ([True], "monitor.across_ranks: "),
])
def test_a_bad_section_names_its_key(section, message):
    with pytest.raises(ConfigError) as error:
        parse_sections({"monitor": {"across_ranks": section}})
    assert str(error.value).startswith(message), str(error.value)


def test_nothing_to_summarise_is_refused_before_training(tmp_path):
    config = parse_sections({"monitor": {"output_dir": str(tmp_path), "across_ranks": {"enabled": True}}})
    with pytest.raises(ConfigError, match=r"^monitor.across_ranks.enabled: true, but neither monitor.train_state "
                                          r"nor monitor.moe_monitor collects"):
        build_group(config, make_model(), ["w"])


def test_one_rank_summarises_its_own_values(tmp_path):
    from mindspore import Tensor, nn

    model = make_model()
    model.set_train(True)
    optimizer = nn.SGD(model.trainable_params(), learning_rate=0.05)
    config = parse_sections({"monitor": {"output_dir": str(tmp_path), "moe_monitor": {"save_tokens_per_expert_interval": 1},
                                         "train_state": {"local_loss": True, "device_loss": True, "local_norm": True},
                                         "across_ranks": {"enabled": True}}})
    group = build_group(config, model, [p.name for p in optimizer.parameters])
    train_step = AccumulatingTrainStep(lambda ids, labels: model(ids, labels)[0], optimizer, K, group=group)
    group.setup(max_steps=STEPS)
    sequences = make_sequences(STEPS * 4, SMALL_MODEL["seq_length"], SMALL_MODEL["vocab_size"], seed=1)
    for step in range(1, STEPS + 1):
        batch = sequences[(step - 1) * 4:step * 4]
        train_step(split_batch((Tensor(batch[:, :-1]), Tensor(batch[:, 1:])), K))
        group.flush(step)
    group.close()
    rows = read_jsonl(tmp_path / "rank_0" / "metrics.jsonl")
    own = {(r["step"], r["micro_step"], "local_loss"): r["value"] for r in rows if r["kind"] == "local_loss"}
    own.update({(r["step"], None, "device_loss"): r["value"] for r in rows if r["kind"] == "device_loss"})
    own.update({(r["step"], r["micro_step"], f"micro_norm/{r['name']}"): r["value"]
                for r in rows if r["kind"] == "micro_norm"})
    own.update({(r["step"], None, f"tokens_per_expert_step/{r['name']}/expert_{e}"): v
                for r in rows if r["kind"] == "tokens_per_expert_step" for e, v in enumerate(r["value"])})
    summaries = {(r["step"], r["micro_step"], r["name"]): r["value"] for r in rows if r["kind"] == "across_ranks"}
    accumulated = [key for key in summaries if key[2].startswith("accumulated_norm/") and key[2].endswith("/max")]
    assert len(accumulated) == STEPS * len(optimizer.parameters)
    for (step, micro, column), value in own.items():
        for statistic in ("min", "mean", "max"):
            assert summaries[(step, micro, f"{column}/{statistic}")] == pytest.approx(value, rel=1e-6), column
        for statistic in ("min_rank", "max_rank"):
            assert summaries[(step, micro, f"{column}/{statistic}")] == 0.0
    assert len(summaries) == 5 * (len(own) + len(accumulated))
    assert np.isfinite(list(summaries.values())).all()


def test_a_dropped_monitor_still_sends_its_buffer_as_zeros(caplog):
    """Every rank's collectives must keep their size: a monitor that fails while making its payload is
    switched off and the group sends zeros of its declared sizes in its place, then skips it on receive."""
    from mindspore import Tensor

    from mindmon.core.engine import CrossRankPayload, CrossRankSizes, Monitor
    from mindmon.core.group import MonitorGroup

    class Buffered(Monitor):
        def __init__(self, fail):
            self.fail, self.received = fail, None

        def collect(self, step):
            return []

        def cross_rank_sizes(self, num_micro_steps):
            return CrossRankSizes(data_parallel=2, job=3 * num_micro_steps)

        def cross_rank(self, num_micro_steps):
            if self.fail:
                raise RuntimeError("broken")
            return CrossRankPayload(data_parallel=np.array([-1.0, -2.0]),
                                    job=np.arange(3 * num_micro_steps, dtype=np.float32))

        def receive_cross_rank(self, summed):
            self.received = summed

    broken, working = Buffered(True), Buffered(False)
    group = MonitorGroup([broken, working])
    exchange = group.cross_rank(num_micro_steps=2)
    sent = exchange.before_data_parallel()
    # one flat tensor: the data_parallel parts (broken's zeros, working's), then the job parts likewise
    assert [t.asnumpy().tolist() for t in sent] == [[0.0, 0.0, -1.0, -2.0] + [0.0] * 6 + [0, 1, 2, 3, 4, 5]]
    assert broken not in group.monitors and "Buffered failed and is switched off" in caplog.text
    exchange.after_data_parallel([Tensor(np.arange(16, dtype=np.float32) * 10)])
    exchange.deliver()
    assert broken.received is None
    assert working.received.data_parallel.tolist() == [20.0, 30.0] and working.received.shards is None
    assert working.received.job.tolist() == [100.0, 110.0, 120.0, 130.0, 140.0, 150.0]
    # the next step, with another K: the switched-off monitor still declares its sizes and sends zeros
    sent = group.cross_rank(num_micro_steps=1).before_data_parallel()
    assert [t.asnumpy().tolist() for t in sent] == [[0.0, 0.0, -1.0, -2.0, 0.0, 0.0, 0.0, 0.0, 1.0, 2.0]]
