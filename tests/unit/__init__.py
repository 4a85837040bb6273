"""The unit layer: tests that run in the test's own process (no subprocess, no server, no cluster;
a gloo group of one process in the test's own process counts as in-process). `make test-unit`
runs it, in well under a minute. A package, so that its modules may share a name with tests/e2e's
(`unit.test_search`, `e2e.test_search`): tests/ itself stays off the package path and on
sys.path."""
