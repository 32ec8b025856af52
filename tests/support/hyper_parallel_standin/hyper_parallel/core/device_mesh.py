from hyper_parallel._single_device import multi_device_class, multi_device_function

DeviceMesh = multi_device_class("hyper_parallel.DeviceMesh")
init_device_mesh = multi_device_function("hyper_parallel.init_device_mesh")
