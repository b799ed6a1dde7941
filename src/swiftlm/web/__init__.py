"""`swiftlm web`: a browser UI over ordinary swiftlm runs (configure, start/stop/resume, watch, chat, export, evaluate)."""
