"""Hydra discovers flashprobe's search-path plugin here (the ``hydra_plugins`` namespace package)."""
