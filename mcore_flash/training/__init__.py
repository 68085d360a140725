"""The pretraining entry point's parts: flags, distributed setup, model, data, loop, checkpoints."""
