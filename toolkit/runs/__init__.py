"""A recorded run: session.record() serves added requests to completion and writes the run directory (the
trace, requests, manifest, summary), workload builds the requests a run serves, metrics, plots and loggers
report it; signals takes Ctrl-C and SIGTERM between steps (record() and the soaks)."""
