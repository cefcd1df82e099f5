"""Module paths of codesign.dataflow that moved into sub-packages: importable, with a DeprecationWarning."""

from codesign.accel_model._moved import install

MOVED = {
    f"codesign.dataflow.explore_{m}": f"codesign.dataflow.explore.{m}"
    for m in ("space", "search", "eval", "engine", "store", "report", "cli")
}

install(MOVED)
