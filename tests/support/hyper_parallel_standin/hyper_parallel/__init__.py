"""A single-device stand-in for the hyper_parallel package that MindFormers 2.x imports unconditionally
(no package registry serves hyper-parallel). Only the tests put it on sys.path, in the MindSpore 2.10
environment (tests/conftest.py). See README.md beside this folder for what it gives and what it refuses."""
from hyper_parallel._single_device import multi_device_class, multi_device_function
from hyper_parallel.core.dtensor.dtensor import DTensor, SkipDTensorDispatch
from hyper_parallel.core.device_mesh import DeviceMesh, init_device_mesh

IS_STANDIN = True
DFunction = multi_device_class("hyper_parallel.DFunction")
PipelineStage = multi_device_class("hyper_parallel.PipelineStage")
shard_module = multi_device_function("hyper_parallel.shard_module")

__all__ = ["DFunction", "DTensor", "DeviceMesh", "PipelineStage", "SkipDTensorDispatch", "init_device_mesh",
           "shard_module"]
