"""Janus (transformers' JanusForConditionalGeneration) as a model family: models/families/janus/family.py.

Imported by models/families/family.py on the first family lookup; nothing else imports it.
"""
