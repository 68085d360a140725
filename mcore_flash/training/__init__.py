"""The trainer: the loop as a recipe (:mod:`.loop`) and its setup builders (data-parallel
wrappers, optimizer, offload, batches), the dry run, metrics, and the hang watchdog."""
