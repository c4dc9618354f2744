"""Distributed training: rank/world resolution and the communication backends.

Every backend implements `Comm` (llmctl/distributed/base.py); the training loop only talks to that.
Starting, watching and stopping the ranks is job control (llmctl/jobs/), which sits above
`llmctl.train`; nothing here imports it or the training.
"""
from llmctl.distributed.base import Comm, SingleProcessComm

__all__ = ["Comm", "SingleProcessComm"]
