"""torch_npu.contrib of the emulated torch_npu."""
