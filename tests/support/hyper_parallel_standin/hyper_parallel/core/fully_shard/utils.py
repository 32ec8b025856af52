from hyper_parallel._single_device import multi_device_class

OffloadPolicy = multi_device_class("hyper_parallel.OffloadPolicy")
CPUOffloadPolicy = multi_device_class("hyper_parallel.CPUOffloadPolicy")
