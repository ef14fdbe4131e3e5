"""Our stream inside other frameworks: transformers' Trainer, LLaMA-Factory, MindSpore, VeOmni, HyperParallel."""
