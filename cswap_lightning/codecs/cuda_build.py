"""Build the CUDA codec library (``cuda_ext/cswap_codec.cu``) with nvcc, into a per-user cache.

The library is cached at ``<cache>/<key>/libcswap_codec.so``, where ``<cache>`` is
``$CSWAP_CACHE_DIR``, else ``$XDG_CACHE_HOME/cswap-lightning``, else
``~/.cache/cswap-lightning``, and ``<key>`` hashes the sources, the nvcc version and the flags,
so a changed source or toolkit builds anew. Directories are created with mode 0o700. One rule
(:func:`check_cache_file`) decides what cswap reads from the cache, the library and the kernel
tuning alike: a file is used only if it, its folder and the cache root belong to the current
user and are not writable by group or others.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

LIBRARY_NAME = "libcswap_codec.so"
# The one file nvcc compiles, then what it includes (all of them hashed into the build key).
SOURCE_NAMES = ("cswap_codec.cu", "cswap_codec.h", "codec_common.cuh", "compaction.cuh",
                "exponent.cuh", "lossy.cuh")
# SASS for Ampere (sm_80, also runs on sm_86/sm_89) and Hopper, plus PTX that newer GPUs JIT.
ARCH_FLAGS = (
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=sm_90",
    "-gencode=arch=compute_90,code=compute_90",
)
NVCC_FLAGS = ("-O3", "-shared", "-Xcompiler", "-fPIC", "-std=c++17", "--threads", "0")
NVCC_MISSING = (
    "nvcc (the CUDA compiler) was not found: install the CUDA toolkit and put its bin/ folder "
    "on PATH, or set CUDA_HOME to the toolkit's root"
)


class BuildError(RuntimeError):
    """The library could not be built, or a cached one is not safe to load."""


def source_dir() -> Path:
    """The folder of the shipped ``.cu``/``.cuh``/``.h`` sources (package data of
    ``cswap_lightning``)."""
    return Path(str(resources.files("cswap_lightning") / "cuda_ext"))


def find_nvcc() -> str | None:
    """nvcc from ``$CUDA_HOME``/``$CUDA_PATH``, then ``PATH``, then ``/usr/local/cuda``."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and os.access(Path(root, "bin", "nvcc"), os.X_OK):
            return str(Path(root, "bin", "nvcc"))
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if os.access(default, os.X_OK) else None


def nvcc_version(nvcc: str) -> str:
    try:
        done = subprocess.run(
            [nvcc, "--version"], check=False, capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        raise BuildError(f"could not run {nvcc} --version: {err}") from err
    if done.returncode != 0:
        raise BuildError(f"{nvcc} --version failed: {done.stderr.strip()}")
    return done.stdout.strip()


def cache_root() -> Path:
    if os.environ.get("CSWAP_CACHE_DIR"):
        return Path(os.environ["CSWAP_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "cswap-lightning"


def build_key(nvcc_version_text: str, flags: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for name in SOURCE_NAMES:
        digest.update(name.encode() + b"\0" + (source_dir() / name).read_bytes() + b"\0")
    digest.update(nvcc_version_text.encode() + b"\0" + "\0".join(flags).encode())
    return digest.hexdigest()[:20]


def check_private(path: Path) -> None:
    """Refuse ``path`` unless the current user owns it and only they can write to it; the
    error says how to fix it."""
    st = path.lstat()
    own = "set CSWAP_CACHE_DIR to a folder of your own"
    if stat.S_ISLNK(st.st_mode):
        raise BuildError(f"refusing {path}: it is a symbolic link; remove it, or {own}")
    if st.st_uid != os.getuid():
        raise BuildError(
            f"refusing {path}: owned by uid {st.st_uid}, not by uid {os.getuid()}; {own}"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise BuildError(
            f"refusing {path}: writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
            f"run `chmod go-w {path}`, or {own}"
        )


def check_cache_file(path: Path) -> None:
    """Refuse ``path``, a file ``<cache root>/<folder>/<name>``, unless the root, the folder and
    the file are private (:func:`check_private`): who can write to any of them can swap the
    file. The loader applies it to the library, the tuner to its cache; FileNotFoundError if
    any of them is missing."""
    path = Path(path)
    for p in (path.parent.parent, path.parent, path):
        check_private(p)


def make_cache_folder(folder: Path) -> None:
    """Create ``<cache root>/<folder>`` with mode 0o700 where missing, then refuse it, as
    :func:`check_cache_file` would, unless the folder and the root are private."""
    folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.mkdir(mode=0o700, exist_ok=True)
    check_private(folder.parent)
    check_private(folder)


def library_path(
    nvcc: str | None = None, cache_dir: Path | None = None, arch_flags: tuple[str, ...] = ARCH_FLAGS
) -> Path:
    """Where :func:`build` puts the library for this nvcc; raises BuildError if nvcc is missing."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise BuildError(NVCC_MISSING)
    flags = NVCC_FLAGS + tuple(arch_flags)
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    return root / build_key(nvcc_version(nvcc), flags) / LIBRARY_NAME


def build(
    nvcc: str | None = None,
    cache_dir: Path | None = None,
    arch_flags: tuple[str, ...] = ARCH_FLAGS,
    force: bool = False,
) -> Path:
    """Compile the library unless a safe cached copy exists; return its path."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise BuildError(NVCC_MISSING)
    target = library_path(nvcc, cache_dir, arch_flags)
    folder = target.parent
    make_cache_folder(folder)
    if target.exists() and not force:
        check_private(target)
        return target
    # Compile to a private temporary name, then rename: concurrent builds never see half a file.
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=folder)
    os.close(fd)
    src = source_dir()
    cmd = [nvcc, *NVCC_FLAGS, *arch_flags, "-I", str(src), "-o", tmp, str(src / SOURCE_NAMES[0])]
    try:
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise BuildError(
                f"nvcc failed (exit {done.returncode}): {' '.join(cmd)}\n"
                f"{done.stderr.strip() or done.stdout.strip()}"
            )
        os.chmod(tmp, 0o700)
        os.replace(tmp, target)
    except subprocess.TimeoutExpired as err:
        raise BuildError(f"nvcc timed out after {err.timeout} s: {' '.join(cmd)}") from err
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    check_private(target)
    return target
