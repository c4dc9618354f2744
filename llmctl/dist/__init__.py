"""Distributed training: rank/world resolution and the communication backends.

Every backend implements `Comm` (llmctl/dist/base.py); the training loop only talks to that.
"""
from llmctl.dist.base import Comm, SingleProcessComm

__all__ = ["Comm", "SingleProcessComm"]
