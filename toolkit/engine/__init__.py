"""The engine: a step is arrivals -> schedule -> propose -> ONE forward -> decide -> commit -> outputs.

core.Engine orchestrates; intake, scheduler, runner, decide, commit and outputs are its stages (core's
docstring says who owns each piece of a sequence's state); backends picks what it runs on, speculative
proposes draft tokens, synthetic puts it straight into a decode state for timing. Nothing here imports a
recorded run, the server, the audit or the benchmarks."""
