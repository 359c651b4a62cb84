"""GPUs the estimate knows, and how long a traced kernel takes on one: a roofline at rates
calibrated on the measured profiles.

A kernel (``trace.Kernel``) takes the longer of its floating-point work at the tensor cores'
achieved rate and its bytes at the memory's achieved rate, plus a fixed time per kernel (the
launch, and the host issuing the next op: forward runs Python for every op, backward the
autograd engine's C++). The datasheet figures (dense bf16 tensor FLOP/s, fp32 FLOP/s, memory
bandwidth) are the vendors'; the achieved fractions come from measurements:

- **matrix products and attention**: 0.78 of the bf16 peak, the H200 check's four 8192-cube
  bf16 matmuls (5.62-5.72 ms, ``benchmarks/results/measure-h200-2026-11-26*.md``); the H100
  has the same compute die and is given the same;
- **memory**: each measured device's copy (bytes read and written per second against its
  datasheet bandwidth): the H100's 1.44 TB/s copied is 0.86 of 3.35 TB/s, the H200's 1.53
  TB/s (64 MiB) 0.64 of 4.8;
- **fitted** (``calibration.py`` fits them again and the tests check these): the time per
  kernel in forward and in backward on each measured machine, from GPT-2 medium's plain
  forward and backward there; convolutions' fraction of the bf16 peak from VGG-16 (H100);
  batch norm's fraction of the memory rate from ResNet-50 (H100).

The measured H100 is an SXM board, though the project's notes call it "H100 PCIe" after its
host link (PCIe Gen5, as every H100's): its name ("NVIDIA H100 80GB HBM3") is the SXM5's, and
its device copy moved 2.88 TB/s, more than the PCIe card's 2.0 TB/s memory.

The other devices take the H100's fractions and its machine's time per kernel (their hosts
were never measured), and their links are nominal (PCIe at the 0.85 of nominal that the H100
and H200 measured). Every time derived here is an estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .replay import GB, Link
from .trace import Kernel

MiB = 1 << 20
_TENSOR_DTYPES = (torch.bfloat16, torch.float16)
PCIE_FRACTION = 0.85  # of nominal, measured on the H100 (54-55 of 64 GB/s) and the H200


@dataclass(frozen=True)
class Rates:
    """Achieved fractions and times per kernel (module docstring)."""

    matmul: float  # of the tensor peak: matrix products, attention
    conv: float  # of the tensor peak: convolutions
    memory: float  # of the datasheet bandwidth: everything else
    norm: float  # of the memory rate: batch norm (NCHW), far below a copy
    forward_kernel_s: float
    backward_kernel_s: float


@dataclass(frozen=True)
class Device:
    """A GPU: datasheet figures, its link to the host, and the rates it is estimated with."""

    key: str
    name: str
    memory_bytes: int  # what the driver reports as the device's total
    tensor_flops: float  # dense bf16/fp16 FLOP/s
    fp32_flops: float  # fp32 FLOP/s without tensor cores (PyTorch's default for fp32)
    bandwidth: float  # memory bytes per second (datasheet)
    link: Link
    attention: str  # the fused attention kernel PyTorch picks there (trace.ATTENTION_KERNELS)
    rates: Rates
    measured: str  # what of it this project measured, or "nothing"

    def kernel_s(self, kernel: Kernel) -> float:
        """Estimated seconds of one traced kernel."""
        r = self.rates
        peak = self.tensor_flops if kernel.dtype in _TENSOR_DTYPES else self.fp32_flops
        fraction = {"matmul": r.matmul, "attention": r.matmul, "conv": r.conv}.get(kernel.kind)
        compute = kernel.flops / (peak * fraction) if fraction else 0.0
        memory = kernel.bytes / (self.bandwidth * r.memory * (r.norm if kernel.kind == "norm"
                                                                else 1.0))
        fixed = r.backward_kernel_s if kernel.backward else r.forward_kernel_s
        return max(compute, memory) + fixed


# Calibrated (module docstring; calibration.fit() recomputes the fitted ones).
MATMUL_FRACTION = 0.78
CONV_FRACTION = 0.27
NORM_FRACTION = 0.198
H100_RATES = Rates(MATMUL_FRACTION, CONV_FRACTION, 0.86, NORM_FRACTION, 41.8e-6, 26.8e-6)
H200_RATES = Rates(MATMUL_FRACTION, CONV_FRACTION, 0.64, NORM_FRACTION, 24.5e-6, 17.3e-6)


def _copy(bandwidth: float) -> float:
    """A device copy's bytes copied per second where none was measured: the H100's fraction
    (1.44 TB/s copied of 3.35 TB/s read and written)."""
    return bandwidth * H100_RATES.memory / 2


def _pcie4(bandwidth: float) -> Link:
    """PCIe Gen4 x16 (32 GB/s nominal each way) at the fraction the Gen5 links measured."""
    return Link(PCIE_FRACTION * 32 * GB, PCIE_FRACTION * 32 * GB, _copy(bandwidth))


DEVICES: dict[str, Device] = {d.key: d for d in (
    Device("h100-sxm", "H100 SXM 80GB", 81559 * MiB, 989e12, 67e12, 3.35e12,
           Link(54 * GB, 54 * GB, 1440 * GB), "cudnn", H100_RATES,
           "the 2026-11-24 run's profiles, link and device copy (\"NVIDIA H100 80GB HBM3\")"),
    Device("h100-pcie", "H100 PCIe 80GB", 81559 * MiB, 756e12, 51e12, 2.0e12,
           Link(54 * GB, 54 * GB, _copy(2.0e12)), "cudnn", H100_RATES, "nothing"),
    Device("h200", "H200 141GB", 143771 * MiB, 989e12, 67e12, 4.8e12,
           Link(55 * GB, 55 * GB, 1529 * GB), "cudnn", H200_RATES,
           "the 2026-11-26 check's profiles, link, device copy and matmuls"),
    Device("a100-80gb", "A100 SXM 80GB", 81920 * MiB, 312e12, 19.5e12, 2.039e12,
           _pcie4(2.039e12), "flash", H100_RATES, "nothing"),
    Device("l40s", "L40S 48GB", 46068 * MiB, 362e12, 91.6e12, 0.864e12,
           _pcie4(0.864e12), "flash", H100_RATES, "nothing"),
    Device("rtx-4090", "GeForce RTX 4090 24GB", 24564 * MiB, 165e12, 82.6e12, 1.008e12,
           _pcie4(1.008e12), "flash", H100_RATES, "nothing"),
    # NVLink-C2C: 450 GB/s each way nominal; the design notes' 295 GB/s for pinned copies
    Device("gh200", "GH200 96GB (NVLink-C2C)", 97871 * MiB, 989e12, 67e12, 4.0e12,
           Link(295 * GB, 295 * GB, _copy(4.0e12)), "cudnn", H100_RATES, "nothing"),
)}


def device(key: str) -> Device:
    """The device of ``key`` (``DEVICES``), with the choices named where it is unknown."""
    try:
        return DEVICES[key]
    except KeyError:
        raise ValueError(f"unknown device {key!r}; choose from {', '.join(DEVICES)}") from None
