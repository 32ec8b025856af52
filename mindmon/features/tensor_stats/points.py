"""The names tensor statistics are known by: the collection points (record kinds, CSV file prefixes) and
the statistics a row can hold."""

# The collection points, in the order msprobe documents its CSV prefixes.
PARAM_ORIGIN = "param_origin"        # parameters before the optimizer update
PARAM_UPDATED = "param_updated"      # parameters after the update
GRAD_UNREDUCED = "grad_unreduced"    # gradients before the data-parallel reduction
GRAD_REDUCED = "grad_reduced"        # gradients the optimizer gets
EXP_AVG = "exp_avg"                  # Adam's first moment, before the update
EXP_AVG_SQ = "exp_avg_sq"            # Adam's second moment, before the update
ACTV = "actv"                        # cells' forward inputs and outputs, per micro-step
ACTV_GRAD = "actv_grad"              # gradients of those inputs and outputs, per micro-step
POINTS = (PARAM_ORIGIN, PARAM_UPDATED, GRAD_UNREDUCED, GRAD_REDUCED, EXP_AVG, EXP_AVG_SQ, ACTV, ACTV_GRAD)
OPS = ("min", "max", "mean", "norm", "zeros", "nans", "id")   # the statistics a row can hold
