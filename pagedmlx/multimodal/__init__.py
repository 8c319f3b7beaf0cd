"""Multimodal inputs (images). media.py: loading and checking the images of OpenAI content parts."""
