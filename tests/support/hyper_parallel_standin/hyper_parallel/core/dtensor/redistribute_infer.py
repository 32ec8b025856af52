from hyper_parallel._single_device import multi_device_class

RedistributionOperatorInfer = multi_device_class("hyper_parallel.RedistributionOperatorInfer")
DevMat = multi_device_class("hyper_parallel.DevMat")
