"""`make bench`: the numbers behind our speed claims, measured side by side in one run.

`python -m bench.run [--quick]` brings up infra (reused or embedded) and its own stack under a
unique namespace, runs each benchmark module, writes `bench/results.json` and prints a table.
Modules are named for what they measure: `control_plane` (gated latency, throughput, exactly-once),
`trainer_steps`, `checkpoint_io`, `cli_startup`; `stack` owns the services under test and
`report` the results file, the targets and the table.
"""
