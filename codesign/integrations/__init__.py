"""Integrations of codesign's kernels, caches and cost models with other frameworks (`codesign.integrations.hf`:
Hugging Face transformers)."""
