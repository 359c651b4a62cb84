"""The recipes: YAML configs for LightningCLI (``configs/``, shipped with the package and
linked as ``recipes/`` in the repository) and what they name: models (``models``, ``nets``) and
data (``images``: DALI, ``tokens``: generated sequences).

``cswap fit --config cnn`` runs a shipped recipe by name; ``cswap recipes`` lists them. The
classes' sizes are typed ``jsonargparse.typing.PositiveInt``, so LightningCLI refuses a size
below 1 as it parses, naming the key, instead of failing deep inside the first step.

A recipe sized for a GPU ships a CPU size beside it (``configs/cpu/NAME.yaml``, laid over
the recipe by ``--size cpu``): as shipped, such a recipe needs many GB of RAM on the CPU and
minutes a step, so on a machine without CUDA it is refused unless the command line sizes it
(``--size cpu``, ``--size gpu`` for as shipped, or its own ``--model.*``/``--data.*``).
"""

from __future__ import annotations

from pathlib import Path

CONFIGS = Path(__file__).parent / "configs"
SIZES = ("cpu", "gpu")


def shipped() -> dict[str, Path]:
    """The recipe configs installed with the package, by name."""
    return {path.stem: path for path in sorted(CONFIGS.glob("*.yaml"))}


def cpu_size(name: str) -> Path | None:
    """The config that sizes shipped recipe ``name`` for a CPU, where it is sized for a GPU."""
    path = CONFIGS / "cpu" / f"{name}.yaml"
    return path if path.is_file() else None


def sizing(name: str) -> str:
    """What ``cswap recipes`` says of a recipe's size, with the command that runs it on a CPU."""
    if cpu_size(name) is None:
        return f"CPU-sized: cswap fit --config {name}"
    return f"GPU-sized; on a CPU: cswap fit --config {name} --size cpu"


def apply_size(args: list[str], cuda: bool) -> list[str]:
    """``args`` (recipe names resolved) with ``--size cpu`` replaced by the shipped recipe's
    CPU size, laid over the recipe right after its ``--config``, and ``--size gpu`` (as
    shipped) dropped. ``ValueError`` for a size without a shipped GPU-sized recipe, and for a
    GPU-sized recipe run as shipped where ``cuda`` is False and nothing sizes it."""
    out, size = [], None
    for i, arg in enumerate(args):
        if arg == "--size" or arg.startswith("--size="):
            size = arg.partition("=")[2] or (args[i + 1] if i + 1 < len(args) else "")
            if size not in SIZES:
                raise ValueError(f"--size takes {' or '.join(SIZES)}, got {size!r}")
        elif not (i and args[i - 1] == "--size"):
            out.append(arg)
    names = {path.resolve(): name for name, path in shipped().items()}
    at = next((i for i, arg in enumerate(out[:-1])
               if arg in ("--config", "-c") and Path(out[i + 1]).resolve() in names), None)
    name = names[Path(out[at + 1]).resolve()] if at is not None else None
    cpu = cpu_size(name) if name is not None else None
    if size is not None and cpu is None:
        raise ValueError(f"--size {size} sizes a shipped GPU-sized recipe (`cswap recipes` "
                         f"lists them); {name or 'this config'} has no other size")
    if size == "cpu":
        return [*out[:at + 2], "--config", str(cpu), *out[at + 2:]]
    sized_here = any(arg.startswith(("--model.", "--data.")) for arg in out)
    runs = not any(arg.startswith("--print_config") or arg in ("-h", "--help") for arg in out)
    if cpu is not None and size is None and not cuda and not sized_here and runs:
        raise ValueError(
            f"the {name} recipe is sized for a GPU, and torch sees no CUDA device here: on the "
            "CPU it would take many GB of RAM and minutes a step. Run its CPU size: "
            f"cswap fit --config {name} --size cpu (or --size gpu to run it as shipped)")
    return out


def describe(path: Path) -> str:
    """The first sentence of a recipe's opening comment: what it trains."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(lines).split(". ")[0].removesuffix(".") + "."


def resolve_configs(args: list[str]) -> list[str]:
    """``args`` with each ``--config``/``-c`` value that is not a file but a shipped recipe's
    name replaced by that recipe's path; a value that is neither is an error naming both."""
    out = list(args)
    for i, arg in enumerate(out):
        if arg in ("--config", "-c") and i + 1 < len(out):
            out[i + 1] = _resolve(out[i + 1])
        elif arg.startswith(("--config=", "-c=")):
            flag, _, value = arg.partition("=")
            out[i] = f"{flag}={_resolve(value)}"
    return out


def _resolve(value: str) -> str:
    if Path(value).is_file():
        return value
    recipes = shipped()
    name = Path(value).stem if value.endswith(".yaml") else value
    if name in recipes and ("/" not in value or Path(value).parent.name == "recipes"):
        return str(recipes[name])
    raise SystemExit(f"cswap: no recipe config {value!r}: it is not a file, nor a shipped "
                     f"recipe ({', '.join(recipes)}); `cswap recipes` lists them")
