"""codesign.dataflow: LLM operator graphs (networkx), roofline analysis, mapping and scheduling."""

from codesign.dataflow import _moved  # noqa: F401  (old module paths: see _moved.py)
