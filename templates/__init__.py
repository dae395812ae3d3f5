"""`streamkit new`'s templates, read with importlib.resources (see streamkit/cli/new.py).

This folder is the package streamkit.templates: pyproject.toml maps it there, and ships the
`*.tmpl` files of app/ and stores/ as its package data. This file makes it a regular package,
which setuptools' editable installs need to find a package mapped outside streamkit/.
"""
