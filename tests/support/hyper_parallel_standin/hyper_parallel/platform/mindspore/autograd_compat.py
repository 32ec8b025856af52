"""`loss.backward(sense)` and `param.grad` on MindSpore 2.10 PyNative, which MindFormers 2.x's stock step
uses: MindSpore records the graph while its grad flag is on, and `_c_expression.run_backward` adds each
parameter's gradient to its `_grad`."""
import numpy as np

_ENABLED = {"done": False}


def _backward(self, gradient=None):
    from mindspore import Tensor
    from mindspore._c_expression import run_backward

    if gradient is None:
        gradient = Tensor(np.ones(self.shape, np.float32)).astype(self.dtype)
    run_backward((self,), (gradient,), False, False, ())


def _get_grad(self):
    return self._grad


def _set_grad(self, value):
    self._grad = value


def enable_mindspore_backward_compat():
    """Idempotent: the grad flag on for the process, `Tensor.backward` and `Tensor.grad`/`Parameter.grad`."""
    if _ENABLED["done"]:
        return
    from mindspore import Parameter, Tensor
    from mindspore.common.api import _pynative_executor

    _pynative_executor.set_grad_flag(True)
    Tensor.backward = _backward
    Tensor.grad = property(_get_grad, _set_grad)
    Parameter.grad = property(_get_grad, _set_grad)
    _ENABLED["done"] = True
