"""Parallelism: how the model is spread over the ranks (plans: each strategy's rules, checked before
launch; strategy: the wrapped model the loop asks; state: checkpoints of it) and what it sends."""
