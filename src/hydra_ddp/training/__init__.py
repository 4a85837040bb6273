"""The worker side: one worker process (worker) and the training loop (trainer), whose step reads
in four modules: the loop (trainer), a step's arithmetic (step), the loop's state and why it ends
(state), and its measurements: time, throughput, the loss window (meter). Around them: checkpoint
cadence (saving), validation and the test (validation), the profiler (profiling), the run's length
(length), the summary (summary); exact evaluation and eval.py's job (evaluation). Checkpoints are
their own package (hydra_ddp.checkpoint)."""
