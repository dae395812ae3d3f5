"""The optional C part of streamkit; everything else is declared in pyproject.toml.

streamkit/message/_runscan.c runs the Sequencer's bulk path about ten times
faster than Python. Where it cannot be compiled (no C compiler), installing
goes on without it and sequencer.py runs the same loop in Python.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("streamkit.message._runscan", ["streamkit/message/_runscan.c"],
                             optional=True)])
