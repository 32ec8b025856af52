"""Ascend (NPU) kernels MindFormers 2.1 imports by name at module level; no CPU has them."""
from hyper_parallel._single_device import MultiDeviceOnly


def _npu_only(name):
    def refuse(*args, **kwargs):
        raise MultiDeviceOnly(f"hyper_parallel stand-in: {name} is an Ascend kernel, which the stand-in does not provide")

    refuse.__name__ = name
    return refuse


npu_dense_lightning_indexer_grad_kl_loss = _npu_only("npu_dense_lightning_indexer_grad_kl_loss")
npu_dense_lightning_indexer_softmax_lse = _npu_only("npu_dense_lightning_indexer_softmax_lse")
npu_lightning_indexer = _npu_only("npu_lightning_indexer")
npu_mhc_post = _npu_only("npu_mhc_post")
npu_mhc_pre_sinkhorn = _npu_only("npu_mhc_pre_sinkhorn")
npu_sparse_flash_mla = _npu_only("npu_sparse_flash_mla")
npu_sparse_flash_mla_grad = _npu_only("npu_sparse_flash_mla_grad")
npu_sparse_lightning_indexer_grad_kl_loss = _npu_only("npu_sparse_lightning_indexer_grad_kl_loss")
npu_sparse_lightning_indexer_kl_loss_grad = _npu_only("npu_sparse_lightning_indexer_kl_loss_grad")
