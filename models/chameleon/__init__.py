"""Chameleon / Anole (transformers' ChameleonForConditionalGeneration) as a model family: models/chameleon/family.py.

Imported by models/family.py on the first family lookup; nothing else imports it.
"""
