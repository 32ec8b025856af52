from hyper_parallel._single_device import multi_device_class

HookCoordinator = multi_device_class("hyper_parallel.HookCoordinator")
HookRole = multi_device_class("hyper_parallel.HookRole")
