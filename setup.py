"""The optional C part of streamkit; everything else is declared in pyproject.toml.

streamkit/message/_runscan.c runs the Sequencer's bulk path about ten times
faster than Python, and streamkit/message/_lines.c decodes JSON lines into
Envelopes about twice as fast. Where they cannot be compiled (no C compiler),
installing goes on without them and sequencer.py and json_lines.py run the
same loops in Python.
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension(f"streamkit.message.{name}", [f"streamkit/message/{name}.c"], optional=True)
    for name in ("_runscan", "_lines")
])
