"""Parallelism: the process group and the host's facts (distributed), how the model is spread over
the ranks (plans: each strategy's rules, checked before launch; strategy: the wrapped model the loop
asks; state: checkpoints of it), and how gradients travel (comm: DDP's hooks; shared_memory)."""
