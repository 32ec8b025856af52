from hyper_parallel._single_device import multi_device_class

AsyncContextParallel = multi_device_class("hyper_parallel.AsyncContextParallel")
