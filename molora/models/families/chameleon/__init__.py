"""Chameleon / Anole (transformers' ChameleonForConditionalGeneration) as a model family: models/families/chameleon/family.py.

Imported by models/families/family.py on the first family lookup; nothing else imports it.
"""
