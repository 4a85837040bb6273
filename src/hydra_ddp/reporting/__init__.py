"""Reporting: every rank's log (ranklog), rank 0's loggers and summary (loggers, run_report), and a
sweep's scaling report (scaling)."""
