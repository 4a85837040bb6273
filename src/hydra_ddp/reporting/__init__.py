"""Reporting: rank 0's loggers and summary (loggers, run_report, flops), and a sweep's scaling
report and trials (scaling, trials). Every rank's own log is runtime.ranklog."""
