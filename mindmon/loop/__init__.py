"""The plain-loop front door: AccumulatingTrainStep (K micro-batches, one update), the `Model.train`
callback, and where MindSpore's loss scalers keep their scale."""
