"""One optimizer step over K micro-batches, recording into a MonitorGroup.

Micro-batch k contributes the gradient of loss_k / K, so the accumulated gradient is exactly
the one the optimizer applies; it is clipped to `max_norm` by its global norm, as MindFormers
does, and the update is skipped when that norm is not finite.

Example (a plain MindSpore loop):
    group = build_group(parse_sections({"monitor": {"train_state": {"local_norm": True, "local_loss": True}}}),
                        parameter_names=parameter_names(net, optimizer))
    train_step = AccumulatingTrainStep(lambda ids, labels: net(ids, labels)[0], optimizer,
                                       num_micro_steps=4, group=group)
    group.setup()
    for step, batch in enumerate(batches, start=1):
        loss, grad_norm = train_step(split_batch(batch, 4))
        group.flush(step, loss=loss, grad_norm=grad_norm)
    group.close()
"""
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
from mindspore import Tensor, ops, value_and_grad

from mindmon.compat import narrow, with_device_of
from mindmon.config import check_max_norm
from mindmon.parallel.data_parallel import DataParallel
from mindmon.loop.loss_scaling import as_loss_scaler
from mindmon.core.events import (GradientSnapshot, GradientsReduced, MicroBatchEnd, MicroBatchGradients, MicroBatchLoss,
                            MicroBatchLosses, ReduceBegin, StepBegin, StepLoss, UpdateDone)
from mindmon.parallel.reduce import model_parallel_sums
from mindmon.kernels.stats import HostGradientBuffer, SquaredNorms, host_is_device, to_float

Batch = Union[Dict[str, object], Tuple, List]


def split_batch(batch: Batch, num_micro_steps: int) -> List[Batch]:
    """Cut every column of a batch (dict or tuple of tensors) into K equal micro-batches on axis 0."""
    columns = batch.values() if isinstance(batch, dict) else batch
    sizes = {int(c.shape[0]) for c in columns}
    if len(sizes) != 1 or next(iter(sizes)) % num_micro_steps:
        raise ValueError(f"cannot cut a batch with leading sizes {sorted(sizes)} into {num_micro_steps} "
                         f"equal micro-batches; the dataset must yield global_batch_size / data_parallel "
                         f"samples per step")
    size = next(iter(sizes)) // num_micro_steps

    def piece(column, k):
        if num_micro_steps == 1:
            return column
        return with_device_of((narrow(column, 0, k * size, size),), (column,))[0]   # mindnlp's device tag

    if isinstance(batch, dict):
        return [{name: piece(c, k) for name, c in batch.items()} for k in range(num_micro_steps)]
    return [tuple(piece(c, k) for c in batch) for k in range(num_micro_steps)]


def batch_size(batch: Batch) -> Tuple[Optional[int], Optional[int]]:
    """(samples, tokens) of a micro-batch: its columns' leading dimension, and that times the second
    dimension of its first column when that is 2-d or more (token ids: (samples, sequence)); None where
    the batch does not say."""
    columns = list(batch.values() if isinstance(batch, dict) else batch)
    shape = tuple(getattr(columns[0], "shape", ())) if columns else ()
    if not shape:
        return None, None
    return int(shape[0]), int(shape[0]) * int(shape[1]) if len(shape) >= 2 else None


def check_optimizer(optimizer) -> None:
    """The train step takes the gradients with respect to `optimizer.parameters` and applies them by
    calling `optimizer(gradients)`, as a MindSpore `nn.Optimizer` works. A torch-style optimizer
    (`param_groups`, `zero_grad()`, `step()`) has neither: refused here, not at the first step."""
    parameters = getattr(optimizer, "parameters", None)
    if parameters is None or callable(parameters) or not callable(optimizer):
        raise TypeError(f"optimizer: got {type(optimizer).__module__}.{type(optimizer).__name__}, which has no "
                        f"`.parameters` sequence or cannot be called with the gradients; allowed: a MindSpore "
                        f"optimizer (mindspore.nn.Optimizer, e.g. nn.AdamWeightDecay(net.trainable_params())); "
                        f"torch-style optimizers (param_groups, step()) are not supported")


class AccumulatingTrainStep:
    """`step(micro_batches) -> (mean loss Tensor, global grad norm float before clipping)`. A norm
    that is not finite (NaN, inf) is returned as it is and the update is skipped.

    `loss_fn` takes one micro-batch (a dict as keyword-free single argument, or a tuple spread
    as positional arguments) and returns the scalar loss. `group` may be None or inactive: then
    nothing is recorded and the step costs what plain accumulation costs.

    `loss_scaler` (a mindspore.amp DynamicLossScaler or StaticLossScaler, or a DynamicLossScaleManager or
    FixedLossScaleManager, for float16 models) scales each micro-batch's loss before its backward and
    unscales its gradients after; once per step it is adjusted with whether the global norm was finite
    (a manager: its update_loss_scale(overflow)). Every step records `loss_scale` (the scale
    after that adjustment, whether the gradients overflowed, whether the update was skipped) for the
    loss_scale feature.

    It tells the group what happens as it happens, in the step events of mindmon.core.events (StepBegin, per
    micro-batch MicroBatchLoss / MicroBatchGradients / MicroBatchEnd, ReduceBegin, GradientsReduced,
    UpdateDone, StepLoss); it knows no feature.
    """

    def __init__(self, loss_fn: Callable, optimizer, num_micro_steps: int, group=None,
                 max_norm: float = 1.0, on_host: Optional[bool] = None,
                 data_parallel: Optional[DataParallel] = None, layout=None, loss_scaler=None):
        if num_micro_steps < 1:
            raise ValueError(f"num_micro_steps: got {num_micro_steps}; allowed: a positive int")
        check_optimizer(optimizer)
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.num_micro_steps = num_micro_steps
        self.group = group
        self.max_norm = check_max_norm(max_norm, "max_norm")  # NaN would multiply every gradient by NaN
        if group is not None:   # so the files mark where the gradient was clipped (`mindmon report`)
            group.set_max_norm(self.max_norm)
        self.on_host = host_is_device() if on_host is None else on_host
        self.data_parallel = data_parallel or (layout.data_parallel if layout is not None else DataParallel())
        # A mindspore.amp loss scaler (float16 training): the loss is multiplied by its scale before the
        # backward, each micro-batch's gradients divided by it after, and it is adjusted once per step.
        self.loss_scaler = as_loss_scaler(loss_scaler)
        self.grad_fn = value_and_grad(self._scaled_loss, None, optimizer.parameters, has_aux=True)
        # On CPU with float32 parameters the gradients are summed in one numpy buffer (stats.py).
        parameters = list(optimizer.parameters)
        self._parameters = parameters
        self._host = HostGradientBuffer(parameters) if self.on_host and HostGradientBuffer.fits(parameters) else None
        # Tensor / pipeline / expert / context parallelism: the global norm and the losses of the whole model.
        self.model_parallel = model_parallel_sums(layout, parameters)

    def _scaled_loss(self, *args):
        loss = self.loss_fn(*args)
        scaled = loss / self.num_micro_steps
        if self.loss_scaler is not None:
            scaled = self.loss_scaler.scale(scaled)
        return scaled, ops.stop_gradient(loss)

    def __call__(self, micro_batches: Sequence[Batch]):
        group = self.group if self.group is not None and self.group.active else None
        if group is not None:
            group.emit(StepBegin())
        accumulated, loss_sum, last_norms = self._accumulate_micro_batches(micro_batches, group)
        if group is not None:
            group.emit(ReduceBegin())
        if accumulated is None and not self.data_parallel.active and self.model_parallel is None:
            grad_norm = float(np.sqrt(last_norms.accumulated.sum()))   # one rank, summed in the host buffer
            if group is not None:
                group.emit(GradientsReduced(None))
            accumulated, mean_loss = self._clip_on_host(grad_norm), loss_sum / self.num_micro_steps
        else:
            accumulated = self._host.take() if accumulated is None else accumulated
            reduced, mean_loss, exchange = self._reduce(accumulated, loss_sum, group)
            if group is not None:   # several ranks: the norm of the data-parallel mean; one rank: A_{K-1}
                group.emit(GradientsReduced(reduced if self.data_parallel.active else None))
            if self.model_parallel is None:
                grad_norm = self._global_norm(reduced)
            else:
                grad_norm, mean_loss = self._finish_model_parallel(reduced, mean_loss, group, exchange)
            accumulated = self._clip(reduced, grad_norm)
        # Asked at every step: the group's actions may take part in a collective.
        skip = self.group is not None and self.group.should_skip_update(grad_norm)
        applied = bool(np.isfinite(grad_norm)) and not skip
        if applied:
            self.optimizer(with_device_of(accumulated, self._parameters))
        if self.loss_scaler is not None:
            self.loss_scaler.adjust(Tensor(bool(np.isfinite(grad_norm))))
        if group is not None:
            group.emit(UpdateDone(grad_norm, not np.isfinite(grad_norm), not applied, self.loss_scaler))
            group.emit(StepLoss(mean_loss))
        return mean_loss, grad_norm

    def _finish_model_parallel(self, reduced, mean_loss, group, exchange):
        """The global norm over every shard of every stage and the last stage's losses
        (mindmon.parallel.reduce); the monitors' cross-rank payloads ride in the same collectives."""
        squared = SquaredNorms(self.on_host)
        squared.add("grads", reduced)
        grad_norm, losses, mean = self.model_parallel.finish(
            squared.results()["grads"], [float(to_float(loss)) for loss in self._losses], float(to_float(mean_loss)),
            exchange)
        if exchange is not None:
            exchange.deliver()
        if group is not None and self.model_parallel.deferred_losses:
            group.emit(MicroBatchLosses(losses))
            for k, loss in enumerate(losses):
                group.emit(MicroBatchLoss(k, loss))
        return grad_norm, mean

    def _accumulate_micro_batches(self, micro_batches: Sequence[Batch], group):
        """Forward/backward per micro-batch, told to the group as it goes. Returns (the summed gradients
        as MindSpore tensors, or None when they are summed in the host buffer; the sum of the losses; the
        host buffer's norms of the last micro-step, or None)."""
        losses, accumulated, host, norms = [], None, self._host, None
        wants_norms = group is not None and group.should_take(MicroBatchGradients)
        for k, batch in enumerate(micro_batches):
            args = (batch,) if isinstance(batch, dict) else tuple(batch)
            (_, loss), grads = self.grad_fn(*args)
            if self.loss_scaler is not None:
                grads = self.loss_scaler.unscale(grads)
            grads = with_device_of(grads, self._parameters)   # mindnlp's tensors need a device tag
            loss = with_device_of((loss,), self._parameters[:1])[0]
            if host is not None:
                # The last micro-step's norms give the global norm without another read of the buffer.
                micro, norms = host.add(grads, with_norms=wants_norms or k == len(micro_batches) - 1)
                snapshot = GradientSnapshot(host.views if k == 0 else micro, host.views, norms)
            else:
                accumulated = grads if accumulated is None else tuple(a + g for a, g in zip(accumulated, grads))
                snapshot = GradientSnapshot(grads, accumulated)
            losses.append(loss)
            if group is not None:
                if self.model_parallel is None or not self.model_parallel.deferred_losses:
                    group.emit(MicroBatchLoss(k, loss))   # (a pipeline's come from its last stage)
                group.emit(MicroBatchGradients(k, snapshot))
                group.emit(MicroBatchEnd(k, *batch_size(batch)))
        self._losses = losses
        return accumulated, sum(losses[1:], losses[0]), norms

    def _clip_on_host(self, grad_norm: float) -> tuple:
        if self.max_norm > 0 and np.isfinite(grad_norm) and grad_norm > self.max_norm:
            self._host.scale(self.max_norm / grad_norm)
        return self._host.take()

    def _reduce(self, accumulated, loss_sum, group):
        """The data-parallel mean of the gradients and of the micro-batch losses, with the monitors'
        cross-rank payloads (mindmon.core.cross_rank), in one collective. One rank: nothing to reduce. Returns
        (gradients, mean loss, the step's exchange of payloads, or None); the exchange is delivered here
        unless the model-parallel sums carry it on."""
        several = self.data_parallel.active or self.model_parallel is not None
        exchange = group.cross_rank(self.num_micro_steps) if group is not None and several else None
        if not self.data_parallel.active:
            return accumulated, loss_sum / self.num_micro_steps, exchange
        sent = exchange.before_data_parallel() if exchange is not None else []
        reduced = self.data_parallel.sum(list(accumulated) + [loss_sum] + sent)
        count = len(accumulated)
        if exchange is not None:
            exchange.after_data_parallel(reduced[count + 1:])
            if self.model_parallel is None:
                exchange.deliver()
        size = self.data_parallel.size
        grads = tuple(g / size for g in reduced[:count])
        return grads, reduced[count] / (self.num_micro_steps * size), exchange

    def _global_norm(self, grads) -> float:
        norms = SquaredNorms(self.on_host)
        norms.add("grads", grads)
        return float(np.sqrt(norms.results()["grads"].sum()))

    def _clip(self, grads, grad_norm: float):
        if self.max_norm == 0 or grad_norm <= self.max_norm:  # 0: clipping off
            return grads
        scale = self.max_norm / grad_norm
        return tuple(g * scale for g in grads)
