"""Hydra configs of ``flashprobe train`` and ``flashprobe study`` (a package so Hydra finds them)."""
