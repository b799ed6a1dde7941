"""`swiftlm plan`: memory per device and step time of each parallel strategy, from the model config alone; the recommendation `--strategy auto` applies."""
