"""An msrun worker for tests/features/moe_tokens/test_moe_tokens_drops_ranks.py: two capacity-limited top-1 routers (a dispatch mask
after the capacity, as Switch Transformers' router gives it) probed with `selection="mask"`, trained data
parallel on this rank's rows of each step's global batch, monitored with moe_monitor into JSONL.

    moe_drops_worker.py OUTPUT_DIR

The routers' weights are fixed (only the experts train), so every step's choice is a function of the
batch alone: the test recomputes it in numpy from `router_weights()` and `global_batches()`.
"""
import sys

import numpy as np

RANKS, K, LOCAL_BATCH, SEQ, HIDDEN, EXPERTS, CAPACITY, LAYERS, STEPS = 2, 2, 2, 8, 6, 4, 3, 2, 3


def router_weights():
    """[(weight (experts, hidden), bias (experts,))] per layer, float32."""
    rng = np.random.default_rng(11)
    return [(rng.normal(size=(EXPERTS, HIDDEN)).astype(np.float32), rng.normal(size=EXPERTS).astype(np.float32))
            for _ in range(LAYERS)]


def global_batches():
    """(steps, ranks x K x local batch, seq, hidden): rank r takes rows [r K b, (r + 1) K b) of each step."""
    return np.random.default_rng(5).normal(size=(STEPS, RANKS * K * LOCAL_BATCH, SEQ, HIDDEN)).astype(np.float32)


def build_model():
    import mindspore as ms
    from mindspore import Parameter, Tensor, nn, ops

    class CapacityRouter(nn.Cell):
        """Each token's argmax expert, kept while that expert holds fewer than CAPACITY tokens of the call."""

        def __init__(self, weight, bias):
            super().__init__()
            self.weight = Parameter(Tensor(weight), requires_grad=False)
            self.bias = Parameter(Tensor(bias), requires_grad=False)

        def construct(self, x):
            logits = ops.matmul(ops.reshape(x, (-1, HIDDEN)), self.weight.T) + self.bias
            chosen = ops.one_hot(ops.argmax(logits, -1), EXPERTS, Tensor(1.0, ms.float32), Tensor(0.0, ms.float32))
            position = ops.cumsum(chosen, 0) * chosen
            return chosen * ops.cast(position <= CAPACITY, ms.float32), logits

    class Layer(nn.Cell):
        def __init__(self, weight, bias):
            super().__init__()
            self.router = CapacityRouter(weight, bias)
            self.expert = nn.Dense(HIDDEN, HIDDEN)

        def construct(self, x):
            keep, _ = self.router(x)
            kept = ops.reshape(ops.reduce_sum(keep, -1), x.shape[:-1] + (1,))
            return self.expert(x) * kept

    class Model(nn.Cell):
        def __init__(self):
            super().__init__()
            self.layers = nn.CellList([Layer(w, b) for w, b in router_weights()])

        def construct(self, x):
            return sum(ops.mean(layer(x) ** 2) for layer in self.layers)

    return Model()


def main(output_dir: str) -> int:
    import mindspore as ms
    from mindspore import Tensor, nn
    from mindspore.communication import get_rank, init

    from mindmon import AccumulatingTrainStep, build_group, parse_sections, split_batch
    from mindmon.probes import attach_tokens_per_expert_probes

    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    init("mccl")
    rank = get_rank()
    ms.set_seed(0)   # the same expert weights on every rank
    model = build_model()
    attach_tokens_per_expert_probes(model, r"router$", num_experts=EXPERTS, topk=1, output_index=0,
                                    selection="mask")
    optimizer = nn.SGD(model.trainable_params(), learning_rate=0.05)
    group = build_group(parse_sections({"monitor": {"output_dir": output_dir,
                                                    "moe_monitor": {"save_tokens_per_expert_interval": 1}}}),
                        model=model, parameter_names=[p.name for p in optimizer.parameters])
    train_step = AccumulatingTrainStep(model, optimizer, K, group=group)
    group.setup(max_steps=STEPS, micro_steps_per_step=K)
    rows = K * LOCAL_BATCH
    for step, batch in enumerate(global_batches(), start=1):
        train_step(split_batch((Tensor(batch[rank * rows:(rank + 1) * rows]),), K))
        group.flush(step)
    group.close()
    print(f"moe_drops_worker rank {rank}: ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
