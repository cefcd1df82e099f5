"""codesign.accel_model: cycle-level accelerator models (systolic array, memories, PIM, vector, KV quant)."""
