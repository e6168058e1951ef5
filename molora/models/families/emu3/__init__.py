"""Emu3 (transformers' Emu3ForConditionalGeneration) as a model family: models/families/emu3/family.py.

Imported by models/families/family.py on the first family lookup; nothing else imports it.
"""
