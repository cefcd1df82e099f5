"""Model and GPU catalogues (data files) and a Hugging Face config.json reader."""
