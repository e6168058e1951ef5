"""Embedded default model: shapes world, tokenizers, generation pipeline."""
