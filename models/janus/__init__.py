"""Janus (transformers' JanusForConditionalGeneration) as a model family: models/janus/family.py.

Imported by models/family.py on the first family lookup; nothing else imports it.
"""
