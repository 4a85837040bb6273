"""The training recipe beside the model and the data: the optimizer's parameter groups (optimizer),
per-step learning-rate schedules (schedules), activation checkpointing (activation_checkpointing)
and the weights' moving average (ema). Read by the launch side's checks, built by the workers."""
