"""ModelMonitorCallback: a `mindspore.train.Callback` for `Model.train`, doing for that loop what
MonitorCallback does for MindFormers' trainer: the group is set up at train begin, reset at every step
begin, written at every step end (with the step's loss) and closed at train end.

When the train network is (or holds) a `nn.TrainOneStepWithLossScaleCell` (what Model builds for
`loss_scale_manager=DynamicLossScaleManager(...)`, or one handed to Model as the network), every step
also hands the loss_scale feature that cell (its `scale_sense` Parameter, written by its update cell)
and the overflow flag the cell returned, `(loss, overflow, scale, ...)[1]`: the cell skipped the
optimizer exactly when it is true.
"""
from mindspore.train import Callback

from mindmon.events import StepBegin, UpdateDone
from mindmon.loss_scaling import loss_scale_cell


class ModelMonitorCallback(Callback):
    """Example:
        group = build_group(config, model=net, parameter_names=[p.name for p in net.trainable_params()])
        Model(train_cell).train(epochs, dataset, callbacks=[ModelMonitorCallback(group)])
    """

    def __init__(self, group):
        super().__init__()
        self.group = group

    def on_train_begin(self, run_context):
        params = run_context.original_args()
        batches = getattr(params, "batch_num", None)
        epochs = getattr(params, "epoch_num", None)
        self.group.setup(start_step=getattr(params, "cur_step_num", 0) or 0,
                         max_steps=batches * epochs if batches and epochs else None)

    def on_train_step_begin(self, run_context):
        self.group.emit(StepBegin())

    def on_train_step_end(self, run_context):
        params = run_context.original_args()
        outputs = params.net_outputs
        several = isinstance(outputs, (tuple, list))
        cell = loss_scale_cell(params.train_network)
        if cell is not None and several and len(outputs) >= 2:
            self.group.emit(UpdateDone(overflow=outputs[1], loss_scale=cell))
        self.group.flush(params.cur_step_num, loss=outputs[0] if several else outputs)
        if self.group.should_stop():   # an alert's stop_on_anomaly: Model's loop ends after this step
            run_context.request_stop()

    def on_train_end(self, run_context):
        self.group.close()
