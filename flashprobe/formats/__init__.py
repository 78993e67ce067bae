"""flashprobe's files: one atomic writer (:mod:`~flashprobe.formats.atomic`), one JSON convention
(:mod:`~flashprobe.formats.jsonio`), path checks (:mod:`~flashprobe.formats.paths`), and one owner per
format:

=====================================  ===============================================
file                                   owner
=====================================  ===============================================
``RUN_DIR/probe.jsonl``                :mod:`flashprobe.formats.probe_log`
``STUDY_DIR/study.json``, ``.csv``     :mod:`flashprobe.formats.study_file`
``RUN_DIR/snapshots/manifest.json``    :mod:`flashprobe.formats.snapshot_manifest`
``DIR/<bench>.json``, ``.csv``         :mod:`flashprobe.bench.results`
``DIR/fuzz.json``                      :mod:`flashprobe.fuzz`
``*.safetensors`` reproducers (+ .py)  :mod:`flashprobe.formats.reproducer`
=====================================  ===============================================
"""

from flashprobe.formats.atomic import (
    atomic_write,
    atomic_write_bytes,
    atomic_write_file,
    atomic_write_text,
)
from flashprobe.formats.jsonio import decode, dumps, encode, number, read_json, write_json
from flashprobe.formats.paths import OutputPathError, prepare_output_dir, safe_name

__all__ = [
    "OutputPathError",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_file",
    "atomic_write_text",
    "decode",
    "dumps",
    "encode",
    "number",
    "prepare_output_dir",
    "read_json",
    "safe_name",
    "write_json",
]
