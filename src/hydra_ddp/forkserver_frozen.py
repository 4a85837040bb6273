"""Imported last by the forkserver (startup.PRELOAD), once torch and the project are in: every
object so far goes to the garbage collector's permanent generation (gc.freeze), in the forkserver
and so in every worker forked from it.

Without it each full collection in a worker walks the ~330,000 objects of those imports: 0.3 s
here, once at the end of every run (worker._release) and now and then while it trains, and the
walk writes to every object's header, copying the forkserver's memory pages into each worker.
"""

import gc

gc.freeze()
