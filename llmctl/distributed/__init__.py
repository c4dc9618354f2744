"""Distributed training: rank/world resolution and the communication backends.

Every backend implements `Comm` (llmctl/distributed/base.py); the training loop only talks to that.
"""
from llmctl.distributed.base import Comm, SingleProcessComm

__all__ = ["Comm", "SingleProcessComm"]
