"""Parallelism: the process group and the host's facts (distributed), how the model is spread over
the ranks (strategies/: one module per strategy, behind one protocol; state: checkpoints of it), and
how gradients travel (comm: DDP's hooks; shared_memory)."""
