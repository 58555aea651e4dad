"""Test doubles that satisfy bunshin's protocols (public, documented)."""
