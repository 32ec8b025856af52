"""ModelMonitorCallback: a `mindspore.train.Callback` for `Model.train`, doing for that loop what
MonitorCallback does for MindFormers' trainer: the group is set up at train begin, written at every step
end (with the step's loss) and closed at train end.

Model runs a step as one call of its train network (forward, backward, the gradient reducer, the
optimizer), so the step's events come from the callback's hooks and from the train network's optimizer:

    StepBegin                                  on_train_step_begin (the batch is fetched)
    MicroBatchEnd(0, samples, tokens),         the optimizer is called: forward and backward are done
    ReduceBegin, GradientsReduced(None)        (the reducer ran inside the backward's window)
    UpdateDone(overflow, loss_scale)           on_train_step_end, for a loss-scale cell (below)
    StepEnd, StepWritten                       on_train_step_end, by the group's flush

The optimizer is hooked only in PyNative mode, where the train network's cells run as Python; in graph
mode, or at a step whose optimizer is not called (a loss-scale cell skipping an overflowed update), the
step's end is where forward and backward are known to be done. The batch's samples and tokens are read
from the batch Model hands its callbacks (`cb_params.train_dataset_element`: shapes only, no device
read), the run's last step from the dataset's size times the epochs.

When the train network is (or holds) a `nn.TrainOneStepWithLossScaleCell` (what Model builds for
`loss_scale_manager=DynamicLossScaleManager(...)`, or one handed to Model as the network), every step
also hands the loss_scale feature that cell (its `scale_sense` Parameter, written by its update cell)
and the overflow flag the cell returned, `(loss, overflow, scale, ...)[1]`: the cell skipped the
optimizer exactly when it is true. A plain `TrainOneStepCell` checks no overflow, so it tells no
`UpdateDone` (the loss_scale feature needs the flag).
"""
import mindspore as ms
from mindspore.train import Callback

from mindmon.core.events import GradientsReduced, MicroBatchEnd, ReduceBegin, StepBegin, UpdateDone
from mindmon.loop.loss_scaling import loss_scale_cell
from mindmon.core.optimizer_hooks import hook_optimizer_calls
from mindmon.loop.step import batch_size


class ModelMonitorCallback(Callback):
    """Example:
        group = build_group(config, model=net, parameter_names=[p.name for p in net.trainable_params()])
        Model(train_cell).train(epochs, dataset, callbacks=[ModelMonitorCallback(group)])
    """

    def __init__(self, group):
        super().__init__()
        self.group = group
        self._hooks: list = []
        self._batch = (None, None)    # the running step's (samples, tokens)
        self._computed = True         # the running step's MicroBatchEnd is told

    def on_train_begin(self, run_context):
        params = run_context.original_args()
        start = getattr(params, "cur_step_num", 0) or 0
        batches = getattr(params, "batch_num", None)
        epochs = getattr(params, "epoch_num", None)
        self.group.setup(start_step=start, max_steps=start + batches * epochs if batches and epochs else None)
        optimizer = getattr(params, "optimizer", None) or getattr(params.train_network, "optimizer", None)
        if optimizer is not None and ms.get_context("mode") == ms.PYNATIVE_MODE and \
                self.group.should_take(MicroBatchEnd):
            self._hooks = hook_optimizer_calls(optimizer, self._update_begins, _nothing)

    def on_train_step_begin(self, run_context):
        element = getattr(run_context.original_args(), "train_dataset_element", None)
        self._batch = batch_size(element) if element else (None, None)
        self._computed = False
        self.group.emit(StepBegin())

    def _update_begins(self, optimizer, inputs):
        if self._computed:   # an optimizer called outside Model's step (or twice in one)
            return
        self._computed = True
        self.group.emit(MicroBatchEnd(0, *self._batch))
        self.group.emit(ReduceBegin())
        self.group.emit(GradientsReduced(None))

    def on_train_step_end(self, run_context):
        params = run_context.original_args()
        if not self._computed:
            self._computed = True
            self.group.emit(MicroBatchEnd(0, *self._batch))
        outputs = params.net_outputs
        several = isinstance(outputs, (tuple, list))
        cell = loss_scale_cell(params.train_network)
        if cell is not None and several and len(outputs) >= 2:
            self.group.emit(UpdateDone(overflow=outputs[1], loss_scale=cell))
        self.group.flush(params.cur_step_num, loss=outputs[0] if several else outputs)
        if self.group.should_stop():   # an alert's stop_on_anomaly: Model's loop ends after this step
            run_context.request_stop()

    def on_train_end(self, run_context):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.group.close()


def _nothing(*args):
    """The optimizer's after-hook: the update's end is the train network's return (on_train_step_end)."""
