"""The recipes: YAML configs for LightningCLI (``configs/``, shipped with the package and
linked as ``recipes/`` in the repository) and what they name: models (``models``, ``nets``) and
data (``images``: DALI, ``tokens``: generated sequences).

``cswap fit --config cnn`` runs a shipped recipe by name; ``cswap recipes`` lists them. The
classes' sizes are typed ``jsonargparse.typing.PositiveInt``, so LightningCLI refuses a size
below 1 as it parses, naming the key, instead of failing deep inside the first step.
"""

from __future__ import annotations

from pathlib import Path

CONFIGS = Path(__file__).parent / "configs"


def shipped() -> dict[str, Path]:
    """The recipe configs installed with the package, by name."""
    return {path.stem: path for path in sorted(CONFIGS.glob("*.yaml"))}


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
