"""Spec -> generated API: ``python -m codegen [--check] [--spec PATH] [--out DIR]``."""
