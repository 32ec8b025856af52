"""Numeric kernels and tensor memory: the one-pass statistics loops (`one_pass`: the API; `compiled`: the
loops and their numba compilation) and the host-side reads of tensors (`stats`: batched squared norms, the
host gradient buffer, `host_array` / `direct_view` of a tensor's memory)."""
