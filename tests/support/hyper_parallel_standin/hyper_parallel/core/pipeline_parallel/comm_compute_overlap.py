from hyper_parallel._single_device import multi_device_class

CommComputeOverlap = multi_device_class("hyper_parallel.CommComputeOverlap")
