"""The pretraining entry point's parts: flags (``arguments``) resolved once into a frozen
``config``, distributed setup, model, data, the loop as a recipe (``loop``), checkpoints."""
