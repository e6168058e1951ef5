"""The Gradio demo: `python app.py`.

app/ui.py lays out the page and its handlers, app/session.py holds per-visitor state, app/uploads.py checks uploaded
adapters, app/render.py turns generation events into what the page shows. Import from the submodules
(`from app.ui import build_demo`) so that, e.g., upload checks work without loading Gradio's page code.
"""
