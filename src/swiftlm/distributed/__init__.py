"""Distributed training: launching under torchrun, process groups, the device mesh, the
parallelize sequence (TP -> activation checkpointing -> compile -> FSDP2/DDP), pipeline
stages, and the strategies the loop drives (strategy.py)."""
