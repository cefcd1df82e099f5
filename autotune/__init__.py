"""codesign.autotune: per-GPU kernel tuning, shipped config tables and run-time lookup."""
