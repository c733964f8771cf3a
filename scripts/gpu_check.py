"""The device checks of ``scripts/gpu-check`` that need no other process: what the GPU is, NVML
read from it the way the agent's health watch reads it, and a one-rank NCCL group built, used
and aborted through :class:`~torchpass_p2p.collective.ManagedGroup`. Prints one line per check
and exits 1 at the first that fails."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from torchpass_p2p.collective import GroupSpec, ManagedGroup
from torchpass_p2p.collective.group import GROUP_TIMEOUT_S


def device() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: nothing to check")
    props = torch.cuda.get_device_properties(0)
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    print(f"device: {props.name}, {props.total_memory / 2**30:.0f} GiB, torch "
          f"{torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}")


def nvml() -> None:
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        ecc = pynvml.nvmlDeviceGetTotalEccErrors(
            handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)
        rows = pynvml.nvmlDeviceGetRemappedRows(handle)
        reasons = pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle)
        temp = pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU)
        print(f"nvml: {pynvml.nvmlDeviceGetName(handle)}, driver "
              f"{pynvml.nvmlSystemGetDriverVersion()}, {temp} C, uncorrected ECC {ecc}, "
              f"remapped rows {rows}, clock event reasons {reasons:#x}")
    finally:
        pynvml.nvmlShutdown()


def nccl_group() -> None:
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = __import__("datetime").timedelta(seconds=GROUP_TIMEOUT_S)
    t0 = time.monotonic()
    pg = dist.ProcessGroupNCCL(dist.HashStore(), 0, 1, opts)
    group = ManagedGroup(pg, GroupSpec(0, 0, 1, 0), "nccl", time.monotonic() - t0,
                         device=torch.device("cuda", 0))
    x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    mean = group.mean_in_rank_order(x, watch=lambda: False)
    if not torch.equal(mean, x):
        raise SystemExit("nccl: the mean over one rank is not the tensor itself")
    built = time.monotonic() - t0
    group.interrupt()  # NCCL aborts in place
    print(f"nccl: one-rank group built and used in {built:.2f} s, aborted: {group.state}")


def main() -> int:
    device()
    nvml()
    nccl_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
