"""The commands: the CLI, the yaml training app, warmup, report, the LLaMA-Factory launcher."""
