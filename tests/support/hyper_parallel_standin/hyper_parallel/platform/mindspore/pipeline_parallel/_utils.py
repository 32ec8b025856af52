from hyper_parallel._single_device import multi_device_class

_MicroBatch = multi_device_class("hyper_parallel pipeline_parallel._MicroBatch")
