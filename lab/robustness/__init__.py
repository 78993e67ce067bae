"""The robustness table: bad inputs and faults against every ``flashprobe`` command.

Run it with ``python -m pytest lab/robustness``.
"""
