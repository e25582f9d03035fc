"""Shared builders for the model tests: tiny local transformer models and corpora."""
