"""Interop with the Hugging Face ecosystem: export, import."""
