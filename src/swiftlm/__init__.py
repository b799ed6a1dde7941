"""swiftlm: train and serve language models with one command, from a laptop CPU to a cluster."""

__version__ = "0.1.0"
