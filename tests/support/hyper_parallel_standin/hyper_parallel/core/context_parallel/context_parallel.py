from hyper_parallel._single_device import multi_device_class

ContextParallel = multi_device_class("hyper_parallel.ContextParallel")
