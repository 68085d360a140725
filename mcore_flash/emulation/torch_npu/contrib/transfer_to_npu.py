"""Importing this patches torch like torch_npu's ``transfer_to_npu`` (see ``mcore_flash.emulation.transfer``)."""

from mcore_flash.emulation.transfer import apply

apply()
