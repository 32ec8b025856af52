"""Synthetic token data with a learnable pattern: x_t = (start + t * stride) mod vocab.

The stride is one of a few values and must be read off the first tokens, so a model that learns
to attend gets the loss well below log(vocab).
"""
import numpy as np

STRIDES = (1, 2, 3, 5)


def make_sequences(num_samples: int, seq_length: int, vocab_size: int, seed: int = 0) -> np.ndarray:
    """int32 array (num_samples, seq_length + 1): inputs are [:, :-1], labels [:, 1:]."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, vocab_size, size=(num_samples, 1))
    stride = rng.choice(STRIDES, size=(num_samples, 1))
    return ((start + stride * np.arange(seq_length + 1)) % vocab_size).astype(np.int32)


def make_dataset(num_samples: int, seq_length: int, vocab_size: int, batch_size: int, seed: int = 0,
                 num_shards: int = 1, shard_id: int = 0):
    """A MindSpore dataset of dicts {"input_ids", "labels"}, batched as the Trainer expects
    (global_batch_size / data_parallel samples per step), sharded for data parallel ranks."""
    import mindspore.dataset as ds

    sequences = make_sequences(num_samples, seq_length, vocab_size, seed)
    columns = (sequences[:, :-1], sequences[:, 1:])
    dataset = ds.NumpySlicesDataset(columns, column_names=["input_ids", "labels"], shuffle=False,
                                    num_shards=num_shards if num_shards > 1 else None,
                                    shard_id=shard_id if num_shards > 1 else None)
    return dataset.batch(batch_size, drop_remainder=True)
