"""What every tool of a trained model shares: the flags (:mod:`.arguments`) resolved once into
a frozen :class:`~.config.TrainingConfig`, the model (:mod:`.model`), distributed setup
(:mod:`.distributed`), the run's tokenizer (:mod:`.tokenizer`) and loading a trained model
(:mod:`.trained_model`). Nothing is imported here: the flags and config load neither torch nor
megatron-core."""
