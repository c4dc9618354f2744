"""Job control: choosing a process layout, starting and watching the ranks, stopping them together.

What it is: `run.py` (`run_train`, the one entry point of `llmctl train` in any layout),
`launcher.py` (`launch`: N ranks on one host, their control hub, failure and Ctrl-C handling),
`worker.py` (one rank started by the launcher) and `multinode.py` (`launch_multinode`: one host's
ranks of a job across hosts). It sits above `llmctl.train` and `llmctl.evaluate`, whose work the
ranks run, and above the transports.

What it is not: a transport. The `Comm` implementations, the control channel, the rendezvous and
the rank/world environment are `llmctl.distributed`, which imports nothing from here.
"""
