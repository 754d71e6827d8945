"""The default model: what ``aserve run`` and ``aserve generate`` serve when given none.

A 4.3M-parameter Llama trained by ``scripts/train_default_model.py`` on text that ships
with Python (the ``pydoc_data`` topics and the standard library's docstrings), with its
own 4,096-entry tokenizer and a ChatML template, committed next to this file. It answers
in readable, Python-flavoured English (and is wrong about Python as often as not):
``docs/default-model.md`` has its held-out perplexity and samples. It loads in well under
a second and needs nothing downloaded. Tests build their own random models
(``aserve.model_builder``).
"""

from __future__ import annotations

from pathlib import Path

#: What ``aserve run`` and ``aserve generate`` say on stderr when given no model.
NOTE = ("aserve: no model given: the default model (4.3M parameters trained on Python's own documentation, "
        "docs/default-model.md); give a Hugging Face directory to serve your own")


def default_model_dir() -> Path:
    """The committed model's directory (inside the installed package)."""
    return Path(__file__).resolve().parent
