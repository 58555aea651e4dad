"""Adapters to the RL frameworks and agent harnesses (one module per framework).

Each module imports its framework lazily, inside the functions that need it, so
``import bunshin`` never pulls a framework in.
"""
