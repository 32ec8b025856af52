"""Communication-operator statistics (msprobe's `cc_distribution`): the inputs and outputs of the
collectives a step calls, and `cc_log_only` to list them. Configured in the tensor statistics'
config.json and attached by its hooks (mindmon.features.tensor_stats)."""
