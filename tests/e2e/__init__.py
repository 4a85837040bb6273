"""The end-to-end layer: tests that start real processes (train.py and eval.py as a user runs them,
launchers, workers, signals, servers, a Slurm cluster, network namespaces). Every test here carries
the `e2e` marker (conftest.py here). A package, so that its modules may share a name with
tests/unit's (`e2e.test_search`, `unit.test_search`)."""
