"""The worker side: one worker process (worker), the training loop (trainer) and its collaborators,
one job each: a step's forward, backward and optimizer step (step), the loss window (window), the
stop protocol (stop), checkpoint cadence and resume (saving), validation and the test (validation),
throughput (throughput), the profiler (profiling) and the loop's position (position); writing and
restoring checkpoints (checkpointing, atomic_files), exact evaluation and eval.py's job (evaluation),
per-rank timing (timing)."""
