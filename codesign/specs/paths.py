"""Output paths a command will write, checked before it does any work: argparse types (`output_file`,
`output_dir`) that refuse, with the argument's name and exit status 2, a file path that is a folder or lies in a
folder that does not exist, and a folder path that is a file. Why before: a long run (a sweep, a generation) should
not end in a traceback at its last step, nor leave a half-written temporary file beside the target."""

from __future__ import annotations

import argparse
from pathlib import Path


def output_file(value: str) -> Path:
    """argparse type: a file to write (new or replaced); its folder must exist."""
    path = Path(value)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{value!r} is a folder, not a file to write")
    if not path.parent.is_dir():  # (a bare name's parent is ".")
        raise argparse.ArgumentTypeError(f"folder {str(path.parent)!r} for {value!r} does not exist")
    return path


def output_dir(value: str) -> Path:
    """argparse type: a folder to write into (made if missing); not an existing file."""
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{value!r} is a file, not a folder to write into")
    return path
