"""The worker's training: the loop (trainer) and its collaborators, one job each: a step's forward,
backward and optimizer step (step), the loss window (window), the stop protocol (stop), checkpoint
cadence and resume (saving), validation and the test (validation), throughput (throughput) and the
profiler (profiling)."""
