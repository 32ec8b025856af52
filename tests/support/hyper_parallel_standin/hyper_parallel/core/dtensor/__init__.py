from hyper_parallel.core.dtensor.dtensor import DTensor, distribute_tensor

__all__ = ["DTensor", "distribute_tensor"]
