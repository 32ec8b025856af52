from hyper_parallel._single_device import multi_device_class, multi_device_function

CheckpointPolicy = multi_device_class("hyper_parallel.CheckpointPolicy")
SwapManager = multi_device_class("hyper_parallel.SwapManager")
checkpoint_wrapper = multi_device_function("hyper_parallel.checkpoint_wrapper")
swap_wrapper = multi_device_function("hyper_parallel.swap_wrapper")
checkpoint_exclude_wrapper = multi_device_function("hyper_parallel.checkpoint_exclude_wrapper")
