"""One-line adapters for trainers: ``lightning`` (strategies) and ``hf`` (a Trainer callback).

Each is imported on its own, so that using one never imports the other's framework.
"""
