"""Code in Markdown: the fenced Python blocks and the shell commands a reader would run.

A **snippet** is one fenced ```` ```python ```` block, or one ``flashprobe ...`` / ``python ...``
command of a ```` ```bash ````, ``sh``, ``shell`` or ``console`` block (in ``console`` blocks only
the ``$ ``-prompted lines are commands; the rest is output). A command may be split over lines
with a trailing ``\\``; a ``# comment`` ends it; in ``a && b`` or ``a; b`` each part counts on its
own, so ``pip install -e . && flashprobe study`` yields ``flashprobe study``. A Python block whose
first line is a path comment (``# mypkg/kernels.py``) is a **file** the surrounding text asks the
reader to create; the commands of the same page use it, it is not run on its own.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

__all__ = ["COMMAND_PROGRAMS", "SHELL_LANGUAGES", "Snippet", "extract"]

SHELL_LANGUAGES = frozenset({"bash", "sh", "shell", "console", "zsh"})
PYTHON_LANGUAGES = frozenset({"python", "py", "python3"})
#: config files a page asks the reader to create (a block whose first line is ``# path.yaml``)
YAML_LANGUAGES = frozenset({"yaml", "yml"})
#: the programs whose commands are run; other lines of a shell block (pip, bash .ci/run, wandb
#: sync, cd) are setup or side trips the tests do not repeat
COMMAND_PROGRAMS = ("flashprobe", "python")

_FENCE = re.compile(
    r"^(?P<fence>```+|~~~+)[ \t]*(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=fence)[ \t]*$", re.S | re.M
)
_FILE_COMMENT = re.compile(r"#\s*(?P<path>[\w./-]+\.(?:py|ya?ml))\s*$")


@dataclass(frozen=True)
class Snippet:
    """One runnable piece of a Markdown page.

    Attributes:
        doc: the page's path relative to the repository root (``docs/fuzz.md``).
        block: index of its fenced block among all fenced blocks of the page (0-based).
        part: index of the command within the block (0 for Python blocks).
        kind: ``"python"`` (a block run as a script), ``"file"`` (a Python block to be written
            to ``path``) or ``"command"`` (a shell command).
        text: the code, or the command on one line without its comment.
        line: the 1-based line of the page where the block's code starts.
        path: for ``"file"`` snippets, the relative path the page gives it.
    """

    doc: str
    block: int
    part: int
    kind: str
    text: str
    line: int
    path: str | None = None

    @property
    def id(self) -> str:
        """``docs/fuzz.md:block3`` (``...:block3.1`` for a block's second command)."""
        suffix = f".{self.part}" if self.part else ""
        return f"{self.doc}:block{self.block}{suffix}"

    @property
    def argv(self) -> list[str]:
        """The command split like a POSIX shell would (quotes removed)."""
        return shlex.split(self.text)


def _commands(body: str, lang: str) -> list[str]:
    """The commands of one shell block, each on one line, comments and prompts removed."""
    lines = body.splitlines()
    if lang == "console":
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    joined: list[str] = []
    pending = ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    if pending:
        joined.append(pending)
    commands = []
    for line in joined:
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        tokens = list(lexer)
        current: list[str] = []
        for token in [*tokens, ";"]:
            if token in (";", "&&", "||", "&"):
                if current and current[0] in COMMAND_PROGRAMS:
                    commands.append(shlex.join(current))
                current = []
            else:
                current.append(token)
    return commands


def extract(root: Path, doc: str) -> list[Snippet]:
    """Every snippet of the Markdown page ``root / doc``, in page order."""
    text = (root / doc).read_text(encoding="utf-8")
    snippets = []
    for block, match in enumerate(_FENCE.finditer(text)):
        lang, body = match.group("lang").lower(), match.group("body")
        line = text.count("\n", 0, match.start("body")) + 1
        if lang in PYTHON_LANGUAGES:
            first = body.splitlines()[0] if body.strip() else ""
            if (found := _FILE_COMMENT.fullmatch(first.strip())) is not None:
                snippets.append(Snippet(doc, block, 0, "file", body, line, found.group("path")))
            else:
                snippets.append(Snippet(doc, block, 0, "python", body, line))
        elif lang in YAML_LANGUAGES:
            first = body.splitlines()[0] if body.strip() else ""
            if (found := _FILE_COMMENT.fullmatch(first.strip())) is not None:
                snippets.append(Snippet(doc, block, 0, "file", body, line, found.group("path")))
        elif lang in SHELL_LANGUAGES:
            for part, command in enumerate(_commands(body, lang)):
                snippets.append(Snippet(doc, block, part, "command", command, line))
    return snippets
