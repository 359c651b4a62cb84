"""What the YAML recipes in ``recipes/`` name: models (``models``, ``nets``) and data
(``images``: DALI, ``tokens``: generated sequences). Run one with
``cswap fit --config recipes/NAME.yaml``."""
