"""flashprobe's own evidence (not installed): the mutation suite, rule comparisons, robustness table."""
