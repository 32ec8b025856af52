"""Wiring into training frameworks. Only `mindformers.py` imports MindFormers."""
