"""Distributed training: the ``distributed:`` params section and how it becomes `accelerate launch` processes."""
