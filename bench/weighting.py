"""The weighting the project replaced, for bench/language_model.py's measure of what weighing by
tokens costs: each micro-batch's mean loss over its counted tokens, micro-batches and ranks alike
(a task that weighs samples: no count is all-reduced)."""

from hydra_ddp.tasks import CausalLM, Task


class MeanPerBatch(CausalLM):
    units = Task.units  # no units of its own: samples, each micro-batch's mean alike
