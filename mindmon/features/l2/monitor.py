"""L2 interpretable features: attention entropy and softmax max from an attention cell's Q and K, stable
rank and kernel norm of a linear cell's weight (definitions in docs/l2-and-collectives.md).

Attention, per forward call, with P = softmax(Q K^T / sqrt(d)) row by row (one row per batch, head and query):
    entropy            mean over the query rows of batch 0, head 0 of  -sum_j P_ij log P_ij   (natural log)
    softmax_max        mean over the query rows of batch 0, head 0 of  max_j P_ij
    entropy_mean       the same over every batch, head and query row
    softmax_max_mean
`entropy` and `softmax_max` are msprobe's (it takes batch 0, head 0 only); the `_mean` pair is mindmon's
average over the whole batch and every head. All in float32, over chunks of query rows, so that no more than `chunk_elements` scores exist at once
(never S x S per head for a long sequence). `causal` hides key j from query i when j > i + (S_k - S_q).

Linear weight W (2-D, float32):
    kernel_norm   ||W||_F
    sr            ||W||_F / ||W||_2, the spectral norm ||W||_2 on CPU to a residual bound (Lanczos on W^T W,
                  warm-started from the previous step's vector of the same weight; small W exactly), on a
                  device by a fixed number of power iterations.

On CPU (`on_host`) everything is numpy on the tensor's memory; elsewhere MindSpore ops, the results kept on
the device and read once at `collect`.

Example:
    monitor = L2FeaturesMonitor(sa_order="s,b,h,d", causal=True, on_host=True)
    monitor.record(ATTENTION_HOOK, ("layers.0.attention", q, k), {"micro_step": 0})
    monitor.record(LINEAR_HOOK, ("layers.0.linear", weight))
    records = monitor.collect(step=1)   # TensorStatsRecords: attention_hook (ATTENTION_OPS), linear_hook (sr, kernel_norm)
"""
import math
from typing import Dict, List, Optional, Tuple

import numpy as np

from mindmon.core.engine import Monitor
from mindmon.core.records import Record, TensorStatsRecord
from mindmon.kernels.stats import host_array

ATTENTION_HOOK = "attention_hook"   # CSV prefix and record kind, as msprobe names the feature group
LINEAR_HOOK = "linear_hook"
ATTENTION_OPS = ("entropy", "softmax_max", "entropy_mean", "softmax_max_mean")
LINEAR_OPS = ("sr", "kernel_norm")
SA_ORDERS = ("s,b,h,d", "b,s,h,d")
CHUNK_ELEMENTS = 1 << 22        # scores held at once: 16 MiB of float32
MASKED = -1.0e30                # a finite "minus infinity": exp() gives 0 and 0 * MASKED stays 0 (no NaN)
SPECTRAL_TOLERANCE = 1e-6       # residual bound of the Lanczos Ritz pair, relative: sigma to 5e-7 relative
EXACT_SIDE = 64                 # up to this smaller side a full singular-value decomposition is the faster way
DEVICE_ITERATIONS = (100, 4)    # fixed (cold, warm) counts on a device, where a tolerance would need a host read;
                                # the warm iterations of successive steps add up while the weight moves slowly


# --- attention ---------------------------------------------------------------------------------------------

def to_bhsd(array, sa_order: str):
    """(batch, heads, seq, head_dim) view of Q or K given in `sa_order`."""
    return array.transpose(1, 2, 0, 3) if sa_order == "s,b,h,d" else array.transpose(0, 2, 1, 3)


def _check_shapes(q_shape, k_shape) -> int:
    """Heads of K repeated for Q (grouped-query attention): the repeat count."""
    if len(q_shape) != 4 or len(k_shape) != 4 or q_shape[0] != k_shape[0] or q_shape[3] != k_shape[3]:
        raise ValueError(f"Q {tuple(q_shape)} and K {tuple(k_shape)}: expected 4-D tensors with equal batch and "
                         f"head_dim in the sa_order layout")
    if q_shape[1] % k_shape[1]:
        raise ValueError(f"Q has {q_shape[1]} heads, K {k_shape[1]}: Q's heads must be a multiple of K's")
    return q_shape[1] // k_shape[1]


def _rows_per_chunk(batch: int, heads: int, keys: int, chunk_elements: int) -> int:
    return max(1, chunk_elements // max(1, batch * heads * keys))


def causal_mask(first_row: int, rows: int, queries: int, keys: int) -> np.ndarray:
    """[rows, keys] True where query `first_row + r` may see key j: j <= i + (keys - queries)."""
    i = np.arange(first_row, first_row + rows)[:, None]
    return np.arange(keys)[None, :] <= i + (keys - queries)


def attention_features_numpy(q: np.ndarray, k: np.ndarray, sa_order: str = "s,b,h,d", causal: bool = False,
                             chunk_elements: int = CHUNK_ELEMENTS) -> Tuple[float, float, float, float]:
    """ATTENTION_OPS of softmax(Q K^T / sqrt(d)) in float32, chunk by chunk over the queries: (entropy,
    softmax_max) of batch 0, head 0, then both averaged over every batch and head."""
    q = to_bhsd(np.asarray(q, dtype=np.float32), sa_order)
    k = to_bhsd(np.asarray(k, dtype=np.float32), sa_order)
    repeat = _check_shapes(q.shape, k.shape)
    k = np.repeat(k, repeat, axis=1) if repeat > 1 else k
    batch, heads, queries, dim = q.shape
    keys = k.shape[2]
    kt = np.swapaxes(k, 2, 3) * np.float32(1.0 / math.sqrt(dim))
    step = _rows_per_chunk(batch, heads, keys, chunk_elements)
    entropy_sum = max_sum = first_entropy = first_max = 0.0
    for start in range(0, queries, step):
        scores = np.matmul(q[:, :, start:start + step], kt)          # [b, h, rows, keys] float32
        if causal:
            scores = np.where(causal_mask(start, scores.shape[2], queries, keys), scores, np.float32(MASKED))
        shifted = scores - scores.max(axis=-1, keepdims=True)
        weights = np.exp(shifted)
        total = weights.sum(axis=-1)
        # -sum p log p = log Z - sum(e * shifted) / Z, and max p = 1 / Z (the row max has e = 1).
        entropy = np.log(total) - (weights * shifted).sum(axis=-1) / total
        row_max = 1.0 / total
        entropy_sum += float(entropy.sum(dtype=np.float64))
        max_sum += float(row_max.sum(dtype=np.float64))
        first_entropy += float(entropy[0, 0].sum(dtype=np.float64))
        first_max += float(row_max[0, 0].sum(dtype=np.float64))
    rows = batch * heads * queries
    return first_entropy / queries, first_max / queries, entropy_sum / rows, max_sum / rows


def attention_features_device(q, k, sa_order: str = "s,b,h,d", causal: bool = False,
                              chunk_elements: int = CHUNK_ELEMENTS):
    """The same with MindSpore ops; a float32 device tensor of the ATTENTION_OPS, nothing read back."""
    import mindspore as ms
    from mindspore import mint, ops

    _check_shapes(to_bhsd(np.empty(q.shape, dtype=np.bool_), sa_order).shape,
                  to_bhsd(np.empty(k.shape, dtype=np.bool_), sa_order).shape)
    perm = (1, 2, 0, 3) if sa_order == "s,b,h,d" else (0, 2, 1, 3)
    q = ops.transpose(q.astype(ms.float32), perm)
    k = ops.transpose(k.astype(ms.float32), perm)
    if q.shape[1] != k.shape[1]:
        k = ops.repeat_interleave(k, q.shape[1] // k.shape[1], 1)
    batch, heads, queries, dim = q.shape
    keys = k.shape[2]
    kt = ops.transpose(k, (0, 1, 3, 2)) * (1.0 / math.sqrt(dim))
    step = _rows_per_chunk(batch, heads, keys, chunk_elements)
    sums = None   # [entropy, softmax_max] of batch 0 head 0, then of everything
    for start in range(0, queries, step):
        scores = mint.matmul(q[:, :, start:start + step], kt)
        if causal:
            mask = ms.Tensor(causal_mask(start, scores.shape[2], queries, keys))
            scores = ops.where(mask, scores, ms.Tensor(MASKED, ms.float32))
        shifted = scores - scores.max(axis=-1, keepdims=True)
        weights = ops.exp(shifted)
        total = weights.sum(axis=-1)
        entropy = ops.log(total) - (weights * shifted).sum(axis=-1) / total
        row_max = 1.0 / total
        chunk = ops.stack([entropy[0, 0].sum(), row_max[0, 0].sum(), entropy.sum(), row_max.sum()])
        sums = chunk if sums is None else sums + chunk
    rows = float(batch * heads * queries)
    return sums / ms.Tensor([queries, queries, rows, rows], ms.float32)


# --- linear weights ----------------------------------------------------------------------------------------

def spectral_norm(matrix: np.ndarray, start: Optional[np.ndarray] = None, tolerance: float = SPECTRAL_TOLERANCE
                  ) -> Tuple[float, Optional[np.ndarray]]:
    """(||W||_2, right singular vector estimate for a warm start, or None) of a 2-D float32 W, to a bound.

    A small W (smaller side <= EXACT_SIDE) by LAPACK's singular values. Otherwise Lanczos (ARPACK through
    scipy's eigsh) on W^T W over W's smaller side, started from `start` (the previous step's vector) when
    it fits: it stops when the Ritz pair's residual ||W^T W x - theta x|| <= tolerance * theta, which puts
    theta within that residual of an eigenvalue of W^T W, i.e. sigma within tolerance / 2 relative of a
    singular value; the top Ritz value over the Krylov space is the top one unless the start is orthogonal
    to its vector. Power iteration has no such bound: its error with close top singular values stays
    large while its estimate has stopped moving."""
    from scipy.linalg import svdvals
    from scipy.sparse.linalg import ArpackNoConvergence, LinearOperator, eigsh

    w = matrix if matrix.shape[0] >= matrix.shape[1] else matrix.T
    if w.shape[1] <= EXACT_SIDE:
        return float(svdvals(w, check_finite=False)[0]), None
    size = w.shape[1]
    v0 = start if start is not None and start.shape == (size,) and np.any(start) else _cold_start(size)
    gram = LinearOperator((size, size), matvec=lambda x: w.T @ (w @ x), dtype=w.dtype)
    try:
        values, vectors = eigsh(gram, k=1, which="LA", tol=tolerance, v0=v0)
    except ArpackNoConvergence:   # never seen; the exact value then, at the cost of a full decomposition
        return float(svdvals(w, check_finite=False)[0]), None
    return float(np.sqrt(max(float(values[0]), 0.0))), vectors[:, 0].astype(np.float32)


def power_iteration(matrix: np.ndarray, start: Optional[np.ndarray] = None, tolerance: float = 1e-6,
                    max_iterations: int = 100) -> Tuple[float, np.ndarray, int]:
    """(||W v||, v, iterations used) after power iteration on W^T W over W's smaller side, stopping when
    the estimate changes by less than `tolerance` relative (0: a fixed count, as MindFormers'
    `power_iteration_num`). The estimate approaches ||W||_2 from below, geometrically with ratio
    (sigma_2 / sigma_1)^2."""
    w = matrix if matrix.shape[0] >= matrix.shape[1] else matrix.T
    v = _unit(start if start is not None and start.shape == (w.shape[1],) else _cold_start(w.shape[1]))
    sigma = 0.0
    for iteration in range(1, max_iterations + 1):
        u = w @ v
        new_sigma = float(np.linalg.norm(u.astype(np.float64)))
        v = _unit(w.T @ u) if new_sigma > 0 else v
        if abs(new_sigma - sigma) <= tolerance * new_sigma:
            return new_sigma, v, iteration
        sigma = new_sigma
    return sigma, v, max_iterations


def _cold_start(size: int) -> np.ndarray:
    """Deterministic start with every component non-zero (almost surely not orthogonal to the top vector)."""
    return np.random.default_rng(0).standard_normal(size).astype(np.float32)


def _unit(vector: np.ndarray) -> np.ndarray:
    norm = float(np.linalg.norm(vector.astype(np.float64)))
    return (vector / norm).astype(np.float32) if norm > 0 else vector.astype(np.float32)


def linear_features_numpy(weight: np.ndarray, start: Optional[np.ndarray] = None
                          ) -> Tuple[float, float, Optional[np.ndarray]]:
    """(sr, kernel_norm, vector for the next step) of a 2-D weight, float32 data."""
    w = np.asarray(weight, dtype=np.float32)
    frobenius = float(np.sqrt(np.dot(w.reshape(-1).astype(np.float64), w.reshape(-1).astype(np.float64))))
    if not math.isfinite(frobenius):
        return float("nan"), frobenius, start
    sigma, vector = spectral_norm(w, start) if frobenius > 0 else (0.0, start)
    return (frobenius / sigma if sigma > 0 else float("nan")), frobenius, vector


def linear_features_device(weight, start=None):
    """(device tensor [sr, kernel_norm], device vector for the next step), a fixed number of iterations."""
    import mindspore as ms
    from mindspore import mint, ops

    w = weight.astype(ms.float32)
    w = w if w.shape[0] >= w.shape[1] else w.T
    v = start if start is not None and tuple(start.shape) == (w.shape[1],) else ms.Tensor(_cold_start(w.shape[1]))
    v = v / mint.sqrt(mint.sum(mint.square(v)))
    for _ in range(DEVICE_ITERATIONS[1] if start is not None else DEVICE_ITERATIONS[0]):
        u = mint.matmul(w, v)
        v = mint.matmul(w.T, u)
        v = v / mint.sqrt(mint.sum(mint.square(v)))
    sigma = mint.sqrt(mint.sum(mint.square(mint.matmul(w, v))))
    frobenius = mint.sqrt(mint.sum(mint.square(w)))
    return ops.stack([frobenius / sigma, frobenius]), v


# --- the monitor -------------------------------------------------------------------------------------------

class L2FeaturesMonitor(Monitor):
    """`record(ATTENTION_HOOK, (name, q, k), {"micro_step": n})` per forward call of an attention cell,
    `record(LINEAR_HOOK, (name, weight))` once per step per linear cell; `collect(step)` returns one
    TensorStatsRecord per call and cell. Keeps each weight's power-iteration vector across steps."""

    KEYS = (ATTENTION_HOOK, LINEAR_HOOK)

    def __init__(self, sa_order: str = "s,b,h,d", causal: bool = True, on_host: Optional[bool] = None,
                 rank: int = 0, chunk_elements: int = CHUNK_ELEMENTS):
        if on_host is None:
            from mindmon.kernels.stats import host_is_device

            on_host = host_is_device()
        self.sa_order, self.causal, self.on_host, self.rank = sa_order, causal, on_host, rank
        self.chunk_elements = chunk_elements
        self.vectors: Dict[str, object] = {}     # weight name -> last step's singular vector estimate
        self._pending: List[tuple] = []          # (kind, name, micro_step, ops, shape, dtype, values)
        self._calls: Dict[str, int] = {}         # name -> records of this step

    def reset(self) -> None:
        self._pending.clear()
        self._calls: Dict[str, int] = {}

    def record(self, key: str, value=None, context: Optional[dict] = None) -> None:
        """Attention: `micro_step` from the context, else the cell's count of calls in this step. Linear: the
        first call of a step counts (the weight is the same for every micro-batch of a step)."""
        name = value[0]
        calls = self._calls.get(name, 0)
        self._calls[name] = calls + 1
        if key == ATTENTION_HOOK:
            _, q, k = value
            values = self._attention(q, k)
            micro_step = (context or {}).get("micro_step", calls)
            self._pending.append((key, name, micro_step, ATTENTION_OPS, _shape(q), str(q.dtype), values))
        elif key == LINEAR_HOOK and not calls:
            _, weight = value
            values = self._linear(name, weight)
            self._pending.append((key, name, None, LINEAR_OPS, _shape(weight), str(weight.dtype), values))

    def _attention(self, q, k):
        if self.on_host:
            return attention_features_numpy(host_array(q).reshape(_shape(q)), host_array(k).reshape(_shape(k)),
                                            self.sa_order, self.causal, self.chunk_elements)
        return attention_features_device(q, k, self.sa_order, self.causal, self.chunk_elements)

    def _linear(self, name: str, weight):
        if self.on_host:
            matrix = host_array(weight).reshape(_shape(weight))
            sr, kernel_norm, self.vectors[name] = linear_features_numpy(matrix, self.vectors.get(name))
            return sr, kernel_norm
        values, self.vectors[name] = linear_features_device(weight, self.vectors.get(name))
        return values

    def collect(self, step: int) -> List[Record]:
        device = [entry[6] for entry in self._pending if not isinstance(entry[6], tuple)]
        if device:  # one host transfer for every device result of the step
            from mindspore import ops

            host = iter(ops.concat(device).asnumpy().astype(np.float64).tolist())
        records = []
        for kind, name, micro_step, ops_, shape, dtype, values in self._pending:
            values = list(values) if isinstance(values, tuple) else [next(host) for _ in ops_]
            records.append(TensorStatsRecord(step, micro_step, self.rank, kind, name, [float(v) for v in values],
                                             ops=ops_, shape=shape, dtype=dtype))
        self.reset()
        return records

    def close(self) -> None:
        self.reset()
        self.vectors.clear()


def _shape(tensor) -> Tuple[int, ...]:
    return tuple(int(d) for d in tensor.shape)
