"""Emu3 (transformers' Emu3ForConditionalGeneration) as a model family: models/emu3/family.py.

Imported by models/family.py on the first family lookup; nothing else imports it.
"""
