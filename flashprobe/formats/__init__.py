"""flashprobe's files: one writer for every file, one convention for JSON, one owner per format.

* :mod:`~flashprobe.formats.atomic` — every file is written atomically (temporary file, fsync,
  rename) with the umask's permissions;
* :mod:`~flashprobe.formats.jsonio` — non-finite numbers in JSON are ``"nan"``/``"inf"``/``"-inf"``,
  ``null`` means not recorded;
* :mod:`~flashprobe.formats.paths` — output directories and names used in file names are checked
  before any work;
* :mod:`~flashprobe.formats.run_dir` — what a run directory holds, which of it flashprobe owns (and
  alone deletes), and the checkpoint a resume continues from;

and the formats, each read and written by one module only:

=====================================  ===============================================
file                                   owner
=====================================  ===============================================
``RUN_DIR/probe.jsonl``                :mod:`flashprobe.formats.probe_log`
``STUDY_DIR/study.json``, ``.csv``     :mod:`flashprobe.formats.study_file`
``RUN_DIR/snapshots/`` (+ manifest)    :mod:`flashprobe.weights.store`
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
