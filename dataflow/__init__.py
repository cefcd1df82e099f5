"""codesign.dataflow: LLM operator graphs (networkx), roofline analysis, mapping and scheduling."""
