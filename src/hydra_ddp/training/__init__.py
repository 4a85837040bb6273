"""The worker side: one worker process (worker), the training loop (trainer) and its collaborators,
one job each: a step's forward, backward and optimizer step (step), the loss window (window), the
stop protocol (stop), validation and the test (validation), throughput (throughput), the profiler
(profiling), the loop's position (position), per-rank timing (timing); exact evaluation and
eval.py's job (evaluation). Checkpoints are their own package (hydra_ddp.checkpoint)."""
