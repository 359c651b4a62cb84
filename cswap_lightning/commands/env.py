"""`cswap env`: what a bug report needs to know of this machine, in one block to paste.

The versions of Python, torch and the libraries the integrations use, the CUDA devices, nvcc,
the CUDA codec library (built or not, enabled or not) and the link's bandwidth, measured as the
advisor measures it. Nothing is built or downloaded.
"""

from __future__ import annotations

import os
import platform
import re
from importlib import metadata

import torch

from .. import __version__
from ..codecs import cuda_build
from ..planning.profiler import measure_link

PACKAGES = ("lightning", "torchmetrics", "transformers", "accelerate", "peft", "jsonargparse",
            "nvidia-dali-cuda130", "nvidia-nvcomp-cu13", "torchtune", "torchao")
VARIABLES = ("CSWAP_CUDA_CODECS", "CSWAP_CACHE_DIR", "CUDA_VISIBLE_DEVICES", "CUDA_HOME")


def report() -> str:
    """The report, one ``name  value`` line per fact."""
    rows = [
        ("cswap-lightning", f"{__version__} ({os.path.dirname(os.path.dirname(__file__))})"),
        ("python", f"{platform.python_version()} on {platform.platform()}"),
        ("torch", (f"{torch.__version__} (CUDA build: {torch.version.cuda or 'none'}), "
                   f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs")),
        ("CUDA", _devices()),
        ("nvcc", _nvcc()),
        ("CUDA codecs", _codecs()),
        *[(f"link {device}", _link(device)) for device in _devices_to_measure()],
        ("packages", ", ".join(f"{name} {_version(name)}" for name in PACKAGES)),
        ("environment", ", ".join(f"{name}={os.environ[name]}" for name in VARIABLES
                                  if name in os.environ) or "none of " + ", ".join(VARIABLES)),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _devices() -> str:
    if not torch.cuda.is_available():
        return "not available"
    names = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        names.append(f"cuda:{index} {props.name}, {props.total_memory / 2**30:.1f} GiB, "
                     f"sm_{props.major}{props.minor}")
    return "; ".join(names)


def _nvcc() -> str:
    nvcc = cuda_build.find_nvcc()
    if nvcc is None:
        return "not found (CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda)"
    try:
        release = re.search(r"release [^\n]*", cuda_build.nvcc_version(nvcc))
    except cuda_build.BuildError as err:
        return f"{nvcc}: {err}"
    return f"{nvcc} ({release[0] if release else 'version unknown'})"


def _codecs() -> str:
    """Where the library is built, without building it (nvcc takes minutes)."""
    enabled = ("enabled in every engine (CSWAP_CUDA_CODECS=1)"
               if os.environ.get("CSWAP_CUDA_CODECS") == "1"
               else "not enabled (CSWAP_CUDA_CODECS=1 or enable_cuda_codecs() enables them)")
    try:
        path = cuda_build.library_path()
    except cuda_build.BuildError as err:
        return f"cannot be built: {str(err).splitlines()[0]}; {enabled}"
    built = f"built: {path}" if path.exists() else "not built yet (`cswap build-ext` builds them)"
    return f"{built}; {enabled}"


def _devices_to_measure() -> list[torch.device]:
    if not torch.cuda.is_available():
        return [torch.device("cpu")]
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]


def _link(device: torch.device) -> str:
    link = measure_link(device)
    if device.type == "cpu":
        return f"a copy in host memory at {link.d2h / 1e9:.1f} GB/s (what an offload costs here)"
    return (f"device to host {link.d2h / 1e9:.1f} GB/s, host to device {link.h2d / 1e9:.1f} "
            f"GB/s (pinned), on the device {link.device / 1e9:.0f} GB/s")


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "-"
