"""Distributed training: process groups, launching under torchrun, and strategies."""
