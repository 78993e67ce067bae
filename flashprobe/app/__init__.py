"""The application layer: ``flashprobe train`` (the Hydra app around :mod:`flashprobe.t2i`) and
``flashprobe study`` (the paper's §V study). The library layers never import it.
"""
