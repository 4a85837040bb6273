"""The weighting the project replaced, kept for the tests that show it fails: a causal language
model whose training loss is each micro-batch's own mean over its counted tokens, and whose
micro-batches and ranks weigh alike (a task that weighs samples), as a transformers model's own
`loss` is when nothing passes it the step's count."""

from hydra_ddp.tasks import CausalLM, Task


class MeanPerBatch(CausalLM):
    units = Task.units  # no units of its own: each micro-batch's mean weighs as much as another's
