"""Squared norms (mindmon.kernels.stats) at the sizes and dtypes real parameters have, against float64 numpy.

The host path sums float32 arrays of more than 4096 elements in BLAS blocks of 65536 elements, so
the element counts sit on each side of both boundaries; a few million stands for a real weight
matrix. The device path (`on_host=False`) runs MindSpore's own reduction, on CPU here.

The reference is numpy in float64 over the tensor's exact values (float16 and bfloat16 values are
exact in float32, so `astype(float32)` loses nothing before numpy widens them to float64).
"""
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from mindmon.kernels.stats import SquaredNorms, host_is_device, to_float

pytestmark = pytest.mark.ms27   # also runs on MindSpore 2.7 (make test-ms27)

BOUNDARY_SIZES = (4095, 4096, 4097, 65535, 65536, 65537)
LARGE_SIZE = 3_000_001  # a few million, not a multiple of any block
DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}

# Relative tolerances, measured with margin (OpenBLAS 0.3.23, MindSpore 2.9 CPU):
# - float32 data: one float32 accumulation per 65536-element block, then float64 across blocks;
#   the error is a few float32 roundings, measured <= 2e-7, bounded here at 1e-6.
# - float16 data: summed in float64 on the host (exact to ~1e-16); the device path widens to float32
#   and accumulates in float32 (measured <= 6e-8), so 1e-6 covers both.
# - bfloat16 data: BLAS sdot over values with 8-bit mantissas rounds with a systematic bias, measured
#   at 4e-6 for full 65536-element blocks (the float32 accumulation, not mindmon, loses it), so 1e-5.
#   An error in the code (a block skipped or counted twice, a wrong cast) is at least 1/1000 here.
RTOL = {"float32": 1e-6, "float16": 1e-6, "bfloat16": 1e-5}


def _tensor(values: np.ndarray, dtype_name: str) -> Tensor:
    return Tensor(values.astype(np.float32)).astype(DTYPES[dtype_name])


def _exact_squared_norm(tensor: Tensor) -> float:
    values = tensor.astype(ms.float32).asnumpy().astype(np.float64).ravel()
    return float(np.sum(values * values))


def _squared_norms(tensors, on_host: bool) -> np.ndarray:
    norms = SquaredNorms(on_host=on_host)
    norms.add("g", tensors)
    result = norms.results()["g"]
    assert result.dtype == np.float64 and result.shape == (len(tensors),)
    return result


@pytest.mark.parametrize("on_host", [True, False], ids=["host", "device"])
@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_every_block_boundary(on_host, dtype_name):
    rng = np.random.default_rng(1)
    # one call with every size: also checks that each result lands at its tensor's index
    tensors = [_tensor(rng.normal(0.2, 1.0, size=n), dtype_name) for n in BOUNDARY_SIZES]
    expected = [_exact_squared_norm(t) for t in tensors]
    np.testing.assert_allclose(_squared_norms(tensors, on_host), expected, rtol=RTOL[dtype_name], atol=0)


@pytest.mark.parametrize("on_host", [True, False], ids=["host", "device"])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_a_few_million_elements(on_host, dtype_name):
    rng = np.random.default_rng(2)
    # a 2-d weight, as parameters are: the flattening must cover every row
    tensor = _tensor(rng.normal(0.0, 0.02, size=(1000, LARGE_SIZE // 1000 + 1)), dtype_name)
    assert tensor.size > LARGE_SIZE
    got = _squared_norms([tensor], on_host)[0]
    assert got == pytest.approx(_exact_squared_norm(tensor), rel=RTOL[dtype_name], abs=0)


@pytest.mark.parametrize("size", [12, 4095, 4096])
def test_small_float32_arrays_are_summed_in_float64_on_the_host(size):
    """Up to 4096 elements the host path widens to float64 first: exact to float64 rounding, where a
    float32 accumulation would be off by about 1e-8."""
    tensor = Tensor(np.random.default_rng(5).normal(0.2, 1.0, size=size).astype(np.float32))
    assert _squared_norms([tensor], on_host=True)[0] == pytest.approx(_exact_squared_norm(tensor), rel=1e-13, abs=0)


def test_on_cpu_tensors_are_host_memory():
    """The test session runs MindSpore on CPU: the monitors must take the host (numpy) path there."""
    assert host_is_device() is True


@pytest.mark.parametrize("on_host", [True, False], ids=["host", "device"])
def test_a_tensor_of_one_value_per_block_position(on_host):
    """Every element distinct and its index recoverable: a block read twice or skipped changes the sum
    by at least one element's square, far above the tolerance."""
    values = np.arange(1, 65537 * 2 + 2, dtype=np.float64)
    tensor = Tensor((values / values.size).astype(np.float32))
    exact = _exact_squared_norm(tensor)
    assert _squared_norms([tensor], on_host)[0] == pytest.approx(exact, rel=1e-6, abs=0)


@pytest.mark.parametrize("on_host", [True, False], ids=["host", "device"])
@pytest.mark.parametrize("size", [12, 70000], ids=["small", "blocked"])
@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_nan_and_inf_are_never_hidden(on_host, size, dtype_name):
    """A NaN makes the norm NaN, an inf (of either sign) makes it +inf; the neighbours stay exact."""
    rng = np.random.default_rng(3)
    clean = rng.normal(size=size)
    with_nan, with_inf, with_both = clean.copy(), clean.copy(), clean.copy()
    with_nan[size // 2] = np.nan
    with_inf[-1] = -np.inf
    with_both[0], with_both[1] = np.inf, np.nan
    tensors = [_tensor(v, dtype_name) for v in (clean, with_nan, with_inf, with_both)]
    got = _squared_norms(tensors, on_host)
    assert got[0] == pytest.approx(_exact_squared_norm(tensors[0]), rel=RTOL[dtype_name])
    assert np.isnan(got[1])
    assert got[2] == np.inf
    assert np.isnan(got[3])


@pytest.mark.parametrize("on_host", [True, False], ids=["host", "device"])
def test_float16_squares_do_not_overflow(on_host):
    """60000**2 is far beyond float16's range (65504): squares must be taken in a wider type."""
    tensor = Tensor(np.array([60000.0, -60000.0, 1.0] * 3000, dtype=np.float16))
    got = _squared_norms([tensor], on_host)[0]
    assert np.isfinite(got)
    assert got == pytest.approx(3000 * (2 * 60000.0 ** 2 + 1), rel=1e-6)


@pytest.mark.parametrize("on_host", [True, False], ids=["host", "device"])
def test_alias_reuses_the_norms_and_clear_forgets_them(on_host):
    rng = np.random.default_rng(4)
    tensors = [Tensor(rng.normal(size=n).astype(np.float32)) for n in (5000, 7)]
    norms = SquaredNorms(on_host=on_host)
    norms.add(("accumulated", 0), tensors)
    norms.alias(("micro", 0), ("accumulated", 0))
    norms.alias(("micro", 1), ("never added", 1))   # nothing to alias: no key appears
    norms.add("empty", [])                          # no tensors: no key appears
    results = norms.results()
    assert set(results) == {("accumulated", 0), ("micro", 0)}
    expected = [_exact_squared_norm(t) for t in tensors]
    np.testing.assert_allclose(results[("micro", 0)], expected, rtol=1e-6)
    assert results[("micro", 0)] is results[("accumulated", 0)]  # read (and copied to the host) once
    norms.clear()
    assert norms.results() == {}


def test_to_float_reads_tensors_numpy_scalars_and_floats():
    assert to_float(Tensor(np.float32(2.5))) == 2.5 and isinstance(to_float(Tensor(np.float32(2.5))), float)
    assert to_float(np.float16(0.5)) == 0.5 and to_float(3) == 3.0


def test_host_buffer_norms_taken_while_adding():
    """The CPU training step's buffer adds three micro-batches and takes, block by block while adding,
    the squared norm of each micro-batch's gradient and of each sum: at every block boundary, a few
    million elements, and one parameter that is a scalar, against float64 numpy of the same values.
    Tolerances: float32 sums of 4096-element blocks (about 1e-7 compiled, where they use vector lanes;
    about 1e-6 as plain Python under NUMBA_DISABLE_JIT=1, summed one element after another)."""
    from mindmon.kernels.stats import HostGradientBuffer

    rng = np.random.default_rng(11)
    shapes = [(n,) for n in BOUNDARY_SIZES] + [(1000, LARGE_SIZE // 1000 + 1), (), (3, 4)]
    parameters = [Tensor(np.zeros(shape, np.float32)) for shape in shapes]
    micro_batches = [[Tensor(rng.normal(0.1 * k, 1.0, size=shape).astype(np.float32)) for shape in shapes]
                     for k in range(3)]
    buffer, total = HostGradientBuffer(parameters), [np.zeros(shape, np.float64) for shape in shapes]
    for k, grads in enumerate(micro_batches):
        _, norms = buffer.add(grads, with_norms=True)
        mine = [g.asnumpy().astype(np.float64) for g in grads]
        total = [t + g for t, g in zip(total, mine)]
        np.testing.assert_allclose(norms.micro, [np.sum(g * g) for g in mine], rtol=2e-6, atol=0)
        # the float32 sums themselves differ from float64 sums by float32 rounding of each element
        np.testing.assert_allclose(norms.accumulated, [np.sum(t * t) for t in total], rtol=2e-6, atol=0)
    _, no_norms = buffer.add(micro_batches[0], with_norms=False)
    assert no_norms is None
    gradients = buffer.take()
    expected = [t + g.asnumpy() for t, g in zip(total, micro_batches[0])]
    for got, want, shape in zip(gradients, expected, shapes):
        assert tuple(got.shape) == shape
        np.testing.assert_allclose(got.asnumpy(), want, rtol=1e-5, atol=1e-5)


def test_host_buffer_only_for_float32_parameters():
    from mindmon.kernels.stats import HostGradientBuffer

    float32, float16 = Tensor(np.zeros(3, np.float32)), Tensor(np.zeros(3, np.float16))
    assert HostGradientBuffer.fits([float32, float32]) is True
    assert HostGradientBuffer.fits([float32, float16]) is False   # one float16 parameter: the device path
    assert HostGradientBuffer.fits([float16]) is False
    assert HostGradientBuffer.fits([]) is False                   # no parameters: nothing to buffer


@pytest.mark.parametrize("size", [4095, 4096])
def test_host_buffer_sums_small_parameters_in_float64(size):
    """Up to 4096 elements the buffer's norms are float64 sums of the float32 values (relative error
    ~1e-16), not float32 BLAS blocks (~1e-7 here): the same rule as SquaredNorms."""
    from mindmon.kernels.stats import HostGradientBuffer

    rng = np.random.default_rng(size)
    grads = [[Tensor(rng.normal(size=size).astype(np.float32))] for _ in range(2)]
    buffer = HostGradientBuffer(grads[0])
    _, first = buffer.add(grads[0], with_norms=True)
    _, second = buffer.add(grads[1], with_norms=True)
    g0, g1 = (g[0].asnumpy() for g in grads)
    accumulated = (g0 + g1).astype(np.float64)    # the buffer holds the float32 sum
    np.testing.assert_allclose(first.accumulated, [np.sum(g0.astype(np.float64) ** 2)], rtol=1e-12, atol=0)
    np.testing.assert_allclose(second.micro, [np.sum(g1.astype(np.float64) ** 2)], rtol=1e-12, atol=0)
    np.testing.assert_allclose(second.accumulated, [np.sum(accumulated ** 2)], rtol=1e-12, atol=0)
    assert buffer.add(grads[0])[1] is None   # norms only when asked for
