"""`mcore-flash pretrain` with a planted defect, for tests/emulation/test_rehearsal.py (run under torchrun).

    python -m torch.distributed.run ... tests/_support/rehearsal_worker.py --plant-cpu-collective <pretrain flags>

``--plant-cpu-collective`` puts back the trainer's original SIGTERM check, which
all-reduced a CPU tensor on the default group every iteration (issue 10, defect 1).
"""

import sys

import torch
import torch.distributed as dist

from mcore_flash.pretrain import main
from mcore_flash.training import loop


def _cpu_flags_agreed(self, diverged: bool, out_of_time: bool) -> tuple[bool, bool, bool]:
    flags = torch.tensor(
        [int(diverged), int(self._flag), int(out_of_time)]
    )  # a CPU tensor: no NCCL/HCCL backend serves it
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return bool(flags[0]), bool(flags[1]), bool(flags[2])


if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--plant-cpu-collective" in argv:
        argv.remove("--plant-cpu-collective")
        loop._StopSignal.agreed = _cpu_flags_agreed
    sys.exit(main(argv))
