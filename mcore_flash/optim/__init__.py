"""Optimizers megatron-core's own do not provide: :class:`~.host_adam.HostAdamW`, the host
step with narrower Adam moments."""
